"""Issue 13's restart, journal and lifecycle faults, through the daemon's public interface:
its config file, control socket, signals and the journal file on disk.

The daemon spawns engines as it always does (`PYTHON -m vllm.entrypoints.openai.api_server
--model M --port P ...`), with `python` pointed at a script that serves the protocol stand-in
(harness/standin_engine.py; not vLLM) on that port, plus one child in its process group the way
vLLM's EngineCore is. So the daemon's own spawn, adoption, journal and group handling run for
real; only the server is a stand-in.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import pytest

from vime.supervisor.engine.process import boot_id, proc_stat
from vime.supervisor.policy import EPOCH_MAX
from vime.supervisor.client import DaemonUnreachable, SupervisorClient
from vime.harness.local_daemon import (
    Daemon, free_port, kill_all, live_pids_in_groups, standin_config, standin_model)

from support.polling import wait_until
from support.requests import post
from test_input_faults import write_safetensors  # a checkpoint on disk, without torch
from support.standins import standin_server

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = f"""#!{sys.executable}
# Stands in for `python -m vllm.entrypoints.openai.api_server ... --port P` (tests only).
import asyncio, subprocess, sys
from vime.harness import standin_engine
port = int(sys.argv[sys.argv.index("--port") + 1])
# A child in the server's process group, as vLLM's EngineCore is.
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
async def main():
    await standin_engine.serve(port, 1)
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


model_dir = standin_model


@pytest.fixture
def fake_python(tmp_path) -> Path:
    p = tmp_path / "fake-python"
    p.write_text(FAKE_PYTHON)
    p.chmod(0o755)
    return p


def config(tmp_path: Path, fake_python: Path, engines: list[dict], **supervisor) -> Path:
    return standin_config(tmp_path, fake_python, engines, supervisor=supervisor)


def spawned(name: str, model: Path, port: int) -> dict:
    return {"name": name, "model": str(model), "served_model_name": "tiny", "port": port}


def sock(tmp_path: Path) -> str:
    return str(tmp_path / "run" / "supervisor.sock")


def journal_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "journal.json"


def alive(pid: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st.state != "Z"


def kill9(d: Daemon) -> None:
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)


@pytest.fixture
def cleanup():
    """Process groups (engine pids) and daemons a test started: never left behind."""
    daemons: list[Daemon] = []
    groups: set[int] = set()
    yield daemons, groups
    kill_all(daemons, groups)


def start(cfg: Path, cleanup) -> Daemon:
    d = Daemon(cfg)
    cleanup[0].append(d)
    return d


def orphaned_engine(tmp_path: Path, fake_python: Path, cleanup, model: Path) -> tuple[int, int]:
    """A daemon spawns e0 on `model`, which reaches RUNNING; then the daemon is killed with -9:
    (e0's port, the pid of e0, which outlives it)."""
    port = free_port()
    d = start(config(tmp_path, fake_python, [spawned("e0", model, port)]), cleanup)
    d.transition("e0", "RUNNING", 30)
    old = d.last_pid("e0")
    kill9(d)
    return port, old


def start_stranger(cleanup) -> subprocess.Popen:
    """A live process that is no engine, leading a group of its own as our engines do."""
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    cleanup[1].add(stranger.pid)
    wait_until(lambda: proc_stat(stranger.pid) is not None, 5, "the stranger started")
    return stranger


def running_entry(pid: int, start_time: int, port: int, log_path: Path, **more) -> dict:
    """A journal entry of a RUNNING engine naming process `pid` (a hand-written journal's)."""
    return {"state": "RUNNING", "incarnation": 1, "restarts": 0, "verified_version": None, "retired": False,
            "pid": pid, "start_time": start_time, "port": port, "log_path": str(log_path), **more}


def write_journal(tmp_path: Path, engines: dict[str, dict], *, boot: str | None) -> None:
    """A hand-written journal of boot `boot`: round 2 (closed), no weight version, `engines`."""
    journal_path(tmp_path).parent.mkdir(parents=True)
    journal_path(tmp_path).write_text(json.dumps({
        "format": 1, "boot_id": boot, "daemon_pid": 1, "round": 2, "round_open": False,
        "weight_version": None, "checkpoint": None, "engines": engines}))


# -- fault 1 --------------------------------------------------------------------------------

def test_fault1_clean_restart_restarts_engines(tmp_path, fake_python, cleanup):
    model = model_dir(tmp_path / "model")
    cfg = config(tmp_path, fake_python, [spawned("e0", model, free_port()), spawned("e1", model, free_port())])
    d = start(cfg, cleanup)
    d.transition("e0", "RUNNING", 30)
    d.transition("e1", "RUNNING", 30)
    SupervisorClient(sock(tmp_path)).stop("e1")  # an operator's stop: the one thing that survives
    d.transition("e1", "STOPPED", 10)
    assert d.terminate(30) == 0  # systemctl restart: SIGTERM (engines stopped), then start
    assert live_pids_in_groups(set(d.spawned_pids())) == []

    d2 = start(cfg, cleanup)
    d2.transition("e0", "RUNNING", 30)
    ready = d2.wait_for(lambda e: e.get("event") == "supervisor.ready", 30)
    assert ready["status"].startswith("1/2 engines RUNNING")
    engines = {e["name"]: e for e in SupervisorClient(sock(tmp_path)).status()["engines"]}
    assert engines["e0"]["state"] == "RUNNING" and engines["e0"]["pid"]
    assert engines["e1"]["state"] == "STOPPED"  # still the operator's stop
    assert d2.terminate(30) == 0


