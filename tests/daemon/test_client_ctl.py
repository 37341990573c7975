"""supervisor/client/ (sync and async) and supervisorctl, against a real daemon (`python -m vime.supervisor`).

No vLLM engine boots here; real engines are covered by tests/engine/test_engines_real.py. The module's
daemon supervises three engines:

  live     attached to a PROTOCOL STAND-IN (tests/support/standin_versioned.py, an aiohttp server answering
           /health, /v1/completions and /weight_info like vLLM does): it becomes RUNNING.
  dead     attached to a port where nothing listens: STARTING, then EXITED after first_wait.
  spawned  spawned by the daemon itself, with supervisor.python pointing at the same stand-in
           script, so stop/start/restart and the engine log run for real on a process group
           the daemon owns.

The stand-ins report the weight version written to a file, so a test publishes version V
after "syncing" it there (as a trainer would): publishing never leaves them STALE.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from vime.supervisor.client.cli import describe, status_lines
from vime.supervisor.client import (
    DEFAULT_SOCKET,
    AsyncSupervisorClient,
    BadRequest,
    ConflictError,
    ConnectionLost,
    DaemonUnreachable,
    LogTail,
    SupervisorClient,
    SupervisorError,
    UnknownEngine,
)
from vime.harness.local_daemon import Daemon, free_port, live_pids_in_groups, standin_python, write_config

from support.standins import STANDIN_VERSIONED

REPO = Path(__file__).resolve().parents[2]
FIRST_WAIT = 5.0
HEALTH = {"first_wait": FIRST_WAIT, "interval": 1.0, "timeout": 1.0}
ENGINES = ("live", "dead", "spawned")
NAME_W, STATE_W = 33, 10  # supervisord's "%-33s%-10s%s" for names up to 30 characters


# -- helpers ---------------------------------------------------------------------------------


def wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listening on {port} after {timeout}s")


def listening(d: Daemon, timeout: float = 15.0) -> None:
    d.wait_for(lambda e: e.get("event") == "control.listening", timeout)


def engines_by_name(st: dict) -> dict[str, dict]:
    return {e["name"]: e for e in st["engines"]}


def wait_state(client: SupervisorClient, name: str, states: set[str], timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        e = engines_by_name(client.status())[name]
        if e["state"] in states:
            return e
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} is {e['state']} ({e['reason']}), not {states} after {timeout}s")
        time.sleep(0.1)


def next_round(st: dict) -> int:
    return (st["round"] or 0) + 1


def ctl(*args: str, sock: str | os.PathLike | None, env: dict | None = None, timeout: float = 30
        ) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "vime.supervisor.client.cli"]
    if sock is not None:
        cmd += ["--socket", str(sock)]
    full_env = {k: v for k, v in os.environ.items() if k != "VIME_SUPERVISOR_SOCKET"}
    full_env.update(env or {})
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=full_env)


class EventReader:
    """Reads a sync events() generator on a thread, so a test can wait with a timeout."""

    def __init__(self, gen):
        self.gen = gen
        self.q: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for ev in self.gen:
                self.q.put(ev)
                if self.stop.is_set():
                    break
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.q.put(e)
        finally:
            self.gen.close()

    def next(self, timeout: float = 10.0) -> dict:
        item = self.q.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    def until(self, pred, timeout: float = 10.0) -> tuple[dict, list[dict]]:
        """The first event matching pred, and every event before it."""
        seen: list[dict] = []
        deadline = time.monotonic() + timeout
        while True:
            ev = self.next(max(0.01, deadline - time.monotonic()))
            if pred(ev):
                return ev, seen
            seen.append(ev)


async def anext_within(agen, timeout: float = 10.0) -> dict:
    return await asyncio.wait_for(agen.__anext__(), timeout)


async def async_until(agen, pred, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        ev = await anext_within(agen, max(0.01, deadline - time.monotonic()))
        if pred(ev):
            return ev


# -- the module's daemon ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("client-ctl")
    version_file = root / "standin-weight-version"
    standin = standin_python(root, STANDIN_VERSIONED)
    model = root / "model"  # the daemon's config check wants a directory with config.json
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = {**os.environ, "STANDIN_VERSION_FILE": str(version_file)}
    live_port = free_port()
    live = subprocess.Popen([str(standin), "--port", str(live_port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(live_port)
    cfg = write_config(
        root / "supervisor.toml",
        supervisor={"runtime_dir": str(root / "run"), "log_dir": str(root / "logs"), "stop_timeout": 3.0,
                    "python": str(standin)},
        health_check=HEALTH,
        engines=[
            {"name": "live", "url": f"http://127.0.0.1:{live_port}"},
            {"name": "dead", "url": f"http://127.0.0.1:{free_port()}"},
            {"name": "spawned", "model": str(model), "port": free_port(),
             "env": {"STANDIN_VERSION_FILE": str(version_file)}},
        ],
    )
    d = Daemon(cfg)
    try:
        listening(d)
        f = SimpleNamespace(daemon=d, root=root, sock=str(root / "run" / "supervisor.sock"), live_port=live_port,
                            version_file=version_file)
        client = SupervisorClient(f.sock)
        for name in ("live", "spawned"):
            wait_state(client, name, {"RUNNING"})
        yield f
    finally:
        try:
            d.terminate(20)
        except subprocess.TimeoutExpired:  # see test_sigterm_with_an_open_event_stream
            d.kill()
            for pid, _, _ in live_pids_in_groups(set(d.spawned_pids())):
                os.kill(pid, signal.SIGKILL)
        live.terminate()
        live.wait(10)


@pytest.fixture
def client(fleet) -> SupervisorClient:
    return SupervisorClient(fleet.sock)


@pytest.fixture
def aclient(fleet) -> AsyncSupervisorClient:
    return AsyncSupervisorClient(fleet.sock)


def sync_weights(fleet, version: int) -> None:
    """What a trainer does before publishing: the engines get the weights (here: the stand-ins
    report `version` from now on)."""
    fleet.version_file.write_text(str(version))


# -- client: reads ---------------------------------------------------------------------------


def check_status(st: dict, live_port: int) -> None:
    by = engines_by_name(st)
    assert set(by) == set(ENGINES)
    assert by["live"]["state"] in ("RUNNING", "SUSPECT") and by["live"]["pid"] is None
    assert by["live"]["url"] == f"http://127.0.0.1:{live_port}"
    assert isinstance(by["spawned"]["pid"], int) and by["spawned"]["spawned"] is True
    assert by["dead"]["state"] in ("STARTING", "EXITED") and by["dead"]["routable"] is False
    for key in ("round", "round_open", "weight_version", "epoch"):
        assert key in st


def check_routable(r: dict) -> None:
    assert set(r) == {"epoch", "weight_version", "engines", "weights"}
    assert r["weights"] == {"mode": "sync", "max_staleness": 0}  # the bound in force
    names = {e["name"] for e in r["engines"]}
    assert {"live", "spawned"} <= names and "dead" not in names
    assert all(e["url"].startswith("http://127.0.0.1:") for e in r["engines"])


def test_status_and_routable_sync(fleet, client):
    check_status(client.status(), fleet.live_port)
    check_routable(client.routable_engines())


async def test_status_and_routable_async(fleet, aclient):
    check_status(await aclient.status(), fleet.live_port)
    check_routable(await aclient.routable_engines())


def test_metrics_sync_and_async(client, aclient):
    text = client.metrics()
    assert 'vime_engine_routable{engine="live"} 1.0' in text
    assert 'vime_engine_state{engine="dead",state="RUNNING"} 0.0' in text
    assert "vime_round " in text
    text = asyncio.run(aclient.metrics())
    assert 'vime_engine_routable{engine="spawned"} 1.0' in text


# -- client: rounds --------------------------------------------------------------------------


def test_rounds_sync(client):
    n = next_round(client.status())
    first = client.start_round(n)
    assert first == {"round": n, "open": True, "changed": True, "message": f"round {n} open"}
    assert client.start_round(n)["changed"] is False  # a repeat (a retry) is a no-op
    with pytest.raises(ConflictError) as e:
        client.start_round(n + 1)
    assert e.value.status == 409 and e.value.code == "conflict"
    assert f"round {n} is still open" in e.value.message
    with pytest.raises(ConflictError, match=f"round {n} is open, not round {n + 1}"):
        client.end_round(n + 1)  # out of order
    assert client.end_round(n)["changed"] is True
    assert client.end_round(n)["changed"] is False
    with pytest.raises(ConflictError, match=f"round {n} is stale"):
        client.start_round(n)
    with pytest.raises(BadRequest, match="must be a non-negative integer") as e:
        client.start_round(-1)
    assert e.value.status == 400
    st = client.status()
    assert st["round"] == n and st["round_open"] is False


async def test_rounds_async(aclient):
    n = next_round(await aclient.status())
    assert (await aclient.start_round(n))["changed"] is True
    assert (await aclient.start_round(n))["changed"] is False
    with pytest.raises(ConflictError, match="still open"):
        await aclient.start_round(n + 2)
    with pytest.raises(ConflictError, match=f"not round {n - 1}"):
        await aclient.end_round(n - 1)
    assert (await aclient.end_round(n))["changed"] is True
    assert (await aclient.end_round(n))["changed"] is False
    with pytest.raises(ConflictError, match="stale"):
        await aclient.start_round(n - 1)


def test_round_context_manager_sync(client):
    n = next_round(client.status())
    with client.round(n) as started:
        assert started["changed"] is True
        st = client.status()
        assert st["round"] == n and st["round_open"] is True
    assert client.status()["round_open"] is False
    with pytest.raises(RuntimeError, match="rollout failed"):
        with client.round(n + 1):
            raise RuntimeError("rollout failed")
    st = client.status()
    assert st["round"] == n + 1 and st["round_open"] is False  # ended although the body raised


async def test_round_context_manager_async(aclient):
    n = next_round(await aclient.status())
    async with aclient.round(n):
        assert (await aclient.status())["round_open"] is True
    assert (await aclient.status())["round_open"] is False
    with pytest.raises(ValueError, match="bad batch"):
        async with aclient.round(n + 1):
            raise ValueError("bad batch")
    st = await aclient.status()
    assert st["round"] == n + 1 and st["round_open"] is False


# -- client: weights -------------------------------------------------------------------------


def make_checkpoint(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.zeros(2, dtype=np.float32)}, str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    return path


def test_publish_with_a_malformed_fingerprint_is_refused_and_publishes_nothing(fleet, client):
    before = client.status()["weight_version"]
    bad = {"prompts": [[1, 2, 3]], "logprobs": [[-1.0]], "tolerance": 1e-4}  # 2 logprobs needed
    with pytest.raises(BadRequest, match=r"fingerprint.logprobs\[0\] must be 2 logprobs") as e:
        client.publish_weights((before or 0) + 1, fingerprint=bad)
    assert e.value.status == 400 and client.status()["weight_version"] == before


def test_publish_weights_sync(fleet, client, tmp_path, monkeypatch):
    v = (client.status()["weight_version"] or 0) + 1
    sync_weights(fleet, v)
    r = client.publish_weights(v)
    assert r["changed"] is True and r["weight_version"] == v and "stale" not in r["message"]
    assert client.publish_weights(v)["changed"] is False  # a repeat (a retry) is a no-op
    with pytest.raises(ConflictError, match=f"weight version {v - 1} is stale") as e:
        client.publish_weights(v - 1)
    assert e.value.status == 409
    with pytest.raises(BadRequest, match="does not exist; publish a directory saved with") as e:
        client.publish_weights(v + 1, tmp_path / "no-such-checkpoint")
    assert e.value.status == 400 and str(tmp_path / "no-such-checkpoint") in e.value.message
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BadRequest, match="has no config.json"):
        client.publish_weights(v + 1, empty)
    # A relative checkpoint means our working directory, not the daemon's.
    ckpt = make_checkpoint(tmp_path / "step")
    monkeypatch.chdir(tmp_path)
    sync_weights(fleet, v + 1)
    r = client.publish_weights(v + 1, "step")
    assert r["changed"] is True and r["weight_version"] == v + 1
    st = client.status()
    assert st["weight_version"] == v + 1 and st["checkpoint"] == str(ckpt)
    by = engines_by_name(st)
    for name in ("live", "spawned"):
        assert by[name]["weight_version"] == v + 1 and by[name]["routable"] is True
    assert {e["name"] for e in client.routable_engines()["engines"]} == {"live", "spawned"}


async def test_publish_weights_async(fleet, aclient, tmp_path):
    v = ((await aclient.status())["weight_version"] or 0) + 1
    sync_weights(fleet, v)
    assert (await aclient.publish_weights(v))["changed"] is True
    assert (await aclient.publish_weights(v))["changed"] is False
    with pytest.raises(ConflictError, match="stale"):
        await aclient.publish_weights(v - 1)
    with pytest.raises(BadRequest, match="does not exist"):
        await aclient.publish_weights(v + 1, str(tmp_path / "missing"))
    with pytest.raises(BadRequest, match="version must be >= 0"):
        await aclient.publish_weights(-1)
    assert (await aclient.routable_engines())["weight_version"] == v


# -- client: the sync agent's verbs ---------------------------------------------------------


def test_agent_sync_flow_sync(fleet, client):
    """role="agent" gets sync_request events for STALE engines; sync_begin/sync_end bring them
    back (the daemon verifies /weight_info and a deep probe). close() ends the stream."""
    for name in ("live", "spawned"):
        wait_state(client, name, {"RUNNING"})
    agent = SupervisorClient(fleet.sock)
    reader = EventReader(agent.events(role="agent"))
    try:
        agent_flow(fleet, client, reader)
    finally:
        t0 = time.monotonic()
        agent.close()  # from this thread, while the reader's thread waits in recv
        reader.thread.join(5)
    assert not reader.thread.is_alive() and time.monotonic() - t0 < 5
    with pytest.raises(ValueError, match="role must be"):
        next(client.events(role="trainer"))


def agent_flow(fleet, client: SupervisorClient, reader: EventReader) -> None:
    assert reader.next()["event"] == "hello"
    v = client.status()["weight_version"] + 1
    r = client.publish_weights(v)  # the engines still report the old version: STALE
    assert r["message"].endswith("stale (not routable until synced): live, spawned")
    asked = {}
    while len(asked) < 2:
        ev, _ = reader.until(lambda e: e["event"] == "sync_request")
        asked[ev["engine"]] = ev
    assert {n: (e["version"], e["url"].startswith("http://127.0.0.1:")) for n, e in asked.items()} == {
        "live": (v, True), "spawned": (v, True)}
    assert client.routable_engines()["engines"] == []
    with pytest.raises(ConflictError, match=f"version {v - 1} is not current"):
        client.sync_begin("live", v - 1)
    with pytest.raises(ConflictError, match="not SYNCING: call sync/begin first"):
        client.sync_end("live", v, ok=True)
    with pytest.raises(ConflictError, match="dead is (STARTING|EXITED), not STALE"):
        client.sync_begin("dead", v)
    sync_weights(fleet, v)  # the push itself (here: the stand-ins report v from now on)
    for name in ("live", "spawned"):
        began = client.sync_begin(name, v)
        assert began == {"engine": name, "url": asked[name]["url"], "version": v}
        assert engines_by_name(client.status())[name]["state"] == "SYNCING"
        with pytest.raises(ConflictError, match="not STALE"):
            client.sync_begin(name, v)
        done = client.sync_end(name, v, ok=True)
        assert done["state"] == "RUNNING", done
    assert {e["name"] for e in client.routable_engines()["engines"]} == {"live", "spawned"}


async def test_agent_sync_failed_push_async(fleet, aclient):
    """sync_end(ok=False): the daemon treats the engine as poisoned and restarts it."""
    await asyncio.to_thread(wait_state, SupervisorClient(fleet.sock), "spawned", {"RUNNING"})
    before = engines_by_name(await aclient.status())["spawned"]
    agent = AsyncSupervisorClient(fleet.sock)
    agen = agent.events(role="agent")
    try:
        await failed_push_flow(fleet, aclient, agent, agen, before)
    finally:
        await agent.aclose()
        await agen.aclose()


async def failed_push_flow(fleet, aclient, agent, agen, before) -> None:
    assert (await anext_within(agen))["event"] == "hello"
    v = (await aclient.status())["weight_version"] + 1
    await aclient.publish_weights(v)
    ev = await async_until(agen, lambda e: e["event"] == "sync_request" and e["engine"] == "spawned")
    assert ev["version"] == v
    sync_weights(fleet, v)  # what the restarted engine will load
    assert (await aclient.sync_begin("live", v))["engine"] == "live"
    assert (await aclient.sync_end("live", v, ok=True))["state"] == "RUNNING"
    assert (await aclient.sync_begin("spawned", v))["version"] == v
    done = await aclient.sync_end("spawned", v, ok=False, error="NCCL timeout in the test")
    assert "poisoned: push of v%d failed: NCCL timeout in the test" % v in done["reason"]
    await agent.aclose()
    with pytest.raises(StopAsyncIteration):  # the stream ended, no reconnect
        while True:
            await anext_within(agen, 5)
    e = await asyncio.to_thread(wait_state, SupervisorClient(fleet.sock), "spawned", {"RUNNING"})
    assert e["incarnation"] > before["incarnation"] and e["weight_version"] == v


# -- client: engines -------------------------------------------------------------------------


def test_engine_errors_sync(client):
    with pytest.raises(UnknownEngine) as e:
        client.restart("no-such-engine")
    assert e.value.status == 404 and e.value.code == "unknown_engine"
    assert "known: live, dead, spawned" in e.value.message
    with pytest.raises(UnknownEngine):
        client.engine_log("no-such-engine")
    with pytest.raises(ConflictError, match="live is attached .* cannot stop it; only retire it"):
        client.stop("live")
    with pytest.raises(ConflictError, match="cannot restart it"):
        client.restart("live")
    with pytest.raises(ConflictError) as e:
        client.engine_log("live")
    assert e.value.code == "no_log" and "attached engines have none" in e.value.message
    assert isinstance(e.value, SupervisorError)


async def test_engine_errors_async(aclient):
    with pytest.raises(UnknownEngine, match="no engine named 'nope'"):
        await aclient.stop("nope")
    with pytest.raises(ConflictError, match="cannot start it"):
        await aclient.start("live")
    with pytest.raises(ConflictError, match="has no log"):
        await aclient.engine_log("dead")


def test_spawned_engine_stop_start_log_sync(fleet, client):
    before = engines_by_name(client.status())["spawned"]
    r = client.stop("spawned")
    assert r == {"engine": "spawned", "action": "stop", "state": "STOPPED", "message": "stopped",
                 "incarnation": before["incarnation"]}
    assert client.stop("spawned")["message"] == "already STOPPED"  # a repeat is harmless
    e = engines_by_name(client.status())["spawned"]
    assert e["state"] == "STOPPED" and e["pid"] is None and e["reason"] == "stopped by request"
    r = client.start("spawned")
    assert r["message"] == f"starting (incarnation {before['incarnation'] + 1})"
    e = wait_state(client, "spawned", {"RUNNING"})
    assert e["pid"] not in (None, before["pid"])
    log = client.engine_log("spawned", nbytes=4096)
    assert isinstance(log, LogTail) and f"stand-in engine pid {e['pid']} serving" in log
    assert log.path.endswith(f"spawned.{e['incarnation']}.log")
    assert len(client.engine_log("spawned", nbytes=10).encode()) <= 10


async def test_spawned_engine_restart_log_async(fleet, aclient):
    st = await aclient.status()
    before = engines_by_name(st)["spawned"]
    r = await aclient.restart("spawned")
    assert r["message"] == f"starting (incarnation {before['incarnation'] + 1})"
    assert (await aclient.start("spawned"))["message"].startswith(("already", "starting"))
    e = await asyncio.to_thread(wait_state, SupervisorClient(fleet.sock), "spawned", {"RUNNING"})
    assert e["restarts"] == before["restarts"] + 1 and e["pid"] != before["pid"]
    log = await aclient.engine_log("spawned")
    assert f"stand-in engine pid {e['pid']}" in log and log.path.endswith(f".{e['incarnation']}.log")


def test_report_failure_sync_and_async(client, aclient):
    wait_state(client, "live", {"RUNNING"})
    r = client.report_failure("live", "rollout request timed out")
    assert r["engine"] == "live" and r["counted"] is True and r["consecutive_failures"] >= 1
    assert r["failure_threshold"] == 3
    r = asyncio.run(aclient.report_failure("dead", "connection refused"))
    assert r["counted"] is False and "failures count only while it serves" in r["message"]
    with pytest.raises(UnknownEngine):
        asyncio.run(aclient.report_failure("nope", "x"))


# -- client: events --------------------------------------------------------------------------


def test_events_sync(fleet, client):
    reader = EventReader(client.events())
    hello = reader.next()
    assert hello["event"] == "hello"
    assert {"epoch", "weight_version", "engines", "round", "round_open"} <= set(hello)
    n = next_round(client.status())
    other = SupervisorClient(fleet.sock)
    other.start_round(n)
    try:
        ev, before = reader.until(lambda e: e["event"] == "round_start")
        assert ev["round"] == n
        assert all(e["event"] != "keepalive" for e in before)
        reader.stop.set()  # the reader stops after the next event: round_end
    finally:
        other.end_round(n)
    reader.thread.join(10)
    assert not reader.thread.is_alive()


async def test_events_async(fleet, aclient):
    agen = aclient.events()
    try:
        hello = await anext_within(agen)
        assert hello["event"] == "hello" and "round_open" in hello
        n = next_round(await aclient.status())
        other = AsyncSupervisorClient(fleet.sock)
        await other.start_round(n)
        ev = await async_until(agen, lambda e: e["event"] == "round_start")
        assert ev["round"] == n
        await other.end_round(n)
        ev = await async_until(agen, lambda e: e["event"] == "round_end")
        assert ev["round"] == n
    finally:
        await agen.aclose()


# -- client: an unreachable daemon, and a daemon that restarts -------------------------------


def test_unreachable_missing_socket_sync(tmp_path):
    path = tmp_path / "nothing-here.sock"
    c = SupervisorClient(path, connect_timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(DaemonUnreachable) as e:
        c.status()
    assert time.monotonic() - t0 < 3
    msg = e.value.message
    assert str(path) in msg and "no such socket" in msg and "systemctl status vime-supervisor" in msg
    assert e.value.status is None and e.value.code == "unreachable"


async def test_unreachable_missing_socket_async(tmp_path):
    path = tmp_path / "nothing-here.sock"
    c = AsyncSupervisorClient(path, connect_timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(DaemonUnreachable, match="systemctl status vime-supervisor") as e:
        await c.start_round(1)
    assert time.monotonic() - t0 < 3 and str(path) in e.value.message
    with pytest.raises(DaemonUnreachable):
        await anext_within(c.events())


def test_unreachable_stale_socket_is_refused(tmp_path):
    path = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))  # bound, never listening: what a SIGKILLed daemon leaves behind
    try:
        with pytest.raises(DaemonUnreachable, match="connection refused"):
            SupervisorClient(path, connect_timeout=0.2).status()
    finally:
        s.close()


class HangUpServer:
    """Fault injection: a Unix socket that accepts each connection, reads the request and
    closes without answering (a daemon dying mid-request). Counts the requests."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(path))
        self.sock.listen(16)
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    if conn.recv(65536):
                        self.requests += 1
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def test_dropped_connection_retried_only_when_idempotent(tmp_path):
    server = HangUpServer(tmp_path / "hangup.sock")
    try:
        c = SupervisorClient(tmp_path / "hangup.sock", connect_timeout=0.5)
        with pytest.raises(DaemonUnreachable, match="tried for"):
            c.start_round(1)  # idempotent on the daemon: retried within connect_timeout
        assert server.requests > 1
        before = server.requests
        with pytest.raises(ConnectionLost, match="may or may not have taken effect") as e:
            c.report_failure("e0", "timeout")  # would count twice: sent once, never repeated
        assert e.value.code == "connection_lost" and server.requests == before + 1
        with pytest.raises(ConnectionLost):
            asyncio.run(AsyncSupervisorClient(tmp_path / "hangup.sock", connect_timeout=0.5).restart("e0"))
        assert server.requests == before + 2
        with pytest.raises(DaemonUnreachable):
            asyncio.run(AsyncSupervisorClient(tmp_path / "hangup.sock", connect_timeout=0.5).publish_weights(3))
        assert server.requests > before + 3
    finally:
        server.close()


