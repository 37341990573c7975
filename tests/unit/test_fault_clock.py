"""harness/fault_clock.py: the seeded Poisson schedule of faults (issue 36)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vime.harness.fault_clock import (DEFAULT_WEIGHTS, HEADLINE_MTBF_S, STRESS_MTBF_S, FaultClock,
                                      ScheduledFault)


def test_the_two_rates_are_one_fault_per_engine_day_and_per_engine_hour() -> None:
    assert HEADLINE_MTBF_S == 86400.0 and STRESS_MTBF_S == 3600.0
    assert FaultClock(seed=0, engines=64, duration_s=1.0, mtbf_s=STRESS_MTBF_S).rate_per_s == 64 / 3600


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    a = FaultClock(seed=7, engines=64, duration_s=4 * 3600, mtbf_s=STRESS_MTBF_S).schedule()
    b = FaultClock(seed=7, engines=64, duration_s=4 * 3600, mtbf_s=STRESS_MTBF_S).schedule()
    c = FaultClock(seed=8, engines=64, duration_s=4 * 3600, mtbf_s=STRESS_MTBF_S).schedule()
    assert len(a) > 100 and a == b
    assert a != c


def test_the_time_scale_stretches_the_schedule_without_changing_the_draw() -> None:
    one = FaultClock(seed=3, engines=8, duration_s=3600, mtbf_s=600)
    fast = FaultClock(seed=3, engines=8, duration_s=3600, mtbf_s=600, scale=0.01)
    assert one.schedule() == fast.schedule()
    f = fast.schedule()[0]
    assert f.wall_s(fast.scale) == pytest.approx(f.at_s * 0.01)


def test_faults_overlap_with_no_gate_and_strike_what_their_kind_says() -> None:
    faults = FaultClock(seed=1, engines=20, duration_s=10 * 3600, mtbf_s=600, node_size=8).schedule()
    times = [f.at_s for f in faults]
    assert times == sorted(times) and all(0 < t < 10 * 3600 for t in times)
    assert [f.seq for f in faults] == list(range(len(faults)))
    kinds = {f.kind for f in faults}
    assert kinds == set(DEFAULT_WEIGHTS)
    for f in faults:
        if f.kind == "daemon":
            assert f.engines == ()
        elif f.kind == "node":
            assert f.engines in (tuple(range(0, 8)), tuple(range(8, 16)), (16, 17, 18, 19))
        else:
            assert len(f.engines) == 1 and 0 <= f.engines[0] < 20
    # No gate: some engine is struck again well inside a GPU restart (90 s) of its last fault.
    last: dict[int, float] = {}
    close = 0
    for f in faults:
        for e in f.engines:
            close += e in last and f.at_s - last[e] < 90
            last[e] = f.at_s
    assert close > 0


def test_weights_pick_the_kinds_and_zero_weight_kinds_never_come() -> None:
    faults = FaultClock(seed=5, engines=64, duration_s=100 * 3600, mtbf_s=STRESS_MTBF_S,
                        weights={"kill": 3.0, "hang": 1.0, "push": 0.0}).schedule()
    n = Counter(f.kind for f in faults)
    assert set(n) == {"kill", "hang"}
    share = n["kill"] / len(faults)
    sd = math.sqrt(0.75 * 0.25 / len(faults))
    assert abs(share - 0.75) < 5 * sd


@pytest.mark.parametrize("kw, words", [
    ({"engines": 0}, "engines must be at least 1"),
    ({"mtbf_s": 0}, "mtbf_s must be > 0"),
    ({"duration_s": -1}, "duration_s must be >= 0"),
    ({"scale": 0}, "scale must be > 0"),
    ({"weights": {"oom": 1.0}}, "unknown fault kinds ['oom']"),
    ({"weights": {"kill": 0.0}}, "positive sum"),
])
def test_bad_arguments_say_what_is_wrong(kw: dict, words: str) -> None:
    args = {"seed": 0, "engines": 4, "duration_s": 10.0, **kw}
    with pytest.raises(ValueError) as e:
        FaultClock(**args)
    assert words in str(e.value)


@settings(max_examples=25, derandomize=True, deadline=None)
@given(seed=st.integers(0, 2**32), engines=st.sampled_from([8, 64, 256]),
       mtbf_s=st.sampled_from([STRESS_MTBF_S, 6 * 3600.0, HEADLINE_MTBF_S]))
def test_the_fault_count_is_poisson_at_the_rate_asked(seed: int, engines: int, mtbf_s: float) -> None:
    # A long draw: about 2000 faults expected; a Poisson count lies within 5 sd of its mean
    # except with probability below 1e-6.
    duration = 2000 * mtbf_s / engines
    faults: list[ScheduledFault] = FaultClock(seed=seed, engines=engines, duration_s=duration,
                                              mtbf_s=mtbf_s).schedule()
    expected = engines / mtbf_s * duration
    assert abs(len(faults) - expected) < 5 * math.sqrt(expected)
    # Inter-arrival times exponential: mean 1/rate, and the coefficient of variation near 1.
    gaps = [b.at_s - a.at_s for a, b in zip(faults, faults[1:])]
    mean = sum(gaps) / len(gaps)
    assert abs(mean * engines / mtbf_s - 1) < 5 / math.sqrt(len(gaps))
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert 0.8 < sd / mean < 1.2