# -- fault 2 --------------------------------------------------------------------------------

def test_fault2_second_daemon_refused_and_socket_kept(tmp_path, fake_python, cleanup):
    model = model_dir(tmp_path / "model")
    cfg = config(tmp_path, fake_python, [spawned("e0", model, free_port())])
    first = start(cfg, cleanup)
    first.transition("e0", "RUNNING", 30)
    inode = os.stat(sock(tmp_path)).st_ino

    second = subprocess.run([sys.executable, "-m", "vime.supervisor", "--config", str(cfg)],
                            capture_output=True, text=True, timeout=30)
    assert second.returncode != 0
    assert "already" in second.stderr and str(first.proc.pid) in second.stderr, second.stderr
    # The first daemon's socket is untouched and it still answers; nothing else was spawned.
    assert os.stat(sock(tmp_path)).st_ino == inode
    status = SupervisorClient(sock(tmp_path)).status()
    assert status["engines"][0]["state"] == "RUNNING" and status["daemon"]["pid"] == first.proc.pid
    assert len(first.spawned_pids()) == 1
    assert first.terminate(30) == 0


# -- fault 3 --------------------------------------------------------------------------------

def test_fault3_journal_of_another_config_not_adopted(tmp_path, fake_python, cleanup):
    port, old = orphaned_engine(tmp_path, fake_python, cleanup, model_dir(tmp_path / "model-a"))
    assert alive(old)  # the engine outlives its daemon

    cfg = config(tmp_path, fake_python, [spawned("e0", model_dir(tmp_path / "model-b"), port)])  # model B now
    d2 = start(cfg, cleanup)
    cleanup[1].add(old)
    why = d2.wait_for(lambda e: e.get("event") == "journal.not_adopted", 20)
    assert why["pid"] == old and "config" in why["why"]
    d2.transition("e0", "RUNNING", 30)
    assert not any(e.get("event") == "engine.adopted" for e in d2.events)
    assert d2.last_pid("e0") != old
    wait_until(lambda: live_pids_in_groups({old}) == [], 10, "the old engine's group stopped")
    assert d2.terminate(30) == 0


def test_engine_switched_to_attached_stops_its_old_process(tmp_path, fake_python, cleanup):
    _, old = orphaned_engine(tmp_path, fake_python, cleanup, model_dir(tmp_path / "model"))
    cleanup[1].add(old)

    other = free_port()  # now attached to a server someone else runs
    with standin_server(other):
        cfg = config(tmp_path, fake_python, [{"name": "e0", "url": f"http://127.0.0.1:{other}",
                                              "served_model_name": "tiny"}])
        d2 = start(cfg, cleanup)
        d2.transition("e0", "RUNNING", 30)
        wait_until(lambda: live_pids_in_groups({old}) == [], 10, "the formerly spawned engine stopped")
        assert d2.terminate(30) == 0


def test_attached_engine_keeps_serving_its_round_across_a_daemon_crash(tmp_path, fake_python, cleanup):
    """An attached engine outlives the daemon as an adopted process does: the restarted daemon
    re-attaches it (cause restored), keeps it routable in the open round, and keeps its
    incarnation, so the trainer's failure reports that name it still count."""
    port = free_port()
    with standin_server(port):
        cfg = config(tmp_path, fake_python, [{"name": "r0", "url": f"http://127.0.0.1:{port}",
                                              "served_model_name": "tiny"}])
        d = start(cfg, cleanup)
        before = d.transition("r0", "RUNNING", 30)
        client = SupervisorClient(sock(tmp_path))
        client.start_round(1)
        kill9(d)

        d2 = start(cfg, cleanup)
        attached = d2.transition("r0", "STARTING", 30)
        assert attached["cause"] == "restored" and "after a daemon restart" in attached["reason"]
        running = d2.transition("r0", "RUNNING", 30)
        assert running["incarnation"] == before["incarnation"]
        assert [e["name"] for e in client.routable_engines()["engines"]] == ["r0"]
        answer = client.report_failure("r0", "a request failed", incarnation=before["incarnation"])
        assert answer["counted"] is True
        assert d2.terminate(30) == 0