def test_socket_path_defaults(monkeypatch):
    monkeypatch.setenv("VIME_SUPERVISOR_SOCKET", "/tmp/from-env.sock")
    assert SupervisorClient().socket_path == "/tmp/from-env.sock"
    assert AsyncSupervisorClient().socket_path == "/tmp/from-env.sock"
    assert SupervisorClient("/x.sock").socket_path == "/x.sock"
    monkeypatch.delenv("VIME_SUPERVISOR_SOCKET")
    assert SupervisorClient().socket_path == DEFAULT_SOCKET == "/run/vime-supervisor/supervisor.sock"


def small_daemon_config(root: Path) -> Path:
    return write_config(
        root / "supervisor.toml",
        supervisor={"runtime_dir": str(root / "run"), "log_dir": str(root / "logs")},
        health_check=HEALTH,
        engines=[{"name": "far", "url": f"http://127.0.0.1:{free_port()}"}],
    )


def test_reconnects_after_daemon_restart_sync(tmp_path):
    cfg = small_daemon_config(tmp_path)
    sock = tmp_path / "run" / "supervisor.sock"
    first = Daemon(cfg)
    second = None
    try:
        listening(first)
        client = SupervisorClient(sock, connect_timeout=15)
        assert client.status()["daemon"]["pid"] == first.proc.pid
        client.start_round(5)
        reader = EventReader(SupervisorClient(sock, connect_timeout=15).events())
        assert reader.next()["round"] == 5
        first.kill()  # SIGKILL: the socket file stays behind and refuses connections
        assert sock.exists()
        started: list[Daemon] = []
        threading.Timer(0.5, lambda: started.append(Daemon(cfg))).start()
        st = client.status()  # the same client object: retried until the new daemon listens
        second = started[0]
        assert st["daemon"]["pid"] == second.proc.pid
        assert (st["round"], st["round_open"]) == (5, True)  # from the journal: nothing lost
        assert client.start_round(5)["changed"] is False  # the trainer's retry is a no-op
        ev, _ = reader.until(lambda e: e["event"] == "reconnected", 15)
        assert "may have been missed" in ev["message"]
        assert reader.next()["event"] == "hello"
        reader.stop.set()
        client.end_round(5)
        reader.thread.join(10)
        assert not reader.thread.is_alive()
    finally:
        first.kill()
        if second is not None:
            # SIGKILL: a SIGTERM waits for the daemon's events handler to notice our closed stream
            # (up to its 10 s keepalive); see test_sigterm_with_an_open_event_stream.
            second.kill()


