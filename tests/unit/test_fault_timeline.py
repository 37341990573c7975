"""harness/faults.py's timeline: a fault's detection, return and resync read from the daemon's
transition events by their structured cause, and the example loop kept apart from the harness."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from vime.harness.faults import Fault, timeline

ROOT = Path(__file__).resolve().parents[2]


def _ev(ts, frm, to, reason, cause=None, engine="engine-0"):
    ev = {"event": "transition", "engine": engine, "ts": ts, "from_state": frm, "to_state": to, "reason": reason}
    if cause is not None:
        ev["cause"] = cause
    return ev


def _killed(events) -> Fault:
    f = Fault("kill", 3, engine="engine-0", fired_step=3, injected_at=100.0)
    return timeline(f, [{"event": "hello", "ts": 90.0}, _ev(99.0, "RUNNING", "EXITED", "earlier", "exit"),
                        *events])


def test_a_kill_is_detected_back_up_and_resynced_by_cause():
    f = _killed([
        _ev(100.1, "RUNNING", "EXITED", "exited unexpectedly (killed by SIGKILL)", "exit"),
        _ev(101.0, "EXITED", "STARTING", "restart 1", "exit"),
        _ev(140.0, "STARTING", "STALE", "base weights; current v3", "exit"),
        _ev(140.5, "STALE", "SYNCING", "trainer agent pushing v3", "exit"),
        # the reason says "verified", the cause does not: the cause decides
        _ev(140.6, "SYNCING", "RUNNING", "weights v3, verified", "probe"),
        _ev(141.0, "SUSPECT", "RUNNING", "weights v3, pushed", "verified"),
        _ev(142.0, "RUNNING", "UNHEALTHY", "later", "hang"),
    ])
    assert (f.detected_at, f.ready_at, f.resynced_at) == (100.1, 140.0, 141.0)
    assert f.detected_cause == "exit" and f.wrong_cause() is None
    assert f.detected_as == "EXITED: exited unexpectedly (killed by SIGKILL)"
    assert f.resync_reason == "weights v3, pushed"
    assert f.as_dict()["detected_cause"] == "exit"


def test_a_verified_engine_held_by_an_open_round_is_resynced_when_released():
    f = _killed([
        _ev(100.1, "RUNNING", "EXITED", "exited unexpectedly (killed by SIGKILL)", "exit"),
        _ev(140.0, "STARTING", "STALE", "base weights; current v3", "ready"),
        _ev(140.5, "STALE", "SYNCING", "trainer agent pushing v3", "sync"),
        _ev(141.0, "SYNCING", "STALE", "weights v3, verified; round 7 open", "verified"),
        _ev(143.0, "STALE", "RUNNING", "round 7 ended", "released"),
    ])
    assert (f.ready_at, f.resynced_at, f.resync_reason) == (140.0, 143.0, "round 7 ended")


def test_running_again_without_a_verified_sync_is_not_resynced():
    f = _killed([
        _ev(100.1, "RUNNING", "EXITED", "exited unexpectedly (killed by SIGKILL)", "exit"),
        _ev(141.0, "SYNCING", "STALE", "weights v3, verified; round 7 open", "verified"),
        _ev(142.0, "STALE", "UNHEALTHY", "hung", "hang"),
        _ev(150.0, "UNHEALTHY", "RUNNING", "recovered: answering probes again (weights verified before)", "recovered"),
    ])
    assert f.resynced_at is None


def test_a_spare_promoted_into_the_killed_engines_place_is_full_strength_once_verified():
    """The spare (engine-2) is promoted in the round gap and synced; the killed engine comes
    back as the new spare: recovered, and full strength is timed from the round's end."""
    f = _killed([
        _ev(100.1, "RUNNING", "EXITED", "exited unexpectedly (killed by SIGKILL)", "exit"),
        _ev(100.2, "STANDBY", "STALE", "promoted before round 3", "promoted", engine="engine-1"),  # not in its gap
        {"event": "round_end", "round": 3, "ts": 102.0},
        _ev(102.1, "STANDBY", "STALE", "2/2 engines active, round 3 ended", "promoted", engine="engine-2"),
        _ev(102.3, "STALE", "SYNCING", "trainer agent pushing v3", "sync", engine="engine-2"),
        _ev(102.9, "SYNCING", "RUNNING", "weights v3, verified", "verified", engine="engine-2"),
        _ev(102.95, "EXITED", "STARTING", "restart 1", "restart"),
        _ev(150.0, "STARTING", "STANDBY", "base weights; synced when promoted", "spare"),
        _ev(160.0, "RUNNING", "EXITED", "a later fault of the spare", "exit", engine="engine-2"),
    ])
    assert (f.detected_at, f.ready_at, f.resynced_at) == (100.1, 150.0, 150.0)
    assert (f.spare, f.gap_at, f.full_at) == ("engine-2", 102.0, 102.9)
    assert f.full_after_gap() == pytest.approx(0.9) and f.place_back_at() == 102.9
    assert f.resync_reason == "back as the spare; engine-2 serves in its place"
    assert f.as_dict()["spare"] == "engine-2" and f.as_dict()["full_after_gap_s"] == pytest.approx(0.9)