def test_a_restarted_daemons_first_answer_lists_the_engines_it_readopts(tmp_path, fake_python, cleanup):
    """After a kill -9 the next daemon serves its socket once the engines it re-adopts have
    been checked again: its first routable answer lists them. An empty first answer made a
    rollout client fail every request it held (a whole round lost on a 256-engine fleet)."""
    ports = [free_port(), free_port()]
    cfg = config(tmp_path, fake_python, [spawned(f"e{i}", model_dir(tmp_path / "model"), p)
                                         for i, p in enumerate(ports)])
    d = start(cfg, cleanup)
    for name in ("e0", "e1"):
        d.transition(name, "RUNNING", 30)
        cleanup[1].add(d.last_pid(name))
    client = SupervisorClient(sock(tmp_path), connect_timeout=0.2)
    client.start_round(1)
    kill9(d)

    d2 = start(cfg, cleanup)
    _assert_served_after_the_checks(d2, client, ["e0", "e1"])
    assert d2.terminate(30) == 0


def test_a_restarted_daemons_first_answer_lists_the_engines_it_reattaches(tmp_path, fake_python, cleanup):
    """The same for attached engines, whose first checks after a restart are spread over one
    second, not over the probe interval (20 s here: the second engine's would come 10 s on,
    past the socket's wait)."""
    ports = [free_port(), free_port()]
    with standin_server(ports[0]), standin_server(ports[1]):
        cfg = standin_config(tmp_path, fake_python, [{"name": f"r{i}", "url": f"http://127.0.0.1:{p}",
                                                       "served_model_name": "tiny"} for i, p in enumerate(ports)],
                             health_check={"interval": 20.0, "timeout": 2.0})
        d = start(cfg, cleanup)
        for name in ("r0", "r1"):
            d.transition(name, "RUNNING", 60)
        client = SupervisorClient(sock(tmp_path), connect_timeout=0.2)
        client.start_round(1)
        kill9(d)

        d2 = start(cfg, cleanup)
        _assert_served_after_the_checks(d2, client, ["r0", "r1"])
        assert not [e for e in d2.events if e.get("event") == "supervisor.readoption_slow"]
        assert d2.terminate(30) == 0


def test_engines_pushed_ahead_of_a_publish_the_restarted_daemon_never_heard_wait_for_it(
        tmp_path, fake_python, cleanup):
    """The daemon killed between the trainer's push of v2 and its publish: the next one finds
    its engines at v2 while v1 is current. They wait unrouted for the publish, saying so, instead
    of being reloaded back to v1 from the checkpoint (and forward again at the publish, which
    cost the 256-engine run's next round every engine); the publish routes them at once."""
    d2, client, ckpt = _restarted_with_engines_ahead(tmp_path, fake_python, cleanup)
    (st,) = wait_until(lambda: _status_or_none(client), 30, "the restarted daemon answers")
    assert st["routable"] == 0
    assert all("ahead of current v1" in e["reason"] for e in st["engines"]), st["engines"]
    mark = d2.mark()
    client.publish_weights(2, checkpoint=str(ckpt))
    for name in ("e0", "e1"):
        running = d2.transition(name, "RUNNING", 30, after=mark)
        assert "v2" in running["reason"], running
    assert not [e for e in d2.events if e.get("to_state") == "SYNCING"], "an engine ahead was synced back"
    assert d2.terminate(30) == 0


def test_engines_ahead_whose_publish_never_comes_are_synced_back_after_the_wait(tmp_path, fake_python, cleanup):
    """No publish of v2 within the wait (agent_timeout: sync_timeout, 3 s here): the engines are
    reloaded to the current v1 from the checkpoint and verified, as any STALE engine is."""
    d2, client, _ = _restarted_with_engines_ahead(tmp_path, fake_python, cleanup, sync_timeout=3.0)
    for name in ("e0", "e1"):
        stale = d2.transition(name, "STALE", 30)
        syncing = d2.transition(name, "SYNCING", 30)
        assert "reloading v1" in syncing["reason"], syncing
        waited = (datetime.fromisoformat(syncing["timestamp"]) - datetime.fromisoformat(stale["timestamp"]))
        assert waited.total_seconds() >= 2.9, (stale, syncing)  # after the wait, by the daemon's clock
        running = d2.transition(name, "RUNNING", 30)
        assert "v1" in running["reason"], running
    assert d2.terminate(30) == 0


