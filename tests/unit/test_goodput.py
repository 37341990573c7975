"""The goodput accounting (harness/goodput.py) on hand-made schedules with known losses: each
gives exactly the figures worked out by hand."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vime.harness import goodput as g
from vime.harness.faults import Fault
from vime.trainer.continuation import StartOver

ROOT = Path(__file__).resolve().parents[2]
R, S = "RUNNING", "STANDBY"


@dataclass
class Step:
    """The StepRecord fields the accounting reads (rl_loop imports torch: too slow to load here)."""

    samples: int = 8
    seconds: float = 10.0
    lost: bool = False
    tokens_cut: int = 0
    tokens_reused: int = 0
    tokens_regenerated: int = 0


def tr(ts: float, engine: str, frm: str, to: str, cause: str, reason: str = "") -> dict[str, Any]:
    return {"event": "transition", "ts": ts, "engine": engine, "from_state": frm, "to_state": to,
            "cause": cause, "reason": reason}


def boot(*engines: str, spares: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Engines up before the first round (t < 0), spares kept warm."""
    evs = []
    for e in engines:
        evs += [tr(-5.0, e, "STOPPED", "STARTING", "start"), tr(-2.0, e, "STARTING", R, "ready")]
    for e in spares:
        evs += [tr(-5.0, e, "STOPPED", "STARTING", "start"), tr(-2.0, e, "STARTING", S, "spare")]
    return evs


def rounds(n: int, length: float = 10.0, gap: float = 1.0) -> list[dict[str, Any]]:
    """n rounds from t=0: round i spans [i*(length+gap), i*(length+gap)+length]."""
    out = []
    for i in range(n):
        t = i * (length + gap)
        out += [{"event": "round_start", "ts": t, "round": i}, {"event": "round_end", "ts": t + length, "round": i}]
    return out


def run(events: list[dict[str, Any]], faults: list[Fault], steps: list[Step], wall: float = 100.0,
        useful: int = 10_000, **kw: Any) -> g.Run:
    return g.Run("cfg", events, faults, steps, target=2, wall_s=wall, useful_tokens=useful, **kw)


def kill(engine: str, at: float, kind: str = "kill") -> Fault:
    return Fault(kind, step=0, engine=engine, injected_at=at)


def test_no_faults_gives_ettr_one_and_nothing_lost() -> None:
    row = g.account(run(boot("e0", "e1") + rounds(3), [], [Step()] * 3), fault_free_s=100.0)
    assert row.ettr == 1.0
    assert (row.tokens_lost, row.rounds_lost, row.false_restarts, row.reduced_s, row.engines) == (0, 0, 0, 0.0, 2)
    assert row.useful_tps == 100.0
    assert row.tokens_lost_per_fault is None and row.reduced_s_per_fault is None


def test_kill_covered_by_a_spare_in_half_a_second() -> None:
    evs = boot("e0", "e1", spares=("s0",)) + rounds(2) + [
        tr(3.0, "e0", R, "EXITED", "exit", "exited unexpectedly (-9)"),
        tr(3.5, "s0", S, R, "promoted", "promoted: inside round 0"),
        tr(3.6, "e0", "EXITED", "STARTING", "restart"),
        tr(20.0, "e0", "STARTING", S, "spare")]
    row = g.account(run(evs, [kill("e0", 2.9)], [Step(), Step()], wall=105.0), fault_free_s=100.0)
    assert row.reduced_s == pytest.approx(0.5)
    assert row.reduced_s_per_fault == pytest.approx(0.5)
    assert row.false_restarts == 0 and row.unmatched == []
    assert row.engines == 3  # the spare is one more
    assert row.ettr == pytest.approx(100 / 105)


def test_kill_with_a_sixty_second_restart() -> None:
    evs = boot("e0", "e1") + rounds(8) + [
        tr(5.0, "e0", R, "EXITED", "exit"), tr(5.1, "e0", "EXITED", "STARTING", "restart"),
        tr(55.0, "e0", "STARTING", "STALE", "ready"), tr(60.0, "e0", "STALE", "SYNCING", "sync"),
        tr(64.0, "e0", "SYNCING", "STALE", "verified"), tr(65.0, "e0", "STALE", R, "released")]
    row = g.account(run(evs, [kill("e0", 4.9)], [Step()] * 8, wall=125.0), fault_free_s=100.0)
    assert row.reduced_s == pytest.approx(60.0)
    assert row.ettr == pytest.approx(0.8)
    assert row.false_restarts == 0 and row.engines == 2


def test_reduced_strength_counts_only_inside_the_rounds_window() -> None:
    # Down before the first round and after the last: only [0, 10] counts, and e1 is down all of it.
    evs = boot("e0", "e1") + rounds(1) + [tr(-1.0, "e1", R, "EXITED", "exit"), tr(30.0, "e1", "EXITED", "STARTING",
                                                                                  "restart")]
    assert g.reduced_strength(evs, target=2) == pytest.approx(10.0)
    assert g.reduced_strength(evs, target=1) == 0.0