def test_a_spare_admitted_inside_the_round_fills_the_place_before_the_gap():
    """`admit_mid_round`: the current spare is promoted straight to RUNNING inside the round
    (the daemon's reason says so); full strength is timed from the fault, not the gap."""
    f = _killed([
        _ev(100.1, "RUNNING", "EXITED", "exited unexpectedly (killed by SIGKILL)", "exit"),
        _ev(100.3, "STANDBY", "RUNNING", "1/2 engines active, admitted inside round 3", "promoted",
            engine="engine-2"),
        {"event": "round_end", "round": 3, "ts": 104.0},
        _ev(104.1, "EXITED", "STARTING", "restart 1", "restart"),
        _ev(150.0, "STARTING", "STANDBY", "base weights; synced when promoted", "spare"),
    ])
    assert (f.spare, f.full_at, f.gap_at) == ("engine-2", 100.3, 104.0)
    assert f.filled_in_round() and f.after(f.full_at) == pytest.approx(0.3) and f.full_after_gap() == 0.0
    assert f.resync_reason == "back as the spare; engine-2 serves in its place"


def test_a_promotion_after_the_engine_resynced_itself_is_not_its_spare():
    f = _killed([
        _ev(100.1, "RUNNING", "EXITED", "exited unexpectedly (killed by SIGKILL)", "exit"),
        {"event": "round_end", "round": 3, "ts": 101.0},
        _ev(140.0, "STARTING", "STALE", "base weights; current v3", "ready"),
        _ev(141.0, "SYNCING", "RUNNING", "weights v3, verified", "verified"),
        _ev(150.0, "STANDBY", "STALE", "a later fault's promotion", "promoted", engine="engine-2"),
        _ev(151.0, "SYNCING", "RUNNING", "weights v3, verified", "verified", engine="engine-2"),
    ])
    assert f.spare is None and f.full_at is None and f.resynced_at == 141.0
    assert f.full_after_gap() == pytest.approx(40.0)  # the engine's own resync, from the round's end


def test_a_fault_seen_with_another_cause_says_so():
    f = _killed([_ev(100.1, "RUNNING", "UNHEALTHY", "hung: 2 consecutive probe failures", "hang")])
    assert f.wrong_cause() == "kill detected as 'hang', not 'exit'"


def test_the_reason_text_alone_decides_nothing():
    f = _killed([
        _ev(100.1, "RUNNING", "EXITED", "exited unexpectedly (killed by SIGKILL)", "exit"),
        _ev(140.0, "STARTING", "STALE", "base weights; current v3", "ready"),
        _ev(141.0, "SYNCING", "RUNNING", "weights v3, verified"),  # no cause
    ])
    assert (f.detected_at, f.ready_at, f.resynced_at) == (100.1, 140.0, None)


def test_the_example_loop_imports_no_harness_and_injects_no_fault():
    tree = ast.parse((ROOT / "trainer" / "rl_loop.py").read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m and m.startswith("vime.harness") for m in mods)
    words = {getattr(n, "id", None) or getattr(n, "attr", None) or getattr(n, "name", None) or getattr(n, "arg", None)
             for n in ast.walk(tree)}
    words |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
              and n.value.startswith("--")}
    injector = {"fault", "faults", "Fault", "plan", "hooks", "kill_at", "hang_at", "fail_push_at", "fault_wait",
                "fault_delay", "kill_server", "hang_core", "kill_daemon", "FailHalfway", "--kill-at", "--hang-at",
                "--fail-push-at", "--fault-wait", "--fault-delay"}
    assert words & injector == set()