async def test_reconnects_after_daemon_restart_async(tmp_path):
    cfg = small_daemon_config(tmp_path)
    sock = tmp_path / "run" / "supervisor.sock"
    daemons = [Daemon(cfg)]

    def restart_soon(stop) -> None:
        stop()
        threading.Timer(0.5, lambda: daemons.append(Daemon(cfg))).start()

    try:
        await asyncio.to_thread(listening, daemons[0])
        client = AsyncSupervisorClient(sock, connect_timeout=15)
        assert (await client.status())["daemon"]["pid"] == daemons[0].proc.pid
        # SIGTERM: the daemon removes its socket; calls see "no such socket" until the next one.
        # (No event stream is open here: see test_sigterm_with_an_open_event_stream.)
        await asyncio.to_thread(restart_soon, lambda: daemons[0].terminate(30))
        assert not sock.exists()
        assert (await client.status())["daemon"]["pid"] == daemons[1].proc.pid
        agen = client.events()
        assert (await anext_within(agen))["event"] == "hello"
        await asyncio.to_thread(restart_soon, daemons[1].kill)  # SIGKILL, the stream open
        ev = await async_until(agen, lambda e: e["event"] == "reconnected", 15)
        assert ev["socket"] == str(sock)
        assert (await anext_within(agen))["event"] == "hello"
        await agen.aclose()
        assert (await client.status())["daemon"]["pid"] == daemons[2].proc.pid
        async with client.round(1):
            assert (await client.status())["round_open"] is True
    finally:
        await asyncio.sleep(0.6)  # a pending restart_soon timer
        for d in daemons:
            d.kill()