def _restarted_with_engines_ahead(tmp_path: Path, fake_python: Path, cleanup, **supervisor: Any
                                  ) -> tuple[Daemon, SupervisorClient, Path]:
    """Two spawned engines at the published v1 take the trainer's push of v2 (their label), and
    the daemon is killed -9 before the publish: the next daemon, once it has found both STALE
    (weights v2, current v1); its client; the checkpoint."""
    model = model_dir(tmp_path / "model")
    ports = [free_port(), free_port()]
    cfg = config(tmp_path, fake_python, [spawned(f"e{i}", model, p) for i, p in enumerate(ports)], **supervisor)
    d = start(cfg, cleanup)
    for name in ("e0", "e1"):
        d.transition(name, "RUNNING", 30)
        cleanup[1].add(d.last_pid(name))
    client = SupervisorClient(sock(tmp_path))
    ckpt = model_dir(tmp_path / "ckpt")  # the served model's config, and weights
    write_safetensors(ckpt / "model.safetensors", {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                      b"\0" * 8)
    mark = d.mark()
    client.publish_weights(1, checkpoint=str(ckpt))
    for name in ("e0", "e1"):  # reloaded from the checkpoint, verified at v1
        d.transition(name, "RUNNING", 30, after=mark)
    for port in ports:  # the trainer's push of v2 lands; the daemon dies before the publish
        post(f"http://127.0.0.1:{port}/update_weight_version", {"new_version": "2"})
    kill9(d)

    d2 = start(cfg, cleanup)
    for name in ("e0", "e1"):
        stale = d2.transition(name, "STALE", 30)
        assert "weights v2, current v1" in stale["reason"], stale
    return d2, client, ckpt


def _assert_served_after_the_checks(d: Daemon, client: SupervisorClient, names: list[str]) -> None:
    """`d`'s first routable answer lists `names`, and its socket listened only after each
    one's check after the restart (STARTING -> RUNNING)."""
    (first,) = wait_until(lambda: _routable_or_none(client), 30, "the restarted daemon answers")
    assert sorted(e["name"] for e in first["engines"]) == names, first
    d.wait_for(lambda e: e.get("event") == "control.listening", 10)
    events = list(d.events)
    listening = next(i for i, e in enumerate(events) if e.get("event") == "control.listening")
    checked = [i for i, e in enumerate(events) if e.get("event") == "engine.transition"
               and e.get("from_state") == "STARTING" and e.get("to_state") == "RUNNING"]
    assert len(checked) == len(names) and max(checked) < listening, events


# -- fault 5 --------------------------------------------------------------------------------

def test_fault5_corrupt_journal_stops_old_engines(tmp_path, fake_python, cleanup):
    ports = [free_port(), free_port()]
    model = model_dir(tmp_path / "model")
    cfg = config(tmp_path, fake_python, [spawned(f"e{i}", model, p) for i, p in enumerate(ports)])
    d = start(cfg, cleanup)
    d.transition("e0", "RUNNING", 30)
    d.transition("e1", "RUNNING", 30)
    old = set(d.spawned_pids())
    kill9(d)
    cleanup[1].update(old)
    assert len(live_pids_in_groups(old)) == 4  # two servers, each with its child
    journal_path(tmp_path).write_text('{"format": 1, "engines": {"e0": {"pid": ')  # torn write

    d2 = start(cfg, cleanup)
    bad = d2.wait_for(lambda e: e.get("event") == "journal.unusable", 20)
    assert Path(bad["moved_to"]).exists()
    d2.transition("e0", "RUNNING", 30)
    d2.transition("e1", "RUNNING", 30)
    # The old engines (servers and children) are gone, and were said to be.
    assert live_pids_in_groups(old) == []
    found = [e for e in d2.events if e.get("event") == "journal.orphan_stopped"]
    assert sorted(e["pid"] for e in found) == sorted(old)
    assert not set(d2.spawned_pids()) & old
    assert d2.terminate(30) == 0
    assert live_pids_in_groups(set(d2.spawned_pids())) == []


# -- fault 6 --------------------------------------------------------------------------------

CORRUPT = {
    "non_utf8": b'{"format": 1, "engines": {}, "round": 3, "checkpoint": "\xff\xfe"}',
    "engine_not_object": json.dumps({"format": 1, "engines": {"e0": 5}, "round": 3}).encode(),
    "string_round": json.dumps({"format": 1, "engines": {}, "round": "3", "round_open": False}).encode(),
    "open_null_round": json.dumps({"format": 1, "engines": {}, "round": None, "round_open": True}).encode(),
    # Review: 400-digit numbers were accepted, then /v1/metrics answered 500 and rounds 409.
    "huge_round": json.dumps({"format": 1, "round": 10**400, "round_open": True, "engines": {}}).encode(),
    "huge_version": json.dumps({"format": 1, "weight_version": 10**400, "engines": {}}).encode(),
}


@pytest.mark.parametrize("kind", sorted(CORRUPT))
def test_fault6_corrupt_journal_moved_aside(tmp_path, fake_python, cleanup, kind):
    cfg = config(tmp_path, fake_python, [spawned("e0", model_dir(tmp_path / "model"), free_port())])
    journal_path(tmp_path).parent.mkdir(parents=True)
    journal_path(tmp_path).write_bytes(CORRUPT[kind])
    d = start(cfg, cleanup)
    bad = d.wait_for(lambda e: e.get("event") == "journal.unusable", 20)
    assert Path(bad["moved_to"]).read_bytes() == CORRUPT[kind]  # kept for a post-mortem
    assert sum(e.get("event") == "journal.unusable" for e in d.events) == 1
    d.transition("e0", "RUNNING", 30)
    client = SupervisorClient(sock(tmp_path))
    client.start_round(1)  # rounds work: nothing of the bad journal was taken
    client.end_round(1)
    assert client.status()["round"] == 1
    assert d.terminate(30) == 0


# -- also examined: the boot id ---------------------------------------------------------------

def test_journal_of_another_boot_neither_adopts_nor_kills(tmp_path, fake_python, cleanup):
    port = free_port()
    cfg = config(tmp_path, fake_python, [spawned("e0", model_dir(tmp_path / "model"), port)])
    # A process of this boot that happens to carry the pid and start time the journal names,
    # leading its own group as our engines do: after a reboot, that is someone else's.
    stranger = start_stranger(cleanup)
    try:
        entry = running_entry(stranger.pid, proc_stat(stranger.pid).start_time, port, tmp_path / "logs" / "e0.1.log")
        write_journal(tmp_path, {"e0": entry}, boot="00000000-0000-0000-0000-000000000000")
        d = start(cfg, cleanup)
        d.transition("e0", "RUNNING", 30)
        assert not any(e.get("event") == "engine.adopted" for e in d.events)
        assert d.last_pid("e0") != stranger.pid
        assert alive(stranger.pid)  # not ours to kill either
        assert SupervisorClient(sock(tmp_path)).status()["round"] == 2  # the trainer's state is kept
        assert d.terminate(30) == 0
        assert alive(stranger.pid)
    finally:
        stranger.kill()
        stranger.wait()


# -- a log reader that went away --------------------------------------------------------------

def test_sigterm_after_the_log_pipe_closed_still_stops_every_engine(tmp_path, fake_python, cleanup):
    """The daemon's log stream is a pipe whose reader died (a terminal closed, a demo killed):
    its writes fail with EPIPE, and SIGTERM must still stop every engine and exit 0."""
    model = model_dir(tmp_path / "model")
    cfg = config(tmp_path, fake_python, [spawned("e0", model, free_port())])
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "vime.supervisor", "--config", str(cfg)],
                            stdout=write_fd, stderr=write_fd, stdin=subprocess.DEVNULL)
    os.close(write_fd)
    reader = os.fdopen(read_fd, "rb")
    try:
        pid = None
        deadline = time.monotonic() + 30
        for line in reader:  # until e0 is RUNNING
            ev = json.loads(line) if line.startswith(b"{") else {}
            pid = ev.get("pid", pid) if ev.get("event") == "engine.spawned" else pid
            if ev.get("event") == "engine.transition" and ev.get("to_state") == "RUNNING":
                break
            assert time.monotonic() < deadline, "e0 not RUNNING within 30 s"
        assert pid is not None
        cleanup[1].add(pid)
        reader.close()  # the reader goes away: every later log line hits a closed pipe
        SupervisorClient(sock(tmp_path)).status()  # still serving
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert live_pids_in_groups({pid}) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# -- review: a journal naming a live process that is not an engine of ours ---------------------