def test_a_hang_with_no_fault_is_one_false_restart() -> None:
    # A hang's SUSPECT -> UNHEALTHY -> STOPPING -> EXITED is one stop; SUSPECT still serves.
    evs = boot("e0", "e1") + rounds(2) + [
        tr(2.0, "e1", R, "SUSPECT", "probe"), tr(4.0, "e1", "SUSPECT", "UNHEALTHY", "hang"),
        tr(4.1, "e1", "UNHEALTHY", "STOPPING", "hang"), tr(5.0, "e1", "STOPPING", "EXITED", "hang"),
        tr(5.1, "e1", "EXITED", "STARTING", "restart"), tr(9.0, "e1", "STARTING", R, "ready")]
    row = g.account(run(evs, [], [Step(), Step()]))
    assert row.false_restarts == 1
    assert row.reduced_s == pytest.approx(5.0)  # UNHEALTHY at 4.0 to RUNNING at 9.0
    assert row.ettr is None  # no fault-free time given


def test_a_stop_with_the_wrong_cause_is_false_and_the_fault_unmatched() -> None:
    evs = boot("e0", "e1") + rounds(1) + [tr(3.0, "e0", R, "UNHEALTHY", "hang")]
    false, unmatched = g.false_restarts(evs, [kill("e0", 2.0)])
    assert false == 1 and [f.kind for f in unmatched] == ["kill"]
    # The right cause on another engine, or before the injection, matches no fault either.
    assert g.false_restarts([tr(3.0, "e1", R, "EXITED", "exit")], [kill("e0", 2.0)])[0] == 1
    assert g.false_restarts([tr(1.0, "e0", R, "EXITED", "exit")], [kill("e0", 2.0)])[0] == 1
    # Operator stops, shutdown and failed starts are no stops.
    assert g.stops([tr(1.0, "e0", R, "STOPPING", "operator"), tr(2.0, "e1", R, "STOPPING", "shutdown"),
                    tr(3.0, "e0", "STARTING", "EXITED", "exit")]) == []


def test_each_fault_matches_one_stop() -> None:
    evs = [tr(3.0, "e0", R, "EXITED", "exit"), tr(3.1, "e0", "EXITED", "STARTING", "restart"),
           tr(8.0, "e0", "STARTING", R, "ready"), tr(9.0, "e0", R, "EXITED", "exit")]
    assert g.false_restarts(evs, [kill("e0", 2.0)])[0] == 1
    assert g.false_restarts(evs, [kill("e0", 2.0), kill("e0", 8.5, "kill-gap")])[0] == 0
    # A poisoned push and a hang each match their own cause.
    evs = [tr(3.0, "e0", R, "UNHEALTHY", "poisoned"), tr(3.0, "e1", "SUSPECT", "UNHEALTHY", "hang")]
    assert g.false_restarts(evs, [Fault("push", 0, "e0", injected_at=2.0), Fault("hang", 0, "e1", injected_at=1.0)]) \
        == (0, [])


def test_faults_during_a_push_are_expected_stops_with_their_own_causes() -> None:
    # Rounds [0,10], [20,30], [40,50], [60,70]; each push in the gap after a round.
    evs = boot("e0", "e1") + rounds(4, gap=10.0) + [
        # kill-mid-push of e0 at 12.0: exited, back RUNNING at 18.0 (5.9 s below target)
        tr(12.1, "e0", R, "EXITED", "exit"), tr(12.2, "e0", "EXITED", "STARTING", "restart"),
        tr(18.0, "e0", "STARTING", R, "ready"),
        # stop-mid-push of e1 at 32.0: its hang is one stop (UNHEALTHY at 33.0 to RUNNING at 38.0: 5.0 s)
        tr(33.0, "e1", R, "UNHEALTHY", "hang"), tr(33.1, "e1", "UNHEALTHY", "STOPPING", "hang"),
        tr(33.5, "e1", "STOPPING", "EXITED", "hang"), tr(33.6, "e1", "EXITED", "STARTING", "restart"),
        tr(38.0, "e1", "STARTING", R, "ready"),
        # the trainer dies mid-push at 52.0: both receivers paused past the deadline, back at 59.0 (4.0 s)
        *[tr(55.0, e, R, "UNHEALTHY", "paused") for e in ("e0", "e1")],
        *[tr(55.5, e, "UNHEALTHY", "EXITED", "paused") for e in ("e0", "e1")],
        *[tr(56.0, e, "EXITED", "STARTING", "restart") for e in ("e0", "e1")],
        *[tr(59.0, e, "STARTING", R, "ready") for e in ("e0", "e1")]]
    plan = [Fault("kill-mid-push", 1, "e0", fired_step=1, injected_at=12.0),
            Fault("stop-mid-push", 2, "e1", fired_step=2, injected_at=32.0),
            # one Fault per receiver (chaos.py), one injection
            Fault("trainer-dies-mid-push", 3, "e0", fired_step=3, injected_at=52.0),
            Fault("trainer-dies-mid-push", 3, "e1", fired_step=3, injected_at=52.0)]
    row = g.account(run(evs, plan, [Step()] * 4))
    assert row.faults == 3 and g.injections(plan) == 3
    assert row.false_restarts == 0 and row.unmatched == []
    assert row.reduced_s == pytest.approx(5.9 + 5.0 + 4.0)
    assert row.reduced_s_per_fault == pytest.approx(14.9 / 3)
    # A receiver of the dead trainer seen as hung: a false restart, and its fault unmatched.
    wrong = [dict(ev, cause="hang") if ev.get("engine") == "e1" and ev["ts"] >= 55.0 else ev for ev in evs]
    row = g.account(run(wrong, plan, [Step()] * 4))
    assert row.false_restarts == 1 and row.unmatched == ["trainer-dies-mid-push@e1"]


