"""bench/recovery.py's pure part: phases() splits a kill -> routable from the daemon's recorded
transitions, and reports a phase its log does not show as NaN instead of failing the run."""

from __future__ import annotations

import math
from datetime import datetime, timezone

import pytest

from support.bench_scripts import load_bench



@pytest.fixture(scope="module")
def recovery():
    return load_bench("recovery", siblings=True)


T0 = 1_800_000_000.0


def at(t: float) -> str:
    return datetime.fromtimestamp(T0 + t, timezone.utc).isoformat().replace("+00:00", "Z")


def tr(t: float, engine: str, frm: str, to: str) -> dict:
    return {"event": "engine.transition", "engine": engine, "from_state": frm, "to_state": to, "timestamp": at(t)}


RESTART = [  # kill at 0: the victim restarts, boots, warms up, syncs to v1
    tr(0.3, "e0", "RUNNING", "EXITED"),
    tr(1.3, "e0", "EXITED", "STARTING"),
    {"event": "engine.warmup", "engine": "e0", "timestamp": at(21.3)},
    tr(23.3, "e0", "STARTING", "STALE"),
    tr(24.3, "e0", "STALE", "SYNCING"),
    tr(26.3, "e0", "SYNCING", "RUNNING"),
]


def test_a_restart_splits_into_every_phase(recovery):
    got = recovery.phases(RESTART, "e0", T0, T0 + 26.5)
    want = {"detect": 0.3, "clean-up": 1.0, "boot": 20.0, "warm-up": 2.0, "until sync": 1.0,
            "sync + verify": 2.0, "until routable": 0.2}
    assert got.keys() == want.keys()
    assert all(got[k] == pytest.approx(v, abs=1e-3) for k, v in want.items()), got


def test_a_promoted_spare_skips_the_boot(recovery):
    events = [tr(0.2, "e0", "RUNNING", "EXITED"), tr(0.25, "e1", "STANDBY", "STALE"),
              tr(0.3, "e1", "STALE", "SYNCING"), tr(0.9, "e1", "SYNCING", "RUNNING"),
              tr(1.0, "e0", "EXITED", "STARTING")]  # the victim's restart: after, not counted
    got = recovery.phases(events, "e0", T0, T0 + 1.0)
    assert [round(got[p], 3) for p in recovery.PHASES] == [0.2, 0.0, 0.0, 0.0, 0.05, 0.6, 0.1]


def test_a_log_that_lags_the_routable_list_gives_nan_not_stopiteration(recovery):
    """The issue's crash: the routable list showed the engine back before the harness's copy of
    the log held its RUNNING transition."""
    got = recovery.phases(RESTART[:-1], "e0", T0, T0 + 26.5)
    assert got["detect"] == pytest.approx(0.3)
    assert all(math.isnan(got[p]) for p in recovery.PHASES[1:]), got
    nothing = recovery.phases([], "e0", T0, T0 + 1)
    assert all(math.isnan(v) for v in nothing.values())


def test_medians_skip_the_unknown(recovery):
    assert recovery.med([1.0, math.nan, 3.0]) == 2.0
    assert math.isnan(recovery.med([math.nan]))