def test_journal_naming_a_stranger_of_this_boot_leaves_it_alone(tmp_path, fake_python, cleanup):
    """A hand-edited journal with this boot's id naming a live process of ours (same pid and
    start time) that is no engine server on that port: it used to be SIGKILLed (or adopted)."""
    port = free_port()
    cfg = config(tmp_path, fake_python, [spawned("e0", model_dir(tmp_path / "model"), port)])
    stranger = start_stranger(cleanup)
    try:
        entry = running_entry(stranger.pid, proc_stat(stranger.pid).start_time, port, tmp_path / "x.log",
                              incarnation=4, restarts=3, fingerprint="deadbeef")
        write_journal(tmp_path, {"e0": entry, "gone": entry}, boot=boot_id())
        d = start(cfg, cleanup)
        d.transition("e0", "RUNNING", 30)
        assert alive(stranger.pid)
        assert sum(e.get("event") == "journal.not_ours" for e in d.events) == 2
        e0 = SupervisorClient(sock(tmp_path)).status()["engines"][0]
        assert e0["pid"] != stranger.pid
        assert SupervisorClient(sock(tmp_path)).routable_engines()["engines"][0]["incarnation"] == 5  # counts on
        assert d.terminate(30) == 0
        assert alive(stranger.pid)
    finally:
        stranger.kill()
        stranger.wait()


def two_running_engines(tmp_path: Path, fake_python: Path, cleanup) -> tuple[Path, Daemon, int]:
    """A daemon that spawned e0 and e1, both RUNNING: (its config, the daemon, e1's pid)."""
    model = model_dir(tmp_path / "model")
    cfg = config(tmp_path, fake_python, [spawned("e0", model, free_port()), spawned("e1", model, free_port())])
    d = start(cfg, cleanup)
    d.transition("e0", "RUNNING", 30)
    d.transition("e1", "RUNNING", 30)
    e1_pid = d.last_pid("e1")
    cleanup[1].update({d.last_pid("e0"), e1_pid})
    return cfg, d, e1_pid


def restart_over_edited_journal(tmp_path: Path, cfg: Path, cleanup, d: Daemon, e1_pid: int,
                                edit: Callable[[dict], None]) -> tuple[Daemon, dict[str, dict]]:
    """Kill `d` with -9, `edit` its journal (whose e1 entry names `e1_pid`), start a daemon over
    it and wait for e0 RUNNING: (the new daemon, its engines by name). e1 must have kept its
    process through it: adopted, alive, never stopped as an orphan."""
    kill9(d)
    data = json.loads(journal_path(tmp_path).read_text())
    assert data["engines"]["e1"]["pid"] == e1_pid
    edit(data)
    journal_path(tmp_path).write_text(json.dumps(data))
    d = start(cfg, cleanup)
    d.transition("e0", "RUNNING", 30)
    engines = {e["name"]: e for e in SupervisorClient(sock(tmp_path)).status()["engines"]}
    cleanup[1].add(engines["e0"]["pid"])
    assert engines["e1"]["pid"] == e1_pid and alive(e1_pid), engines["e1"]
    assert all(e.get("pid") != e1_pid for e in d.events if e.get("event") == "journal.orphan_stopped")
    return d, engines