def test_sigterm_with_an_open_event_stream(tmp_path):
    """A daemon stops promptly on SIGTERM even while a client reads its event stream."""
    d = Daemon(small_daemon_config(tmp_path))
    try:
        listening(d)
        reader = EventReader(SupervisorClient(tmp_path / "run" / "supervisor.sock", connect_timeout=0.5).events())
        assert reader.next()["event"] == "hello"
        d.proc.send_signal(signal.SIGTERM)
        try:
            d.proc.wait(6)
        except subprocess.TimeoutExpired:
            pytest.fail("the daemon did not exit within 6 s of SIGTERM while an event stream was open")
    finally:
        d.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_forbidden_for_other_uids(tmp_path):
    """The daemon's SO_PEERCRED check (403) and the socket's file mode (0660), seen by a client
    running as nobody."""
    runtime = tempfile.mkdtemp(prefix="vime-client-test-")  # tmp_path is 0700: nobody cannot enter
    os.chmod(runtime, 0o755)
    cfg = write_config(
        tmp_path / "supervisor.toml",
        supervisor={"runtime_dir": runtime, "log_dir": str(tmp_path / "logs"), "socket_group": "65534"},
        health_check=HEALTH,
        engines=[{"name": "far", "url": f"http://127.0.0.1:{free_port()}"}],
    )
    d = Daemon(cfg)
    try:
        listening(d)
        sock = os.path.join(runtime, "supervisor.sock")
        # Everything is imported before dropping privileges (the venv lives under /root).
        script = f"""
import io, json, os, shutil, sys, contextlib  # shutil: argparse imports it lazily
import vime.supervisor.client.cli
from vime.supervisor.client import SupervisorClient, Forbidden
gid = int(sys.argv[1])
os.setgroups([]); os.setgid(gid); os.setuid(65534)
out = {{}}
try:
    SupervisorClient({sock!r}, connect_timeout=0.5).status()
except Forbidden as e:
    out["client"] = [e.status, e.code, e.message]
err = io.StringIO()
with contextlib.redirect_stderr(err):
    out["ctl_rc"] = vime.supervisor.client.cli.main(["--socket", {sock!r}, "status"])
out["ctl_err"] = err.getvalue()
print(json.dumps(out))
"""
        results = {}
        for gid in (65534, 65533):  # in the socket's group (the daemon refuses the uid); not (the mode does)
            p = subprocess.run([sys.executable, "-c", script, str(gid)], capture_output=True, text=True,
                               timeout=30, cwd=REPO)
            assert p.returncode == 0, p.stderr
            results[gid] = json.loads(p.stdout)
        status, code, message = results[65534]["client"]
        assert (status, code) == (403, "forbidden")
        assert message == "uid 65534 may not use this socket; add it to supervisor.allowed_uids"
        assert results[65534]["ctl_rc"] == 4 and "add it to supervisor.allowed_uids" in results[65534]["ctl_err"]
        status, code, message = results[65533]["client"]
        assert (status, code) == (None, "socket_permission")
        assert f"permission denied connecting to {sock}" in message and "socket_group" in message
        assert results[65533]["ctl_rc"] == 4
    finally:
        d.terminate(30)
        shutil.rmtree(runtime, ignore_errors=True)


