"""SIGHUP reloads the daemon in place (an exec of the installed daemon): no engine restarted,
the round and the weight version kept; a reload whose checks fail changes nothing.

The daemon spawns its engines as it always does, with `python` pointed at a script that
serves the protocol stand-in (harness/standin_engine.py; not vLLM) and keeps one child in its
process group, as test_restart_faults.py does. The real-engine reload is in
tests/engine/test_one_engine_real.py.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from vime.supervisor import limits
from vime.supervisor.client import SupervisorClient
from vime.harness.local_daemon import (
    Daemon, free_port, kill_all, live_pids_in_groups, one_call, standin_config, write_config)

from test_restart_faults import FAKE_PYTHON, model_dir, spawned  # noqa: E402  (the same stand-in)


@pytest.fixture
def world(tmp_path):
    yield from make_world(tmp_path)


# The same stand-in, which exits 1 at once while the file $STANDIN_FAIL_FILE exists (a start
# that keeps failing, for FATAL).
FAILING_PYTHON = FAKE_PYTHON.replace(
    "import asyncio, subprocess, sys\n",
    "import asyncio, os, subprocess, sys\nif os.path.exists(os.environ['STANDIN_FAIL_FILE']): sys.exit(1)\n", 1)
assert FAILING_PYTHON != FAKE_PYTHON


def make_world(tmp_path, env: dict[str, str] | None = None):
    fake = tmp_path / "fake-python"
    fake.write_text(FAILING_PYTHON)
    fake.chmod(0o755)
    model = model_dir(tmp_path / "model")
    cfg = standin_config(
        tmp_path, fake, restart={"backoff_initial": 0.2},
        engine_defaults={"env": {"STANDIN_FAIL_FILE": str(tmp_path / "fail")}},
        engines=[spawned("e0", model, free_port()), spawned("e1", model, free_port())],
    )
    d = Daemon(cfg, env=env)
    w = type("World", (), {})()
    w.cfg, w.daemon, w.sock = cfg, d, str(tmp_path / "run" / "supervisor.sock")
    try:
        d.transition("e0", "RUNNING", 30)
        d.transition("e1", "RUNNING", 30)
        yield w
    finally:
        kill_all([d], {e["pid"] for e in d.events if e.get("event") == "engine.adopted"})


def started(d: Daemon, generation: int, after: int = 0, timeout: float = 30) -> dict:
    return d.wait_for(lambda e: e.get("event") == "supervisor.started" and e.get("generation") == generation,
                      timeout, after=after)


def engine_pids(sock: str) -> dict[str, int]:
    return {e["name"]: e["pid"] for e in SupervisorClient(sock).status()["engines"]}


def test_sighup_mid_round_re_execs_and_keeps_engines_round_and_version(world):
    d, sock = world.daemon, world.sock
    c = SupervisorClient(sock)
    c.publish_weights(3)
    c.start_round(7)
    before = c.status()
    pids = engine_pids(sock)
    routable = c.routable_engines()["engines"]
    mark = d.mark()
    d.proc.send_signal(signal.SIGHUP)
    again = started(d, 1, after=mark)
    assert again["pid"] == d.proc.pid and d.proc.poll() is None  # the same process, a new image
    events = d.events[mark:]
    assert [e["event"] for e in events if e["event"] in ("supervisor.detaching", "supervisor.reexec")] == [
        "supervisor.detaching", "supervisor.reexec"]
    assert {e["engine"] for e in events if e.get("event") == "engine.adopted"} == {"e0", "e1"}
    assert not [e for e in events if e.get("event") in ("engine.spawned", "supervisor.stopping")]
    # The socket answers once the engines were checked again: the fleet as it was left.
    after = c.status()
    assert (after["round"], after["round_open"], after["weight_version"]) == (7, True, 3)
    assert (before["daemon"]["reloads"], after["daemon"]["reloads"]) == (0, 1)
    assert after["daemon"]["pid"] == before["daemon"]["pid"] == d.proc.pid
    assert engine_pids(sock) == pids
    assert [e["state"] for e in after["engines"]] == [e["state"] for e in before["engines"]]
    assert c.routable_engines()["engines"] == routable
    for pid in pids.values():  # engines do not inherit the handover
        assert b"VIME_SUPERVISOR_HANDOVER" not in Path(f"/proc/{pid}/environ").read_bytes()
    # The round goes on and ends; the next one starts.
    c.end_round(7)
    c.start_round(8)
    assert c.status()["round"] == 8
    # After the reload the engines are this image's children: an exit is reaped with its status.
    mark = d.mark()
    os.kill(pids["e0"], signal.SIGKILL)
    exited = d.transition("e0", "EXITED", 10, after=mark)
    assert "killed by SIGKILL" in exited["reason"], exited
    # A second daemon cannot take the directories the reload handed over.
    second = subprocess.run([sys.executable, "-m", "vime.supervisor", "--config", str(world.cfg)],
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 1 and f"pid {d.proc.pid}" in second.stderr, second.stderr
    # A plain stop after a reload stops every engine.
    assert d.terminate(30) == 0
    assert live_pids_in_groups(set(pids.values())) == []


def test_a_reload_that_fails_its_checks_changes_nothing(world):
    d, sock, cfg = world.daemon, world.sock, world.cfg
    c = SupervisorClient(sock)
    c.start_round(1)
    pids = engine_pids(sock)
    good = cfg.read_text()
    cfg.write_text(good + "\n[health_check]\ntimeout = nan\n")  # the installed daemon would refuse it
    events = c.events()
    assert next(events)["event"] == "hello"
    mark = d.mark()
    d.proc.send_signal(signal.SIGHUP)
    refused = d.wait_for(lambda e: e.get("event") == "supervisor.reload_refused", 60, after=mark)
    assert "--check-config` exited 2" in refused["why"] and "health_check" in refused["why"], refused
    # The fleet's own changes may come first (a stand-in's late probe on a loaded machine).
    fleet = {"keepalive", "transition", "detection", "membership", "floor_breach", "floor_restored"}
    ev = next(e for e in events if e["event"] not in fleet)
    assert ev["event"] == "reload_refused" and ev["why"] == refused["why"]
    events.close()
    assert engine_pids(sock) == pids and c.status()["round_open"] is True
    assert not [e for e in d.events[mark:] if e.get("event") in ("supervisor.detaching", "supervisor.reexec")]
    # Fixed, the next SIGHUP reloads.
    cfg.write_text(good)
    mark = d.mark()
    d.proc.send_signal(signal.SIGHUP)
    started(d, 1, after=mark)
    assert engine_pids(sock) == pids and c.status()["round"] == 1


def test_a_reload_under_a_hard_limit_below_the_estimate_keeps_the_engines(world):
    """A daemon already holding its fleet under a hard open-file limit below the estimate (as one
    started with engines to adopt does, or one whose limit was lowered while it ran): a reload's
    `--check-config` says the limit but does not refuse, and the new image re-adopts every
    engine. The same check run for a fresh start still refuses (exit 2), and so does a reload
    whose config adds an engine past the limit."""
    d, sock, cfg = world.daemon, world.sock, world.cfg
    c = SupervisorClient(sock)
    c.start_round(4)
    pids, before = engine_pids(sock), c.status()
    held = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
    limit = limits.nofile_needed(2, 0) - 1  # below the estimate whatever the warm-up
    assert held + 16 < limit, (held, limit)  # room for the daemon as it runs
    resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (limit, limit))
    fresh = subprocess.run(["sh", "-c", 'ulimit -n "$1" && shift && exec "$@"', "sh", str(limit), sys.executable,
                            "-m", "vime.supervisor", "--config", str(cfg), "--check-config"],
                           capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 2 and "open-file limit" in fresh.stderr, fresh
    mark = d.mark()
    d.proc.send_signal(signal.SIGHUP)
    started(d, 1, after=mark, timeout=60)
    events = d.events[mark:]
    assert not [e for e in events if e.get("event") == "supervisor.reload_refused"]
    low = next(e for e in events if e.get("event") == "limits.nofile_low")
    assert f"hard open-file limit is {limit}" in low["problem"] and "adopt 2 running engine(s)" in low["problem"], low
    assert {e["engine"] for e in events if e.get("event") == "engine.adopted"} == {"e0", "e1"}
    assert not [e for e in events if e.get("event") == "engine.spawned"]
    after = c.status()
    assert engine_pids(sock) == pids and after["daemon"]["reloads"] == 1
    assert [e["state"] for e in after["engines"]] == [e["state"] for e in before["engines"]] == ["RUNNING"] * 2
    assert (after["round"], after["round_open"]) == (4, True)
    # A config that adds an engine needs more than the running fleet: that reload is refused.
    cfg.write_text(cfg.read_text() + f'\n[[engines]]\nname = "e2"\nmodel = "{cfg.parent / "model"}"\n'
                   f'served_model_name = "tiny"\nport = {free_port()}\n')
    mark = d.mark()
    d.proc.send_signal(signal.SIGHUP)
    refused = d.wait_for(lambda e: e.get("event") == "supervisor.reload_refused", 60, after=mark)
    assert "open-file limit" in refused["why"], refused
    assert engine_pids(sock) == pids and c.status()["daemon"]["reloads"] == 1


def test_sigterm_during_a_reload_stops_the_engines(world):
    d, sock = world.daemon, world.sock
    pids = engine_pids(sock)
    d.proc.send_signal(signal.SIGHUP)
    time.sleep(0.05)  # the reload's checks run; the stop comes while they do, or just after
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(60) == 0
    assert live_pids_in_groups(set(pids.values())) == []


def test_systemd_hears_the_start_extended_and_the_reload(tmp_path):
    addr = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(addr)
        sock.settimeout(30)
        heard: list[str] = []

        def until(line_start: str) -> list[str]:
            got = []
            while not any(m.startswith(line_start) for msg in got for m in msg.splitlines()):
                got.append(sock.recv(4096).decode())
            heard.extend(got)
            return got

        for w in make_world(tmp_path, env={"NOTIFY_SOCKET": addr}):
            # While first starts run, each message extends TimeoutStartSec by 30 s.
            assert "EXTEND_TIMEOUT_USEC=30000000" in until("READY=1")
            w.daemon.proc.send_signal(signal.SIGHUP)
            reloading = next(m for m in until("RELOADING=1") if m.startswith("RELOADING=1"))
            assert "MONOTONIC_USEC=" in reloading
            assert until("READY=1")[-1].startswith("READY=1\nSTATUS=2/2 engines RUNNING")
            assert SupervisorClient(w.sock).status()["daemon"]["reloads"] == 1


def zombies_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == "Z" and int(fields[1]) == pid:
                out.append(int(entry))
    return out


def test_a_reload_keeps_the_state_dir_and_reaps_what_it_stops(world):
    d, sock, cfg = world.daemon, world.sock, world.cfg
    c = SupervisorClient(sock)
    c.start_round(2)
    good = cfg.read_text()
    # Moving the journal's directory would lose the round and restart every engine: refused.
    cfg.write_text(good.replace(str(Path(world.sock).parents[1] / "state"), str(Path(world.sock).parents[1] / "moved")))
    assert cfg.read_text() != good
    mark = d.mark()
    d.proc.send_signal(signal.SIGHUP)
    refused = d.wait_for(lambda e: e.get("event") == "supervisor.reload_refused", 60, after=mark)
    assert refused["why"].startswith("state_dir changed from ") and "restart" not in refused["why"].split(";")[0]
    assert c.status()["round_open"] is True and c.status()["daemon"]["reloads"] == 0
    # An engine whose args changed is stopped and started again with the new ones; the old
    # process (the daemon's child across the exec) is reaped, not left a zombie.
    pids = engine_pids(sock)
    cfg.write_text(good.replace('name = "e1"', 'name = "e1"\nargs = ["--seed", "7"]', 1))
    mark = d.mark()
    d.proc.send_signal(signal.SIGHUP)
    started(d, 1, after=mark)
    not_adopted = d.wait_for(lambda e: e.get("event") == "journal.not_adopted", 5, after=mark)
    assert not_adopted["engine"] == "e1" and "another config" in not_adopted["why"]
    d.transition("e1", "STALE", 30, after=mark)  # a new engine: it joins routing after round 2
    assert engine_pids(sock)["e0"] == pids["e0"] and engine_pids(sock)["e1"] != pids["e1"]
    assert zombies_of(d.proc.pid) == []


def test_a_fatal_engine_stays_fatal_across_a_reload(tmp_path):
    for w in make_world(tmp_path):
        d, sock = w.daemon, w.sock
        c = SupervisorClient(sock)
        # e1 fails for good: every start exits 1 at once.
        mark = d.mark()
        (tmp_path / "fail").write_text("")
        os.kill(engine_pids(sock)["e1"], signal.SIGKILL)
        fatal = d.transition("e1", "FATAL", 60, after=mark)
        mark = d.mark()
        d.proc.send_signal(signal.SIGHUP)
        started(d, 1, after=mark)
        e1 = next(e for e in c.status()["engines"] if e["name"] == "e1")
        assert e1["state"] == "FATAL" and e1["reason"] == fatal["reason"] + " (FATAL before a reload)"
        assert not [e for e in d.events[mark:] if e.get("event") == "engine.spawned"]


def other_group() -> int | None:
    """A group the socket can be given that is not the one a fresh bind gives it (root: any)."""
    if os.geteuid() == 0:
        return 65534
    return next((g for g in os.getgroups() if g != os.getegid()), None)


class Caller(threading.Thread):
    """Calls the socket without pause, each call on a new connection with no retry: a status,
    or the next round's start or end (each changes the round once: one lost or answered twice
    is a 409 or leaves the round where it should not be)."""

    def __init__(self, sock: str, rounds: bool):
        super().__init__(daemon=True)
        self.sock, self.rounds = sock, rounds
        self.calls: list[tuple[float, float, Any]] = []  # (sent, answered, reloads or round)
        self.errors: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        n = 199  # the calls go 200 (round 100 starts), 201 (it ends), 202 (round 101 starts), ...
        while not self.halt.is_set():
            sent = time.time()
            try:
                if self.rounds:  # round n starts, then ends; each call changes something once
                    n += 1
                    phase = "end" if n % 2 else "start"
                    code, body = one_call(self.sock, "POST", f"/v1/rounds/{n // 2}/{phase}")
                    ok, what = code == 200 and body["changed"] is True, n
                else:
                    code, body = one_call(self.sock, "GET", "/v1/status")
                    ok, what = code == 200, body["daemon"]["reloads"]
            except Exception as e:  # ConnectionRefusedError, FileNotFoundError, a drop: all failures here
                self.errors.append(f"{type(e).__name__}: {e}")
                time.sleep(0.05)
                continue
            if not ok:
                self.errors.append(f"{code}: {body}")
            self.calls.append((sent, time.time(), what))


def ts(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def test_calls_during_reloads_wait_for_the_next_image_and_none_is_refused(world):
    d, sock, cfg = world.daemon, world.sock, world.cfg
    first = os.lstat(sock)
    group, good = other_group(), cfg.read_text()
    callers = [Caller(sock, rounds=False), Caller(sock, rounds=True)]
    for c in callers:
        c.start()
    try:
        # The first reload sets socket_group, the second keeps it, the third removes it: the
        # socket handed over takes the configured group each time, and its mode.
        for gen, new_group in ((1, group), (2, group), (3, None)):
            if new_group is not None:
                cfg.write_text(good.replace("[supervisor]\n", f'[supervisor]\nsocket_group = "{new_group}"\n', 1))
            else:
                cfg.write_text(good)
            time.sleep(0.5)  # calls answered by this image before the signal
            mark = d.mark()
            d.proc.send_signal(signal.SIGHUP)
            up = started(d, gen, after=mark, timeout=60)
            listening = next(e for e in d.events[mark:] if e.get("event") == "control.listening")
            assert listening["inherited"] is True, listening
            st = os.lstat(sock)
            assert (st.st_dev, st.st_ino) == (first.st_dev, first.st_ino)  # the same socket file
            assert stat.S_IMODE(st.st_mode) == 0o660
            assert st.st_gid == (new_group if new_group is not None else os.getegid())
            # A status call sent before the new image served was answered by it: it waited in
            # the backlog across the exec (without the handover it is refused: an error).
            deadline = time.monotonic() + 30
            while not any(sent < ts(listening) and what == gen for sent, _, what in callers[0].calls):
                assert time.monotonic() < deadline, "no call made during the exec was answered"
                time.sleep(0.1)
            assert up["pid"] == d.proc.pid
    finally:
        for c in callers:
            c.halt.set()
        for c in callers:
            c.join(90)
    assert [c.errors for c in callers] == [[], []]
    last = callers[1].calls[-1][2]
    now = SupervisorClient(sock).status()
    assert (now["round"], now["round_open"]) == (last // 2, last % 2 == 0)  # the last call's round, as it left it
    assert not [e for e in d.events if e.get("event") == "control.handover_refused"]


# Starts the daemon with a handover as a reload would write it, for this very pid.
HANDING_OVER = ("import json, os, sys; h = json.loads(os.environ.pop('TEST_HANDOVER')); h['pid'] = os.getpid(); "
                "os.environ['VIME_SUPERVISOR_HANDOVER'] = json.dumps(h); os.execv(sys.argv[1], sys.argv[1:])")


def test_a_handover_naming_a_wrong_fd_binds_a_fresh_socket(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    path = str(run / "supervisor.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # what a previous image left: its file
    stale.bind(path)
    stale.listen(1)
    st = os.lstat(path)
    named = {"fd": 2, "path": path, "sock_dev": 0, "sock_ino": 0, "dev": st.st_dev, "ino": st.st_ino}
    cfg = write_config(tmp_path / "sup.toml",
                       supervisor={"runtime_dir": str(run), "log_dir": str(tmp_path / "logs"),
                                   "state_dir": str(tmp_path / "state")},
                       engines=[{"name": "none", "url": "http://127.0.0.1:9"}])
    handover = json.dumps({"generation": 1, "locks": {}, "listener": named})
    d = Daemon(cfg, env={"TEST_HANDOVER": handover}, launcher=(sys.executable, "-c", HANDING_OVER))
    try:
        refused = d.wait_for(lambda e: e.get("event") == "control.handover_refused", 30)
        assert refused["why"] == "fd 2 is not the socket the previous image handed over", refused
        listening = d.wait_for(lambda e: e.get("event") == "control.listening", 30)
        assert listening["inherited"] is False
        status = SupervisorClient(path).status()  # answered on the fresh socket, not the stale one
        assert status["daemon"]["pid"] == d.proc.pid
        assert os.lstat(path).st_ino != st.st_ino and stat.S_IMODE(os.lstat(path).st_mode) == 0o660
        # fd 2, its stderr, was left alone: it goes on logging.
        mark = d.mark()
        d.proc.send_signal(signal.SIGTERM)
        d.wait_for(lambda e: e.get("event") == "supervisor.stopped", 30, after=mark)
        assert d.proc.wait(30) == 0
    finally:
        d.kill()
        stale.close()