def test_journal_giving_one_engine_anothers_process_kills_neither(tmp_path, fake_python, cleanup):
    """A hand-edited journal whose e0 entry names e1's live process (its pid, start time and
    port, with e0's own config fingerprint): e1 keeps its process, adopted; e0's claim is left
    alone (never adopted, never signalled) and e0 gets a fresh process of its own."""
    cfg, d, e1_pid = two_running_engines(tmp_path, fake_python, cleanup)
    for reverse in (False, True):  # whichever entry the daemon reads first
        def edit(data: dict) -> None:
            e1 = data["engines"]["e1"]
            for key in ("pid", "start_time", "port", "log_path"):  # everything but e0's own fingerprint
                data["engines"]["e0"][key] = e1[key]
            if reverse:
                data["engines"] = dict(reversed(list(data["engines"].items())))

        d, engines = restart_over_edited_journal(tmp_path, cfg, cleanup, d, e1_pid, edit)
        assert engines["e0"]["pid"] != e1_pid
        assert [e.get("engine") for e in d.events if e.get("event") == "journal.not_ours"] == ["e0"]
    assert d.terminate(30) == 0


# -- the membership epoch across a daemon restart ----------------------------------------------

def test_membership_epoch_goes_on_past_a_daemon_restart_even_after_a_failed_journal_write(
        tmp_path, fake_python, cleanup):
    """A client that keeps the highest membership epoch it saw (a router feed, a cluster view)
    takes nothing at or below it: a daemon killed with -9 and started again answers past the
    last epoch a client read from the one before, from its first answer on, even when that
    epoch never reached the journal (every write failed, as on a full or read-only disk): the
    wall-clock floor (policy.starting_epoch) keeps it ahead."""
    cfg = config(tmp_path, fake_python, [spawned("e0", model_dir(tmp_path / "model"), free_port())])
    d = start(cfg, cleanup)
    d.transition("e0", "RUNNING", 30)
    cleanup[1].add(d.last_pid("e0"))
    client = SupervisorClient(sock(tmp_path))
    blocker = journal_path(tmp_path).with_name("journal.json.tmp")
    # Every write fails from here (made between two of the journal's writes: its own
    # temporary file may be there for a moment).
    wait_until(lambda: _made(blocker), 10, "the journal's write in progress ended")
    mark = d.mark()
    os.kill(d.last_pid("e0"), signal.SIGKILL)  # out of routing and back: the epoch moves twice
    d.transition("e0", "RUNNING", 30, after=mark)
    cleanup[1].add(d.last_pid("e0"))
    seen = client.routable_engines()["epoch"]
    assert d.wait_for(lambda e: e.get("event") == "journal.write_failed", 5)
    assert json.loads(journal_path(tmp_path).read_text())["epoch"] < seen  # the journal is behind
    kill9(d)
    blocker.rmdir()

    d = start(cfg, cleanup)
    (first,) = wait_until(lambda: _epoch_or_none(client), 30, "the restarted daemon answers")
    assert first > seen, f"a client saw epoch {seen}; the next daemon answers {first}"
    assert d.terminate(30) == 0


def test_journal_epoch_at_its_ceiling_or_bad_keeps_the_journal(tmp_path, fake_python, cleanup):
    """A journal at the epoch's ceiling is taken, and what the daemon started from it writes
    (the epoch saturates there) is taken by the next one: nothing moved aside, the round kept.
    A bad epoch is dropped alone (journal.epoch_dropped): the round is kept, the epoch starts
    from the wall clock (as for an older daemon's journal, which has none)."""
    cfg = config(tmp_path, fake_python, [spawned("e0", model_dir(tmp_path / "model"), free_port())])
    client = SupervisorClient(sock(tmp_path))
    write_journal(tmp_path, {}, boot=boot_id())  # round 2
    data = json.loads(journal_path(tmp_path).read_text())
    journal_path(tmp_path).write_text(json.dumps({**data, "epoch": EPOCH_MAX}))
    d = start(cfg, cleanup)
    d.transition("e0", "RUNNING", 30)  # a membership change, journaled
    cleanup[1].add(d.last_pid("e0"))
    assert client.routable_engines()["epoch"] == EPOCH_MAX
    assert json.loads(journal_path(tmp_path).read_text())["epoch"] == EPOCH_MAX

    kill9(d)
    d = start(cfg, cleanup)  # over what that daemon wrote
    (st,) = wait_until(lambda: _status_or_none(client), 30, "the restarted daemon answers")
    assert (st["round"], st["epoch"]) == (2, EPOCH_MAX)

    kill9(d)
    data = json.loads(journal_path(tmp_path).read_text())
    journal_path(tmp_path).write_text(json.dumps({**data, "epoch": "4"}))
    floor = int(time.time() * 1000)
    d = start(cfg, cleanup)
    dropped = d.wait_for(lambda e: e.get("event") == "journal.epoch_dropped", 30)
    assert "'4'" in dropped["problem"]
    (st,) = wait_until(lambda: _status_or_none(client), 30, "the restarted daemon answers")
    assert st["round"] == 2 and floor <= st["epoch"] < EPOCH_MAX
    assert not list(journal_path(tmp_path).parent.glob("journal.json.corrupt-*"))
    assert d.terminate(30) == 0