# -- supervisorctl: formatting (pure) --------------------------------------------------------


def test_status_lines_layout_and_descriptions():
    engines = [
        {"name": "e0", "state": "RUNNING", "pid": 41234, "uptime": 3723.9, "weight_version": 118, "reason": "x"},
        {"name": "e1", "state": "SUSPECT", "pid": 7, "uptime": 90061, "weight_version": None,
         "reason": "1/3 probe failures (last: health timeout after 5s)"},
        {"name": "e2", "state": "EXITED", "pid": None, "uptime": None, "weight_version": 3,
         "reason": "hung: 3 consecutive probe failures (last: timeout); restart after round 412"},
        {"name": "e3", "state": "RUNNING", "pid": None, "url": "http://10.0.0.5:8000", "uptime": 5,
         "weight_version": None, "reason": "ready"},
    ]
    lines = status_lines(engines)
    assert lines[0] == "e0" + " " * 31 + "RUNNING   pid 41234, uptime 1:02:03, weights v118"
    assert lines[1] == "%-33s%-10s%s" % (
        "e1", "SUSPECT", "pid 7, uptime 1 day, 1:01:01, weights base, 1/3 probe failures (last: health timeout after 5s)")
    assert lines[2] == "%-33s%-10s%s" % ("e2", "EXITED", engines[2]["reason"])
    assert describe(engines[3]) == "attached http://10.0.0.5:8000, uptime 0:00:05, weights base"
    long_name = "x" * 40  # names over 30 characters widen the column to the longest + 3
    wide = status_lines([{**engines[0], "name": long_name}, engines[2]])
    assert wide[0] == "%-43s%-10s%s" % (long_name, "RUNNING", "pid 41234, uptime 1:02:03, weights v118")
    assert wide[1].startswith("e2" + " " * 41 + "EXITED    hung:")
    # A receiver of an announced push says so, and how far the push is from its deadline.
    pushed = {**engines[0], "push": {"id": "a1b2c3-4", "remaining_s": 41.7}}
    assert describe(pushed) == "pid 41234, uptime 1:02:03, weights v118, receiving push a1b2c3-4 (42s to its deadline)"
    assert describe({**pushed, "push": {"id": "a1b2c3-4", "remaining_s": -3.2}}).endswith("(3s past its deadline)")
    assert describe({**pushed, "push": {"id": "a1b2c3-4", "remaining_s": -0.2}}).endswith("(at its deadline)")