def test_a_daemon_kill_stops_no_engine() -> None:
    # The daemon killed at 3.0 in round 0; the next one re-adopts both engines at 4.5.
    readopt = [tr(4.5, e, "STOPPED", "STARTING", "restored", "re-adopting pid 7 after a daemon restart")
               for e in ("e0", "e1")]
    evs = boot("e0", "e1") + rounds(2) + readopt + [tr(4.7, e, "STARTING", R, "ready") for e in ("e0", "e1")]
    daemon = Fault("daemon", 1, "daemon", fired_step=1, injected_at=3.0)
    row = g.account(run(evs, [daemon], [Step(), Step()]))
    assert (row.faults, row.false_restarts, row.unmatched, row.engines) == (1, 0, [], 2)
    assert row.reduced_s == 0.0  # they served on through the daemon's restart
    # One that comes back at another version is out of routing until it is RUNNING again.
    evs = boot("e0", "e1") + rounds(2) + readopt + [
        tr(4.7, "e0", "STARTING", R, "ready"), tr(4.7, "e1", "STARTING", "STALE", "ready"),
        tr(7.0, "e1", "STALE", R, "released")]
    assert g.account(run(evs, [daemon], [Step(), Step()])).reduced_s == pytest.approx(2.3)
    # An engine stop after it is still a stop: the daemon's kill explains none.
    evs += [tr(15.0, "e0", R, "EXITED", "exit")]
    assert g.account(run(evs, [daemon], [Step(), Step()])).false_restarts == 1


def test_a_lost_round() -> None:
    steps = [Step(), Step(lost=True, tokens_cut=30, tokens_reused=20, tokens_regenerated=10), Step()]
    # Its 8 returned samples held 80 tokens (the 20 reused among them): all thrown away.
    row = g.account(run(boot("e0", "e1") + rounds(3), [kill("e0", 12.0)], steps, discarded_tokens=80))
    assert (row.rounds, row.rounds_lost) == (3, 1)
    assert row.tokens_lost == 90 and row.tokens_lost_per_fault == 90.0


def test_a_request_started_over_with_twelve_tokens() -> None:
    steps = [Step(tokens_cut=12, tokens_regenerated=12), Step()]
    row = g.account(run(boot("e0", "e1") + rounds(2), [kill("e0", 3.0)], steps,
                        started_over=[StartOver("e0", 1, 12, "no token ids")]))
    assert row.tokens_lost == 12 and row.tokens_lost_per_fault == 12.0 and row.started_over == 1
    # Continued instead: the 12 tokens are kept, none lost.
    row = g.account(run(boot("e0", "e1") + rounds(2), [kill("e0", 3.0)], [Step(tokens_cut=12, tokens_reused=12)]))
    assert row.tokens_lost == 0


def test_versus_the_baseline_and_the_table() -> None:
    base = g.account(run(boot("e0", "e1") + rounds(2), [], [Step()] * 2, wall=100.0, useful=10_000), 100.0)
    evs = boot("e0", "e1") + rounds(2) + [tr(3.0, "e0", R, "EXITED", "exit"), tr(9.0, "e0", "EXITED", R, "ready")]
    faulted = g.account(g.Run("slime", evs, [kill("e0", 2.0)], [Step()] * 2, target=2, wall_s=125.0,
                              useful_tokens=10_000), 100.0)
    assert g.versus(faulted, base) == {"useful_tps": pytest.approx(0.8), "wall": 1.25, "ettr": 0.8}
    assert g.versus(base, base) == {"useful_tps": 1.0, "wall": 1.0, "ettr": 1.0}
    lines = g.table([base, faulted], baseline=base)
    row = lines[-1].split()
    assert row[0] == "slime" and row[4] == "0.80" and row[6] == "0.80" and row[-1] == "6.0"
    assert lines[2].split()[-1] == "-"  # no faults: no per-fault figure


def test_the_round_record_matches_rl_loops_step_record() -> None:
    # StepRecord is read from the source (importing rl_loop loads torch).
    tree = ast.parse((ROOT / "trainer" / "rl_loop.py").read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "StepRecord")
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert set(g.RoundRecord.__annotations__) <= fields


def test_ettr_needs_a_positive_wall_time() -> None:
    assert g.ettr(80.0, 100.0) == 0.8
    with pytest.raises(ValueError):
        g.ettr(80.0, 0.0)
