"""bench/goodput.py's pure parts around its runs: the plan its flags give, the table's rows over
the valid runs, the must-be-zero rule (and a mutation that must break it), and the per-bucket
histograms a run's JSON keeps."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from vime.harness.fleet_plan import per_bucket
from vime.harness.goodput_ledger import Ledger

PATH = Path(__file__).resolve().parents[2] / "bench" / "goodput.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(PATH.parent))
    try:
        spec = importlib.util.spec_from_file_location("bench_goodput_main", PATH)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(PATH.parent))


def ledger(policy: str, seed: int, *, ettr: float = 1.0, stale: int = 0, false_restarts: int = 0) -> Ledger:
    return Ledger(policy=policy, seed=seed, wall_s=10.0, ettr=ettr, useful_tps=100.0, time_to_start_s=1.0,
                  recover_s=(), failures=0, on_down=0, capacity_lost_s=0.0, tokens_lost=0, rounds=4, rounds_lost=0,
                  stale_samples=stale, false_restarts=false_restarts, spare_exhaustions=0)


def test_the_plan_puts_fault_free_first_and_refuses_an_unknown_policy(bench):
    plan = bench.plan_of(bench.parse(["--only", "slime,everything-on", "--engines", "8", "--seeds", "2"]))
    assert plan.names == ["fault-free", "slime", "everything-on"]
    assert plan.w.engines == 8 and plan.seeds == [0, 1]
    assert plan.spares == bench.sized_spares(8, plan.mtbf, plan.w.restart_s)
    with pytest.raises(ValueError, match="unknown policies"):
        bench.plan_of(bench.parse(["--only", "slime,nope"]))
    mutation = bench.plan_of(bench.parse(["--quick", "--mutation", "stale"]))
    assert mutation.names == ["defaults"] and mutation.pols["defaults"].faults is False


def test_rows_are_over_the_valid_runs_and_reported_only_with_enough_of_them(bench):
    got = {"slime": [(ledger("slime", 0, ettr=0.9), True), (ledger("slime", 1, ettr=0.1), False),
                     (ledger("slime", 2, ettr=0.7), True)],
           "defaults": [(ledger("defaults", 0, ettr=0.5), False)]}
    rows, figures = bench.summary(got)
    assert rows["slime"]["runs"] == "2/3 valid"
    assert (rows["slime"]["spread"]["ettr"].lo, rows["slime"]["spread"]["ettr"].hi) == (0.7, 0.9)
    assert figures["slime"]["reported"] is False  # 2 valid runs: fewer than MIN_SEEDS
    # all invalid: the row shows them (marked 0/1 valid), the JSON does not report them
    assert rows["defaults"]["runs"] == "0/1 valid" and rows["defaults"]["spread"]["ettr"].median == 0.5
    assert figures["defaults"]["reported"] is False


def test_must_be_zero_outside_a_mutation_and_non_zero_in_one(bench):
    clean = {"defaults": [(ledger("defaults", 0), True)]}
    assert bench.must_be_zero(clean, None) == ([], [])
    stale = {"defaults": [(ledger("defaults", 0, stale=3), True)]}
    bad, _ = bench.must_be_zero(stale, None)
    assert bad == ["defaults seed 0: stale_samples = 3 (must be 0)"]
    bad, caught = bench.must_be_zero(stale, "stale")
    assert bad == [] and caught == ["mutation stale caught: stale_samples = 3 (seed 0)"]
    bad, caught = bench.must_be_zero(clean, "false-restart")
    assert caught == [] and bad == ["mutation false-restart: false_restarts is 0 in seed 0: the mutation was not caught"]


def test_per_bucket_turns_a_cumulative_histogram_into_counts(bench):
    inf = float("inf")
    assert per_bucket({0.01: 5.0, 0.05: 5.0, 0.1: 9.0, inf: 10.0}) == {"0.01": 5.0, "0.1": 4.0, "inf": 1.0}
    assert per_bucket({}) == {}


def test_the_daemon_gets_the_policys_weights_mode_and_only_sync_runs():
    from vime.harness.fleet_plan import Policy, Workload, daemon_tables

    assert daemon_tables(Workload(engines=2), Policy("defaults"))["weights"] == {"mode": "sync"}
    with pytest.raises(ValueError, match="sync mode only"):
        Policy("async", weights_mode="async")