# -- supervisorctl against the daemon --------------------------------------------------------


def parse_line(line: str) -> tuple[str, str, str]:
    name, state, desc = line[:NAME_W].rstrip(), line[NAME_W:NAME_W + STATE_W].rstrip(), line[NAME_W + STATE_W:]
    assert line == "%-33s%-10s%s" % (name, state, desc), repr(line)
    return name, state, desc


UPTIME = r"\d+:\d\d:\d\d"


def test_ctl_status_all_format_and_exit_3(fleet, client):
    wait_state(client, "dead", {"EXITED"}, FIRST_WAIT + 10)
    for name in ("live", "spawned"):
        wait_state(client, name, {"RUNNING"})
    p = ctl("status", sock=fleet.sock)
    assert p.returncode == 3, p.stderr  # dead is not running
    by = engines_by_name(client.status())
    lines = p.stdout.splitlines()
    assert [parse_line(ln)[0] for ln in lines] == list(ENGINES)  # config order, no header
    for line in lines:
        name, state, desc = parse_line(line)
        e = by[name]
        assert state == e["state"] or {state, e["state"]} <= {"RUNNING", "SUSPECT"}  # status read after
        weights = "base" if e["weight_version"] is None else f"v{e['weight_version']}"
        suspect = r", \d/3 probe failures .*" if state == "SUSPECT" else ""  # a slow probe just now
        if name == "live":
            assert re.fullmatch(rf"attached http://127\.0\.0\.1:{fleet.live_port}, uptime {UPTIME}, "
                                rf"weights {weights}{suspect}", desc), desc
        elif name == "spawned":
            assert re.fullmatch(rf"pid {e['pid']}, uptime {UPTIME}, weights {weights}{suspect}", desc), desc
        else:
            assert desc == e["reason"] and "not answering within first_wait (5s)" in desc
    assert p.stderr == ""


