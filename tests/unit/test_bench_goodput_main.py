"""bench/goodput.py's pure parts around its runs: the plan its flags give, the table's rows over
the valid runs, the must-be-zero rule (and a mutation that must break it), and the per-bucket
histograms a run's JSON keeps."""

from __future__ import annotations

import pytest

from vime.harness.fleet_plan import per_bucket
from vime.harness.goodput_ledger import Ledger

from support.bench_scripts import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("goodput", siblings=True)


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


def test_an_invalid_fault_free_run_leaves_its_seeds_ettrs_out(bench, monkeypatch, tmp_path, capsys):
    """ETTR is against the seed's fault-free run: when that run is invalid (an overloaded
    host), every other policy's ETTR of the seed is None and said to be left out, while their
    own validity (and their other figures) stand; a seed with a valid baseline keeps its ETTR."""
    from types import SimpleNamespace

    from vime.harness.goodput_ledger import RunRecord

    walls = {"fault-free": 10.0, "slime": 20.0}

    def run(w, pol, schedule, seed, tmp, **kw):
        name = "fault-free" if not pol.faults else "slime"
        invalid = "loop lag p99 0.9 s > 0.1 x 2 s" if (name, seed) == ("fault-free", 0) else None
        record = RunRecord(policy=name, seed=seed, target=1, launched_at=0.0, end=walls[name], injections=(),
                           serving=())
        return SimpleNamespace(record=record, invalid=invalid, problems=[], lag_p99_s=0.0, delay_p99_s=0.0,
                               lag_hist={}, delay_hist={}, intervals={}, daemon_config={}, faults_injected=[])

    monkeypatch.setattr(bench.fleet_run, "run", run)
    a = bench.parse(["--quick", "--only", "slime", "--seeds", "2", "--out", str(tmp_path / "g.json")])
    b = bench.Bench(a, bench.plan_of(a), {"runs": []})
    b.seed(0)
    b.seed(1)
    (ff0, ok_ff0), (ff1, _) = b.ledgers["fault-free"]
    (s0, ok_s0), (s1, ok_s1) = b.ledgers["slime"]
    assert not ok_ff0 and ok_s0 and ok_s1  # the baseline's invalidity is its own, not slime's
    assert s0.ettr is None and s0.useful_tps == s1.useful_tps  # left out; the other figures stand
    assert s1.ettr == 0.5  # against seed 1's valid fault-free run
    slime0 = next(r for r in b.doc["runs"] if (r["policy"], r["seed"]) == ("slime", 0))
    assert slime0["ettr_invalid"] == "the fault-free run of seed 0 is invalid (loop lag p99 0.9 s > 0.1 x 2 s)"
    assert "ETTR not reported: the fault-free run of seed 0 is invalid" in capsys.readouterr().out
    _, figures = bench.summary(b.ledgers)
    assert figures["slime"]["ettr_reported"] is False  # one seed's ETTR: fewer than MIN_SEEDS
