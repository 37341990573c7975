"""harness/fleet_plan.py, the emulated fleet run's pure part: the same work for every policy of a
seed, the daemon's timings scaled with their floors, the validity rule, serving intervals from
observations, and restarts with the cause of the fall before them."""

from __future__ import annotations

import pytest

from vime.harness.fleet_plan import (Observed, Policy, Workload, daemon_tables, histogram_quantile, intervals_of, invalid,
                                     lag_histogram, policies,
                                     restarts_from, round_lengths, serving_intervals, spares_for)
from vime.harness.goodput_ledger import Restart, Serving


def test_each_round_has_one_long_tail_and_the_same_work_for_a_seed() -> None:
    w = Workload(engines=4, samples_per_engine=3, median_tokens=20, tail_tokens=300)
    a = round_lengths(7, 2, w)
    assert a == round_lengths(7, 2, w) and a != round_lengths(8, 2, w)
    assert len(a) == 12 and a.count(300) == 1 and max(x for x in a if x != 300) <= 150


def test_daemon_timings_are_scaled_with_floors_and_the_policy_switches() -> None:
    w = Workload(scale=0.01)
    t = daemon_tables(w, policies(3)["everything-on"], overrides={("health_check", "max_busy"): 0.05})
    assert t["health_check"]["interval"] == 0.5        # 10 s x 0.01 = 0.1, floored
    assert t["health_check"]["first_wait"] == 60.0      # floored: Python start-ups are not scaled
    assert t["supervisor"]["sync_timeout"] == 3.0       # 300 s x 0.01
    assert t["health_check"]["max_busy"] == 0.05
    assert t["supervisor"]["spares"] == 3 and t["supervisor"]["admit_mid_round"] is True
    assert daemon_tables(w, Policy("x"))["supervisor"]["spares"] == 0


def test_spares_cover_the_engines_down_at_once_with_room() -> None:
    assert spares_for(64, 3600.0, 110.0) == 5      # 1.96 down on average + 2 sd
    assert spares_for(8, 86400.0, 110.0) == 1


def test_a_run_is_invalid_when_the_loop_lag_passes_a_share_of_the_smallest_interval() -> None:
    w = Workload(scale=0.05)
    iv = intervals_of(w, daemon_tables(w, Policy("x")), 0.006, 7e-5)
    name, smallest = min(iv.items(), key=lambda kv: kv[1])
    assert invalid(iv, 0.09 * smallest, 0.0) is None
    why = invalid(iv, 0.0, 0.2 * smallest)
    assert why is not None and "scheduling delay" in why and name in why


def test_serving_intervals_from_observations() -> None:
    obs = {"a": Observed([(0.0, False, False), (1.0, True, False), (2.0, False, True), (3.0, True, False)]),
           "b": Observed([(0.0, True, False), (1.0, True, False)])}
    assert serving_intervals(obs) == [Serving("a", 1.0, 2.0), Serving("a", 3.0, None), Serving("b", 0.0, None)]
    assert serving_intervals(obs, spare=True) == [Serving("a", 2.0, 3.0)]


def test_restarts_carry_the_cause_of_the_fall_before_them() -> None:
    def tr(t: float, e: str, to: str, cause: str) -> dict:
        return {"event": "engine.transition", "engine": e, "to_state": to, "cause": cause, "t": t}
    events = [tr(1, "a", "STARTING", "start"), tr(2, "a", "RUNNING", "ready"), tr(3, "a", "UNHEALTHY", "busy"),
              tr(4, "a", "EXITED", "exit"), tr(5, "a", "STARTING", "restart"), tr(6, "a", "BACKOFF", "start_failed"),
              tr(7, "a", "STARTING", "retry"), {"event": "other"}]
    assert restarts_from(events, lambda ev: ev["t"]) == [Restart(5, "a", "busy"), Restart(7, "a", "start_failed")]
    events[2]["reason"] = "hung: busy for 3s without progress"
    assert restarts_from(events, lambda ev: ev["t"])[0].cause == "busy (hung: busy for 3s without progress)"


def test_a_workload_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="tail_tokens"):
        Workload(median_tokens=100, tail_tokens=10)
    with pytest.raises(ValueError, match="scale"):
        Workload(scale=0)


def test_the_daemons_loop_lag_quantile_from_its_metrics() -> None:
    text = ('# TYPE vime_event_loop_lag_seconds histogram\n'
            'vime_event_loop_lag_seconds_bucket{le="0.001"} 90.0\n'
            'vime_event_loop_lag_seconds_bucket{le="0.01"} 99.0\n'
            'vime_event_loop_lag_seconds_bucket{le="0.1"} 100.0\n'
            'vime_event_loop_lag_seconds_bucket{le="+Inf"} 100.0\n'
            'vime_event_loop_lag_seconds_count 100.0\n')
    h = lag_histogram(text)
    assert h == {0.001: 90.0, 0.01: 99.0, 0.1: 100.0, float("inf"): 100.0}
    assert histogram_quantile(h, 0.99) == 0.01 and histogram_quantile(h, 0.5) == 0.001
    assert histogram_quantile(h, 1.0) == 0.1 and histogram_quantile({}, 0.99) == 0.0