def test_ctl_status_running_engines_exit_0(fleet, client):
    for name in ("live", "spawned"):
        wait_state(client, name, {"RUNNING"})
    p = ctl("status", "spawned", "live", sock=fleet.sock)
    assert p.returncode == 0, p.stdout + p.stderr
    assert [parse_line(ln)[0] for ln in p.stdout.splitlines()] == ["spawned", "live"]


def test_ctl_status_not_running_exit_3(fleet):
    p = ctl("status", "dead", sock=fleet.sock)
    assert p.returncode == 3
    name, state, desc = parse_line(p.stdout.rstrip("\n"))
    assert (name, state) == ("dead", "EXITED") and "not answering within first_wait" in desc


def test_ctl_status_unknown_name_exit_4(fleet):
    p = ctl("status", "live", "bogus", sock=fleet.sock)
    assert p.returncode == 4
    assert "bogus: ERROR (no such process)" in p.stderr.splitlines()  # supervisord's words
    assert "known engines: live, dead, spawned" in p.stderr
    assert parse_line(p.stdout.splitlines()[0])[0] == "live"


def test_ctl_status_json(fleet):
    p = ctl("status", "--json", sock=fleet.sock)
    assert p.returncode == 3
    st = json.loads(p.stdout)
    assert [e["name"] for e in st["engines"]] == list(ENGINES)
    for e in st["engines"]:
        assert {"name", "state", "pid", "weight_version", "restarts", "reason", "routable"} <= set(e)
    assert {"round", "round_open", "weight_version", "epoch"} <= set(st)
    p = ctl("status", "live", "--json", sock=fleet.sock)
    assert p.returncode == 0 and [e["name"] for e in json.loads(p.stdout)["engines"]] == ["live"]