def _epoch_or_none(client: SupervisorClient) -> tuple[int] | None:
    try:
        return (client.routable_engines()["epoch"],)
    except DaemonUnreachable:  # not listening yet
        return None


def _made(folder: Path) -> bool:
    try:
        folder.mkdir()
        return True
    except FileExistsError:
        return False


def _routable_or_none(client: SupervisorClient) -> tuple[dict[str, Any]] | None:
    try:
        return (dict(client.routable_engines()),)
    except DaemonUnreachable:  # not listening yet
        return None


def _status_or_none(client: SupervisorClient) -> tuple[Any] | None:
    try:
        return (client.status(),)
    except DaemonUnreachable:  # not listening yet
        return None


# -- a journal lost with the version in it ------------------------------------------------------

def test_sync_agent_restores_a_version_the_daemon_lost(tmp_path, fake_python, cleanup):
    """A daemon restarted over a torn journal knows no weight version, and would route engines
    on the base weights as current; the trainer's sync agent publishes its version again at
    its reconnect."""
    from vime.trainer.resync_agent import ResyncAgent

    port = free_port()
    engine = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parents[2] / "harness" / "standin_engine.py"),
                               "--base-port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cfg = config(tmp_path, fake_python, [{"name": "att", "url": f"http://127.0.0.1:{port}"}])
    try:
        d = start(cfg, cleanup)
        d.transition("att", "RUNNING", 30)
        client = SupervisorClient(sock(tmp_path))
        agent = ResyncAgent(SupervisorClient(sock(tmp_path)), lambda: (3, [])).start()
        try:
            client.publish_weights(3)
            time.sleep(0.5)  # the agent sees it on its stream
            kill9(d)
            journal_path(tmp_path).write_text('{"format": 1, "engi')  # torn
            d2 = start(cfg, cleanup)
            d2.wait_for(lambda e: e.get("event") == "weights.published", 30)  # the agent, reconnected
            assert client.status()["weight_version"] == 3
            assert d2.wait_for(lambda e: e.get("event") == "journal.unusable", 1)  # it was lost indeed
        finally:
            agent.stop()
        assert d2.terminate(30) == 0
    finally:
        engine.kill()
        engine.wait(10)


@pytest.mark.parametrize("edit", ["unconfigured_copy", "own_port"])
def test_a_bad_entry_naming_an_engines_pid_never_costs_that_engine_its_process(tmp_path, fake_python, cleanup, edit):
    """A hand-edited journal with a second entry naming e1's live process: `a1`, a name this
    config does not have, copied from e1 with another port; or e0 given e1's pid and start time
    with its own port. That entry is left alone, and whichever entry is read first e1 keeps its
    process (adopted), never stopped as an orphan and restarted."""
    cfg, d, e1_pid = two_running_engines(tmp_path, fake_python, cleanup)
    bad = "a1" if edit == "unconfigured_copy" else "e0"
    for first in (True, False):  # the bad entry read before e1's, then after
        def add_bad_entry(data: dict) -> None:
            e1 = data["engines"]["e1"]
            if edit == "unconfigured_copy":
                data["engines"]["a1"] = {**e1, "port": free_port()}
            else:
                data["engines"]["e0"].update(pid=e1["pid"], start_time=e1["start_time"])
            rest = {k: v for k, v in data["engines"].items() if k != bad}
            data["engines"] = {bad: data["engines"][bad], **rest} if first else {**rest, bad: data["engines"][bad]}

        d, _ = restart_over_edited_journal(tmp_path, cfg, cleanup, d, e1_pid, add_bad_entry)
        assert "e1" in d.wait_for(lambda ev: ev.get("event") == "journal.restored", 30)["adopted"], first
        assert [e.get("engine") for e in d.events if e.get("event") == "journal.not_ours"] == [bad]
        assert not [e for e in d.events if e.get("event") == "journal.not_adopted" and e.get("engine") == "e1"]
    assert d.terminate(30) == 0


def leaderless_group(cleanup) -> tuple[int, int]:
    """(pgid, pid) of a `sleep` left in a process group whose leader has exited: no engine."""
    sh = subprocess.run(["setsid", "sh", "-c", "sleep 900 >/dev/null 2>&1 & echo $!"], capture_output=True,
                        text=True, timeout=10, check=True)
    pid = int(sh.stdout.strip())
    cleanup[1].add(pid)
    pgid = os.getpgid(pid)
    assert pgid != pid and proc_stat(pgid) is None  # its leader (the shell) is gone
    return pgid, pid


