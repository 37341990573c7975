"""Busy is not hung, through a real daemon process and its control socket, with protocol
stand-ins (tests/support/standin_group.py) for what vLLM cannot be made to show on demand: a group that
burns CPU with frozen counters, a stopped EngineCore, a pause that outlasts the probes, a start
that never finishes, a stop that outlives SIGTERM, a warm-up the engine refuses, a weight
version that is not a number. Real engines show the same in tests/engine/test_engines_real.py (its busy test).

The demo's tight probes: interval 1 s, timeout 2 s, failure threshold 2.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vime.supervisor.engine.activity import sample_group
from vime.supervisor.engine.probes import PROGRESS_WINDOW
from vime.supervisor.client import SupervisorClient
from vime.harness.local_daemon import Daemon, free_port, write_config

from support.mode_fleet import mode_fleet

from test_client_ctl import engines_by_name, listening, wait_state

PROBE = {"first_wait": 15.0, "interval": 1.0, "timeout": 2.0, "failure_threshold": 2, "max_busy": 10.0}
# How long the counters-only rule took to stop a busy engine: interval + 2 x (timeout + window).
OLD_RULE_STOP = PROBE["interval"] + 2 * (PROBE["timeout"] + PROGRESS_WINDOW)
# The issue's bound for a hang: interval + threshold x (timeout + progress window) + 1 s.
HANG_BOUND = OLD_RULE_STOP + 1.0
ENGINES = ("busy", "hang", "paused", "slowstart", "deaf", "rejects", "version")
FIRST_MODE = {"slowstart": "silent", "deaf": "deaf", "rejects": "reject", "version": "version=\u00b2"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with mode_fleet(tmp_path_factory.mktemp("busy-hung"), {n: FIRST_MODE.get(n, "ok") for n in ENGINES},
                    ("busy", "hang", "paused", "deaf", "version"), supervisor={}, health_check=PROBE,
                    restart={"start_retries": 2, "backoff_initial": 30.0, "backoff_max": 60.0}) as world:
        yield world


def transitions(d: Daemon, engine: str, after: int) -> list[dict]:
    return [e for e in d.events[after:] if e.get("event") == "engine.transition" and e.get("engine") == engine]


def incidents(root: Path, engine: str, *, at_least: int = 0, timeout: float = 15.0) -> list[dict]:
    """The engine's incident folders, waiting (the capture follows the transition) for at least
    `at_least` complete ones."""
    deadline = time.monotonic() + timeout
    while True:
        out = []
        for f in sorted((root / "logs" / "incidents").glob(f"*-{engine}-*")):
            if (f / "incident.json").exists():
                out.append({"folder": f, **json.loads((f / "incident.json").read_text())})
        if len(out) >= at_least or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def late_but_kept(fleet, mode: str, detail: str) -> None:
    """The engine named after `mode` put in it for twice what the counters-only rule allowed:
    its probes are late with `detail`, and it never leaves RUNNING (not even SUSPECT)."""
    d, mark = fleet.daemon, fleet.daemon.mark()
    fleet.modes[mode].write_text(mode)
    try:
        time.sleep(2 * OLD_RULE_STOP)
        e = engines_by_name(fleet.client.status())[mode]
        assert e["last_probe"]["detail"].startswith(detail), e
    finally:
        fleet.modes[mode].write_text("ok")
    wait_state(fleet.client, mode, {"RUNNING"})
    assert transitions(d, mode, mark) == []


def test_busy_group_with_frozen_counters_is_not_stopped(fleet):
    """CPU burning, no token counted, probes late for longer than the counters-only rule
    allowed: excused as busy, never a failure."""
    late_but_kept(fleet, "busy", "busy: probe late (>2s), no tokens, processes at")


def test_stopped_engine_core_is_detected_within_the_bound(fleet):
    d, mark = fleet.daemon, fleet.daemon.mark()
    leader = engines_by_name(fleet.client.status())["hang"]["pid"]
    core = next(m.pid for m in sample_group(leader).members if m.pid != leader)
    fleet.modes["hang"].write_text("hang")
    os.kill(core, signal.SIGSTOP)
    t0 = time.monotonic()
    ev = d.transition("hang", "UNHEALTHY", HANG_BOUND + 5, after=mark)
    took = time.monotonic() - t0
    fleet.modes["hang"].write_text("ok")
    assert took <= HANG_BOUND, f"detected after {took:.1f}s, bound {HANG_BOUND:.1f}s"
    assert "stopped: " in ev["reason"] and f"({core}) T" in ev["reason"], ev["reason"]
    wait_state(fleet.client, "hang", {"RUNNING"}, timeout=30)  # restarted (no round open)


def test_fault8_paused_engine_is_not_declared_hung(fleet):
    """Fault 8 (stand-in; the real engine is in test_engines_real.py's busy test): vLLM 0.32 queues requests
    while paused instead of answering 503; /is_paused says so, and the engine is kept."""
    late_but_kept(fleet, "paused", "paused: probe late")


def test_busy_past_max_busy_is_stopped_with_the_busy_reason(fleet):
    d, mark = fleet.daemon, fleet.daemon.mark()
    fleet.modes["busy"].write_text("busy")
    try:
        ev = d.transition("busy", "UNHEALTHY", PROBE["max_busy"] + 2 * OLD_RULE_STOP, after=mark)
    finally:
        fleet.modes["busy"].write_text("ok")
    assert ev["reason"].startswith("hung: busy for 1") and "s without progress" in ev["reason"], ev["reason"]
    assert incidents(fleet.root, "busy", at_least=1)[-1]["reason"] == ev["reason"]
    wait_state(fleet.client, "busy", {"RUNNING"}, timeout=30)


def test_start_that_runs_out_of_first_wait_says_what_the_processes_did(fleet):
    d = fleet.daemon
    ev = d.wait_for(lambda e: e.get("event") == "engine.transition" and e.get("engine") == "slowstart"
                    and e.get("to_state") == "BACKOFF", PROBE["first_wait"] + 20)
    assert "not ready within first_wait (15s); processes: " in ev["reason"], ev["reason"]
    found = incidents(fleet.root, "slowstart", at_least=1)
    assert found[0]["reason"].startswith("not ready within first_wait (15s); processes: ")
    assert found[0]["incarnation"] == 1 and found[0]["probe_history"] == []  # never probed
    assert found[0]["processes"] and all(p["state"] in "RSDTt" for p in found[0]["processes"])
    assert "log_tail.txt" in found[0]["captured"]


def test_stop_that_outlives_sigterm_gets_an_incident(fleet):
    before = len(incidents(fleet.root, "deaf"))
    t0 = time.monotonic()
    fleet.client.stop("deaf")
    assert time.monotonic() - t0 >= 2.0  # stop_timeout, then SIGKILL
    wait_state(fleet.client, "deaf", {"STOPPED"})
    found = incidents(fleet.root, "deaf", at_least=before + 1)[before:]
    assert len(found) == 1 and found[0]["reason"].startswith("still running 2s after SIGTERM; processes: ")
    assert found[0]["state"] == "STOPPING"


def test_fault4_restart_during_the_clean_up_after_a_death_is_not_lost(fleet):
    """A restart that arrives while a dead engine's group is being cleaned up (its core ignores
    SIGTERM, so that takes up to 1 s) used to leave the engine STOPPED for good."""
    client = fleet.client
    if engines_by_name(client.status())["deaf"]["state"] != "RUNNING":
        client.start("deaf")
        wait_state(client, "deaf", {"RUNNING"}, timeout=30)
    d, mark = fleet.daemon, fleet.daemon.mark()
    leader = engines_by_name(client.status())["deaf"]["pid"]
    os.kill(leader, signal.SIGKILL)
    d.transition("deaf", "EXITED", 10, after=mark)
    client.restart("deaf")  # the group's core still lives: clean-up in progress
    e = wait_state(client, "deaf", {"RUNNING"}, timeout=30)
    assert e["pid"] != leader


def test_warm_up_refused_is_a_failed_start_with_the_engines_answer(fleet):
    ev = fleet.daemon.wait_for(lambda e: e.get("event") == "engine.transition" and e.get("engine") == "rejects"
                               and e.get("to_state") == "BACKOFF", 30)
    assert "warm-up failed: warm-up request answered 400: " in ev["reason"], ev["reason"]
    assert "logprobs not allowed here" in ev["reason"]


def test_fault9_unreadable_weight_version_does_not_end_supervision(fleet):
    """An engine's /weight_info of "²" raised ValueError: the engine stayed STARTING with no
    probes and READY was never sent. Now it is an opaque label and the engine is probed."""
    e = engines_by_name(fleet.client.status())["version"]
    assert e["state"] == "RUNNING" and e["weight_version"] == "\u00b2"
    probes = e["probes"]
    time.sleep(2.5)
    assert engines_by_name(fleet.client.status())["version"]["probes"] > probes


def test_fault11_recovered_attached_engine_waits_for_the_gap(tmp_path):
    """An attached engine that answers again during an open round is held out of routing
    (STALE) until the round ends: membership grows only in gaps. It used to rejoin at once."""
    port = free_port()
    standin = [sys.executable, str(Path(__file__).resolve().parents[2] / "harness" / "standin_engine.py"),
               "--base-port", str(port)]
    engine = subprocess.Popen(standin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cfg = write_config(
        tmp_path / "supervisor.toml",
        supervisor={"runtime_dir": str(tmp_path / "run"), "log_dir": str(tmp_path / "logs")},
        health_check={"first_wait": 15.0, "interval": 0.5, "timeout": 0.4, "failure_threshold": 2},
        engines=[{"name": "att", "url": f"http://127.0.0.1:{port}"}],
    )
    d = Daemon(cfg)
    try:
        listening(d)
        client = SupervisorClient(str(tmp_path / "run" / "supervisor.sock"))
        wait_state(client, "att", {"RUNNING"})
        client.start_round(1)
        engine.kill()
        engine.wait(10)
        wait_state(client, "att", {"UNHEALTHY", "EXITED"})
        epoch = client.routable_engines()["epoch"]
        engine = subprocess.Popen(standin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        e = wait_state(client, "att", {"STALE", "RUNNING"})
        assert e["state"] == "STALE" and "until round 1 ends" in e["reason"], e
        time.sleep(1.0)  # several more good probes: still held
        view = client.routable_engines()
        assert view["engines"] == [] and view["epoch"] == epoch
        client.end_round(1)
        wait_state(client, "att", {"RUNNING"})
        assert [x["name"] for x in client.routable_engines()["engines"]] == ["att"]
    finally:
        engine.kill()
        engine.wait(10)
        assert d.terminate(30) == 0


def test_stop_racing_starts_is_answered(fleet):
    """Review: a stop followed by a storm of starts never answered (it waited for a state the
    next incarnation never left). Each call is answered; the last word is the last start."""
    import threading

    answers: list = []
    stop = threading.Thread(target=lambda: answers.append(fleet.client.stop("version")))
    stop.start()
    for _ in range(10):
        fleet.client.start("version")
        time.sleep(0.1)
    stop.join(30)
    assert not stop.is_alive() and len(answers) == 1, "the stop was never answered"
    wait_state(fleet.client, "version", {"RUNNING"}, timeout=30)