def test_ctl_socket_from_environment(fleet):
    p = ctl("status", "dead", sock=None, env={"VIME_SUPERVISOR_SOCKET": fleet.sock})
    assert p.returncode == 3 and p.stdout.startswith("dead ")
    if not os.path.exists(DEFAULT_SOCKET):  # neither flag nor variable: the default path
        p = ctl("--connect-timeout", "0.2", "status", sock=None)
        assert p.returncode == 4 and DEFAULT_SOCKET in p.stderr


def test_ctl_unreachable_exit_4(tmp_path):
    missing = tmp_path / "gone.sock"
    for args in (["status"], ["restart", "live"], ["tail", "live"]):
        p = ctl("--connect-timeout", "0.2", *args, sock=missing)
        assert p.returncode == 4, args
        assert p.stdout == ""
        assert f"cannot reach the vime-supervisor daemon at {missing}: no such socket" in p.stderr
        assert "systemctl status vime-supervisor" in p.stderr and "--socket PATH" in p.stderr


def test_ctl_actions(fleet, client):
    p = ctl("stop", "live", sock=fleet.sock)
    assert p.returncode == 1
    assert p.stderr.startswith("live: ERROR (live is attached (http://127.0.0.1:")
    p = ctl("restart", "bogus", sock=fleet.sock)  # supervisord: an action's unknown name exits 1
    assert p.returncode == 1 and "bogus: ERROR (no such process)" in p.stderr
    p = ctl("stop", "spawned", sock=fleet.sock)
    assert (p.returncode, p.stdout) == (0, "spawned: stopped\n"), p.stderr
    p = ctl("status", "spawned", sock=fleet.sock)
    assert p.returncode == 3 and p.stdout == "%-33s%-10s%s\n" % ("spawned", "STOPPED", "stopped by request")
    p = ctl("stop", "spawned", "bogus", sock=fleet.sock)  # each name answered; the unknown one fails it
    assert p.returncode == 1 and p.stdout == "spawned: already STOPPED\n"
    p = ctl("start", "--no-wait", "spawned", sock=fleet.sock)
    assert p.returncode == 0 and re.fullmatch(r"spawned: starting \(incarnation \d+\)\n", p.stdout)
    wait_state(client, "spawned", {"RUNNING"})
    p = ctl("start", "--no-wait", "spawned", sock=fleet.sock)
    assert (p.returncode, p.stdout) == (0, "spawned: already RUNNING\n")


def test_ctl_tail(fleet, client):
    wait_state(client, "spawned", {"RUNNING"})
    p = ctl("tail", "spawned", sock=fleet.sock)
    assert p.returncode == 0 and "stand-in engine pid" in p.stdout
    p = ctl("tail", "spawned", "-n", "20", sock=fleet.sock)
    assert p.returncode == 0 and 0 < len(p.stdout.encode()) <= 20
    p = ctl("tail", "live", sock=fleet.sock)
    assert p.returncode == 1 and "live: ERROR (live has no log yet (attached engines have none))" in p.stderr
    p = ctl("tail", "bogus", sock=fleet.sock)
    assert p.returncode == 1 and "bogus: ERROR (no such process)" in p.stderr


def test_ctl_tail_follow(fleet, client):
    """-f prints what the engine writes next (the stand-in logs each probe) until Ctrl-C."""
    wait_state(client, "spawned", {"RUNNING"})
    numbers = lambda text: [int(n) for n in re.findall(r"completion request #(\d+)", text)]  # noqa: E731
    logged = max(numbers(client.engine_log("spawned")), default=0)
    # SIGINT at its default, as for a command in a terminal's foreground: a test run started in
    # the background of a non-interactive shell inherits it ignored, and Ctrl-C would not reach.
    proc = subprocess.Popen([sys.executable, "-m", "vime.supervisor.client.cli", "--socket", fleet.sock, "tail", "-f", "spawned"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    try:
        seen: list[int] = []
        deadline = time.monotonic() + 15
        while (not seen or seen[-1] < logged + 2) and time.monotonic() < deadline:
            try:
                seen += numbers(lines.get(timeout=1))
            except queue.Empty:
                pass
        # Lines written after -f started came through, each once, in order.
        assert seen and seen[-1] >= logged + 2, (logged, seen)
        assert seen == list(range(seen[0], seen[-1] + 1)), seen
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctl_retire_and_console_script(fleet, client):
    p = ctl("retire", "dead", sock=fleet.sock)
    assert (p.returncode, p.stdout) == (0, "dead: retired\n")
    assert engines_by_name(client.status())["dead"]["retired"] is True
    assert asyncio.run(AsyncSupervisorClient(fleet.sock).retire("dead"))["message"] == "retired"  # idempotent
    script = Path(sys.executable).parent / "supervisorctl"  # [project.scripts] of pyproject.toml
    if not script.exists():
        pytest.skip(f"{script} not installed (pip install -e .)")
    p = subprocess.run([str(script), "--socket", fleet.sock, "status", "live"], capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 0 and p.stdout.startswith("live ")