def test_journal_naming_a_leaderless_group_with_no_start_time_signals_none_of_it(tmp_path, fake_python, cleanup):
    """A hand-edited journal whose entries (e0, configured, and `zz`, not) name process groups
    whose leaders have exited, with `start_time: 0`: their members are no engines of ours
    (no spawn mark) and are never signalled; e0 gets a fresh process."""
    port = free_port()
    cfg = config(tmp_path, fake_python, [spawned("e0", model_dir(tmp_path / "model"), port)])
    (g0, victim0), (g1, victim1) = leaderless_group(cleanup), leaderless_group(cleanup)
    try:
        entry = running_entry(g0, 0, port, tmp_path / "x.log")
        write_journal(tmp_path, {"e0": entry, "zz": {**entry, "pid": g1, "port": free_port()}}, boot=boot_id())
        d = start(cfg, cleanup)
        d.transition("e0", "RUNNING", 30)
        cleanup[1].add(d.last_pid("e0"))
        assert alive(victim0) and alive(victim1)
        assert d.terminate(30) == 0
        assert alive(victim0) and alive(victim1)
    finally:
        for pid in (victim0, victim1):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def orphan_of_another_daemon(tmp_path: Path, fake_python: Path, cleanup, model: Path) -> tuple[dict, Path]:
    """Daemon `a` (its own folders) spawns e0, which reaches RUNNING; then `a` is killed with -9:
    (a's journal entry for e0, a's journal), e0 left running."""
    (tmp_path / "a").mkdir()
    a = start(config(tmp_path / "a", fake_python, [spawned("e0", model, free_port())]), cleanup)
    a.transition("e0", "RUNNING", 30)
    cleanup[1].add(a.last_pid("e0"))
    kill9(a)
    entry = json.loads(journal_path(tmp_path / "a").read_text())["engines"]["e0"]
    assert alive(entry["pid"])
    return entry, journal_path(tmp_path / "a")


def test_journal_copied_from_another_daemon_neither_adopts_nor_kills(tmp_path, fake_python, cleanup):
    """A state_dir copied from daemon a to daemon b (one host, one boot): b's config has no e0,
    so a's entry is unconfigured here; b adopts and kills nothing by pid (a's orphaned engine
    lives on) and starts its own engine."""
    model = model_dir(tmp_path / "model")
    theirs, a_journal = orphan_of_another_daemon(tmp_path, fake_python, cleanup, model)
    (tmp_path / "b").mkdir()
    b_cfg = config(tmp_path / "b", fake_python, [spawned("f0", model, free_port())])
    journal_path(tmp_path / "b").parent.mkdir(parents=True)
    journal_path(tmp_path / "b").write_bytes(a_journal.read_bytes())
    b = start(b_cfg, cleanup)
    b.transition("f0", "RUNNING", 30)
    cleanup[1].add(b.last_pid("f0"))
    assert alive(theirs["pid"])
    assert not [e for e in b.events if e.get("event") in ("journal.not_adopted", "engine.adopted")]
    copied = [e for e in b.events if e.get("event") == "journal.copied"]
    assert len(copied) == 1 and copied[0]["written_at"] == str(a_journal.absolute())
    assert b.terminate(30) == 0
    assert alive(theirs["pid"])


def test_journal_entry_edited_to_another_port_than_its_config_is_not_adopted(tmp_path, fake_python, cleanup):
    """b's own journal with e0's pid, start time and port edited to name daemon a's orphaned
    engine (an engine server of ours, on a port b's config gives no engine), e0's fingerprint
    kept: that fingerprint says e0 serves b's port, so the process is not b's e0: left alone,
    never adopted; b's e0 gets a process of its own on its port."""
    model = model_dir(tmp_path / "model")
    theirs, _ = orphan_of_another_daemon(tmp_path, fake_python, cleanup, model)
    b_port = free_port()
    (tmp_path / "b").mkdir()
    b = start(config(tmp_path / "b", fake_python, [spawned("e0", model, b_port)]), cleanup)
    b.transition("e0", "RUNNING", 30)
    cleanup[1].add(b.last_pid("e0"))
    kill9(b)
    data = json.loads(journal_path(tmp_path / "b").read_text())
    for key in ("pid", "start_time", "port", "log_path"):
        data["engines"]["e0"][key] = theirs[key]
    journal_path(tmp_path / "b").write_text(json.dumps(data))
    b = start(config(tmp_path / "b", fake_python, [spawned("e0", model, b_port)]), cleanup)
    b.transition("e0", "RUNNING", 30)
    e0 = SupervisorClient(sock(tmp_path / "b")).status()["engines"][0]
    cleanup[1].add(e0["pid"])
    assert e0["pid"] != theirs["pid"]
    assert not [e for e in b.events if e.get("event") == "engine.adopted"]
    assert [e.get("engine") for e in b.events if e.get("event") == "journal.not_ours"] == ["e0"]
    assert alive(theirs["pid"])
    assert b.terminate(30) == 0
    assert alive(theirs["pid"])
