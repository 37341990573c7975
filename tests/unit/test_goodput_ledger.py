"""harness/goodput_ledger.py: schedules with known losses give known figures (issue 36)."""

from __future__ import annotations

import pytest

from vime.harness.goodput_ledger import (Injection, Restart, RunRecord, Sample, Serving, account,
                                         over_seeds)


def record(**kw: object) -> RunRecord:
    base: dict = {"policy": "p", "seed": 0, "target": 2, "launched_at": 0.0, "end": 100.0,
                  "injections": (), "serving": ()}
    base.update(kw)
    return RunRecord(**base)


def test_one_kill_gives_its_start_recovery_capacity_and_tokens() -> None:
    g = account(record(injections=[Injection(40.0, "kill", ("a",))],
                       serving=[Serving("a", 10.0, 40.0), Serving("b", 12.0), Serving("a", 70.0)],
                       restarts=[Restart(45.0, "a", "exit")], tokens_generated=1000, tokens_discarded=100,
                       rounds=10, rounds_lost=1), fault_free_s=80.0)
    assert g.wall_s == 100.0 and g.ettr == pytest.approx(0.8)
    assert g.useful_tps == pytest.approx(9.0)
    assert g.time_to_start_s == 12.0
    assert g.recover_s == (30.0,) and g.mean_recover_s == 30.0 and g.unrecovered == 0
    assert g.failures == 1 and g.on_down == 0
    assert g.capacity_lost_s == pytest.approx(30.0) and g.capacity_lost_per_fault_s == pytest.approx(30.0)
    assert g.tokens_lost_per_fault == 100.0 and (g.rounds, g.rounds_lost) == (10, 1)
    assert (g.false_restarts, g.stale_samples, g.spare_exhaustions, g.unanswered) == (0, 0, 0, [])


def test_a_hang_the_daemon_never_reports_loses_capacity_from_its_injection() -> None:
    # The record's interval runs on past the hang: the count is still cut at the injection.
    g = account(record(injections=[Injection(40.0, "hang", ("a",))],
                       serving=[Serving("a", 0.0), Serving("b", 0.0)]))
    assert g.capacity_lost_s == pytest.approx(60.0)
    assert g.recover_s == (None,) and g.unrecovered == 1 and g.mean_recover_s is None
    assert g.unanswered == ["hang@a"] and g.false_restarts == 0


def test_overlapping_faults_and_a_fault_on_an_engine_already_down() -> None:
    g = account(record(injections=[Injection(40.0, "kill", ("a",)), Injection(50.0, "kill", ("b",)),
                                   Injection(60.0, "hang", ("a",))],
                       serving=[Serving("a", 0.0, 40.0), Serving("b", 0.0, 50.0), Serving("a", 70.0),
                                Serving("b", 85.0)],
                       restarts=[Restart(41.0, "a", "exit"), Restart(51.0, "b", "exit"), Restart(62.0, "a", "exit")]))
    # 40-50 one down, 50-70 two, 70-85 one: 10 + 40 + 15.
    assert g.capacity_lost_s == pytest.approx(65.0)
    assert g.recover_s == (45.0, 35.0, 25.0)
    assert g.failures == 3 and g.on_down == 1
    assert g.false_restarts == 0 and g.unanswered == []


def test_a_spare_used_up_is_an_exhaustion_and_the_second_fault_waits_for_the_restart() -> None:
    g = account(record(spares=1, injections=[Injection(40.0, "kill", ("a",)), Injection(60.0, "kill", ("b",))],
                       serving=[Serving("a", 0.0, 40.0), Serving("b", 0.0, 60.0), Serving("s", 41.0),
                                Serving("b", 90.0)],
                       spare_ready=[Serving("s", 5.0, 41.0), Serving("a", 80.0)],
                       restarts=[Restart(42.0, "a", "exit"), Restart(61.0, "b", "exit")]))
    assert g.spare_exhaustions == 1
    assert g.recover_s == (1.0, 30.0)
    assert g.capacity_lost_s == pytest.approx(31.0)
    # Without spares in the policy nothing is exhausted.
    assert account(record(injections=[Injection(60.0, "kill", ("b",))],
                          serving=[Serving("a", 0.0), Serving("b", 0.0)])).spare_exhaustions == 0


def test_a_node_fault_takes_every_engine_it_struck() -> None:
    g = account(record(target=3, injections=[Injection(50.0, "node", ("a", "b"))],
                       serving=[Serving("a", 0.0), Serving("b", 0.0), Serving("c", 0.0), Serving("a", 60.0),
                                Serving("b", 70.0)],
                       restarts=[Restart(51.0, "a", "exit"), Restart(51.0, "b", "exit")]))
    assert g.capacity_lost_s == pytest.approx(2 * 10 + 1 * 10)
    assert g.recover_s == (20.0,) and g.false_restarts == 0 and g.unanswered == []


def test_false_restarts_are_counted() -> None:
    g = account(record(injections=[Injection(40.0, "kill", ("a",)), Injection(20.0, "daemon", ())],
                       serving=[Serving("a", 0.0, 40.0), Serving("b", 0.0), Serving("a", 70.0)],
                       restarts=[Restart(30.0, "b", "hang"),       # nothing struck b
                                 Restart(45.0, "a", "exit"),       # the kill's
                                 Restart(80.0, "a", "busy")]))     # a served again since the kill
    assert g.false_restarts == 2 and g.false == ["b@30:hang", "a@80:busy"]
    # The daemon's kill strikes no engine: its re-adopted fleet stays at target.
    assert g.recover_s == (0.0, 30.0) and g.failures == 2


def test_a_crash_at_start_backs_every_restart_until_the_engine_serves() -> None:
    g = account(record(injections=[Injection(40.0, "crash-start", ("a",))],
                       serving=[Serving("a", 0.0, 40.0), Serving("b", 0.0), Serving("a", 60.0)],
                       restarts=[Restart(41.0, "a", "exit"), Restart(50.0, "a", "exit")]))
    assert g.false_restarts == 0 and g.recover_s == (20.0,)


def test_a_stale_sample_is_counted() -> None:
    g = account(record(serving=[Serving("a", 0.0), Serving("b", 0.0)],
                       samples=[Sample(3, 3), Sample(2, 3), Sample(3, 3)]))
    assert g.stale_samples == 1 and g.failures == 0 and g.capacity_lost_s == 0.0
    assert g.tokens_lost_per_fault is None and g.ettr is None


def test_a_fleet_that_never_reaches_target_has_no_start_and_loses_from_launch() -> None:
    g = account(record(serving=[Serving("a", 10.0)]))
    assert g.time_to_start_s is None
    assert g.capacity_lost_s == pytest.approx(2 * 10 + 1 * 90)


def test_the_spread_over_seeds() -> None:
    rows = [account(record(seed=s, injections=[Injection(40.0, "kill", ("a",))],
                           serving=[Serving("a", 0.0, 40.0), Serving("b", 0.0), Serving("a", 40.0 + r)]),
                    fault_free_s=90.0)
            for s, r in enumerate([10.0, 20.0, 40.0])]
    sp = over_seeds(rows)
    cap = sp["capacity_lost_s"]
    assert cap is not None and (cap.median, cap.lo, cap.hi, cap.n) == (20.0, 10.0, 40.0, 3)
    assert (cap.q1, cap.q3) == (15.0, 30.0)
    ettr = sp["ettr"]
    assert ettr is not None and ettr.median == pytest.approx(0.9)
    with pytest.raises(ValueError, match="at least 3 distinct seeds"):
        over_seeds(rows[:2])
    with pytest.raises(ValueError, match="at least 3 distinct seeds"):
        over_seeds([rows[0], rows[0], rows[1]])
    other = account(record(policy="q", serving=[Serving("a", 0.0)]))
    with pytest.raises(ValueError, match="per policy"):
        over_seeds([*rows, other])


def test_a_record_that_makes_no_sense_is_refused() -> None:
    with pytest.raises(ValueError, match="end after its launch"):
        record(end=0.0)
    with pytest.raises(ValueError, match="ends .* before it starts"):
        record(serving=[Serving("a", 10.0, 5.0)])


def test_a_day_of_the_stress_rate_on_64_engines_is_counted_exactly_in_under_two_seconds() -> None:
    # The clock's schedule feeds the ledger: each struck engine restarted 1 s after its fault and
    # serving again 100 s after it (a later fault inside that window extends it). Every restart
    # is backed, no figure is negative, and capacity lost is each engine's union of down windows.
    import time

    from vime.harness.fault_clock import STRESS_MTBF_S, FaultClock
    day = 24 * 3600.0
    faults = FaultClock(seed=11, engines=64, duration_s=day, mtbf_s=STRESS_MTBF_S).schedule()
    assert len(faults) > 1000
    down_until: dict[int, float] = {}
    serving, restarts, injections = [], [], []
    up_from = {e: 0.0 for e in range(64)}
    for f in faults:
        injections.append(Injection(f.at_s, f.kind, tuple(f"e{e}" for e in f.engines)))
        for e in f.engines:
            if f.at_s >= down_until.get(e, 0.0):        # serving until now
                serving.append(Serving(f"e{e}", up_from[e], f.at_s))
            restarts.append(Restart(f.at_s + 1.0, f"e{e}", "exit"))
            down_until[e] = f.at_s + 100.0
            up_from[e] = down_until[e]
    serving += [Serving(f"e{e}", up_from[e]) for e in range(64) if up_from[e] < day]
    rec = record(target=64, end=day, injections=injections, serving=serving, restarts=restarts)
    t = time.perf_counter()
    g = account(rec)
    assert time.perf_counter() - t < 2.0
    struck = sum(len(f.engines) for f in faults)
    assert g.failures == len(faults) and g.false_restarts == 0 and g.unanswered == []
    windows: dict[int, list[float]] = {}
    for f in faults:
        for e in f.engines:
            windows.setdefault(e, []).append(f.at_s)
    union = 0.0
    for ats in windows.values():
        end = float("-inf")
        for a in ats:                   # sorted: the schedule is in time order
            b = min(a + 100.0, day)
            union += b - max(a, end) if b > end else 0.0
            end = max(end, b)
    assert g.time_to_start_s == 0.0 and g.capacity_lost_s == pytest.approx(union)
    assert union < 100.0 * struck
    assert g.on_down > 0        # at this rate some fault lands on an engine still down
    assert all(r is None or r >= 0 for r in g.recover_s)


def test_work_start_sets_the_wall_of_ettr_and_useful_tokens_and_keeps_the_time_to_start() -> None:
    g = account(record(serving=[Serving("a", 10.0), Serving("b", 20.0)], work_start=20.0, tokens_generated=800),
                fault_free_s=60.0)
    assert g.wall_s == 80.0 and g.ettr == pytest.approx(0.75) and g.useful_tps == pytest.approx(10.0)
    assert g.time_to_start_s == 20.0
    with pytest.raises(ValueError, match="work_start"):
        record(work_start=100.0)


def test_a_smoke_run_may_spread_over_fewer_seeds_when_asked() -> None:
    one = account(record(serving=[Serving("a", 0.0), Serving("b", 0.0)]))
    sp = over_seeds([one], min_seeds=1)
    assert sp["capacity_lost_s"] is not None and sp["capacity_lost_s"].n == 1
    with pytest.raises(ValueError, match="at least 3"):
        over_seeds([one])
