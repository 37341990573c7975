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


def test_the_daemon_gets_the_policys_weights_mode_and_its_bound():
    from vime.harness.fleet_plan import Policy, Workload, daemon_tables

    assert daemon_tables(Workload(engines=2), Policy("defaults"))["weights"] == {"mode": "sync"}
    assert daemon_tables(Workload(engines=2), Policy("d", weights_mode="async", max_staleness=2))["weights"] == {
        "mode": "async", "max_staleness": 2}
    for bad, said in [({"weights_mode": "fast"}, "the bench runs sync or async"),
                      ({"max_staleness": -1}, "max_staleness must be a whole number"),
                      ({"max_staleness": 1.5}, "max_staleness must be a whole number"),
                      ({"serving_fraction": 1.0}, "serving_fraction must be in")]:
        with pytest.raises(ValueError, match=said):
            Policy("p", **bad)


def test_the_async_rows_are_the_sync_policies_in_async_mode_and_slime_has_none():
    from dataclasses import replace

    from vime.harness.fleet_plan import baseline_of, policies

    sync, asy, both = policies(3), policies(3, "async"), policies(3, "both")
    assert list(sync) == ["fault-free", "slime", "defaults", "everything-on"]
    assert list(asy) == ["fault-free-async", "defaults-async", "everything-on-async"]
    assert list(both) == [*sync, *asy]
    for name, p in asy.items():
        base = sync[name.removesuffix("-async")]
        assert p == replace(base, name=name, weights_mode="async") and p.max_staleness == 1
        assert baseline_of(p) == "fault-free-async" and baseline_of(base) == "fault-free"
    assert asy["everything-on-async"].spares == 3 and asy["everything-on-async"].spares_sync == "publish"
    with pytest.raises(ValueError, match="weights must be sync, async or both"):
        policies(1, "all")


def test_the_weights_flag_picks_the_rows_each_after_its_baselines(bench, capsys):
    names = bench.plan_of(bench.parse(["--quick", "--weights", "both"])).names
    assert names == ["fault-free", "slime", "defaults", "everything-on", "fault-free-async", "defaults-async",
                     "everything-on-async"]
    # async alone still runs the sync fault-free run: the async rows' wall time is set against it
    plan = bench.plan_of(bench.parse(["--quick", "--weights", "async", "--only", "everything-on-async"]))
    assert plan.names == ["fault-free", "fault-free-async", "everything-on-async"]
    assert [plan.pols[n].weights_mode for n in plan.names] == ["sync", "async", "async"]
    with pytest.raises(ValueError, match="defaults-async is of the other weights mode: pass --weights async or both"):
        bench.plan_of(bench.parse(["--only", "defaults-async"]))
    with pytest.raises(ValueError, match="slime is of the other weights mode: pass --weights sync or both"):
        bench.plan_of(bench.parse(["--weights", "async", "--only", "slime"]))
    mutation = bench.plan_of(bench.parse(["--quick", "--weights", "async", "--mutation", "stale"]))
    assert mutation.names == ["defaults-async"] and not mutation.pols["defaults-async"].faults
    assert mutation.pols["defaults-async"].is_async
    with pytest.raises(SystemExit) as ei:
        bench.parse(["--mutation", "stale", "--weights", "both"])
    assert ei.value.code == 2 and "pick its weights mode" in capsys.readouterr().err


def test_the_stale_regen_column_shows_only_with_async_rows(bench):
    from vime.harness.fleet_plan import policies

    assert "stale_regenerated" not in [c for c, _, _ in bench.columns_for(policies(1))]
    cols = bench.columns_for(policies(1, "both"))
    assert [c for c, _, _ in cols] == [c for c, _, _ in bench.COLUMNS]
    from dataclasses import replace

    rows, _ = bench.summary({"defaults-async": [(replace(ledger("defaults-async", 0), stale_regenerated=4), True)]})
    head, row = bench.table(rows, cols)
    assert head.endswith("stale regen") and row.split()[-1] == "4"


def test_async_rows_have_their_ettr_against_fault_free_async_and_their_wall_against_sync(bench, monkeypatch,
                                                                                           tmp_path, capsys):
    from types import SimpleNamespace

    from vime.harness.goodput_ledger import RunRecord

    walls = {"fault-free": 10.0, "fault-free-async": 6.0, "defaults-async": 8.0}

    def run(w, pol, schedule, seed, tmp, **kw):
        record = RunRecord(policy=pol.name, seed=seed, target=1, launched_at=0.0, end=walls[pol.name],
                           injections=(), serving=())
        return SimpleNamespace(record=record, invalid=None, problems=[], lag_p99_s=0.0, delay_p99_s=0.0,
                               lag_hist={}, delay_hist={}, intervals={}, daemon_config={}, faults_injected=[],
                               updates=[{"version": 2, "waves": 2}], samples_cut={"continued": 1})

    monkeypatch.setattr(bench.fleet_run, "run", run)
    a = bench.parse(["--quick", "--weights", "async", "--only", "defaults-async", "--out", str(tmp_path / "g.json")])
    b = bench.Bench(a, bench.plan_of(a), {"runs": []})
    b.seed(0)
    (ff, _), = b.ledgers["fault-free"]
    (ffa, _), = b.ledgers["fault-free-async"]
    (da, _), = b.ledgers["defaults-async"]
    assert (ff.ettr, ffa.ettr, da.ettr) == (1.0, 1.0, 0.75)
    assert b.vs_sync == {"fault-free-async": [(0.6, True)], "defaults-async": [(0.8, True)]}
    over = bench.overlap(b.vs_sync)
    assert over["defaults-async"]["runs"] == "1/1 valid" and over["defaults-async"]["spread"].median == 0.8
    run_doc = next(r for r in b.doc["runs"] if r["policy"] == "defaults-async")
    assert run_doc["weights_mode"] == "async" and run_doc["wall_vs_sync_fault_free"] == 0.8
    assert run_doc["updates"] == [{"version": 2, "waves": 2}] and run_doc["samples_cut"] == {"continued": 1}
    assert "stale regenerated 0, wall / sync fault-free 0.800" in capsys.readouterr().out
    # an async mutation runs no sync fault-free run: no wall time ratio to give
    a = bench.parse(["--quick", "--weights", "async", "--mutation", "stale", "--out", str(tmp_path / "m.json")])
    walls["defaults-async"] = 8.0
    m = bench.Bench(a, bench.plan_of(a), {"runs": []})
    m.seed(0)
    assert m.vs_sync == {} and m.ledgers["defaults-async"][0][0].ettr == 1.0
    out = capsys.readouterr().out
    assert "stale regenerated 0" in out and "wall / sync fault-free" not in out


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
                               lag_hist={}, delay_hist={}, intervals={}, daemon_config={}, faults_injected=[],
                               updates=[], samples_cut={})

    monkeypatch.setattr(bench.fleet_run, "run", run)
    a = bench.parse(["--quick", "--only", "slime", "--seeds", "2", "--out", str(tmp_path / "g.json")])
    b = bench.Bench(a, bench.plan_of(a), {"runs": []})
    b.seed(0)
    b.seed(1)
    (ff0, ok_ff0), (ff1, _) = b.ledgers["fault-free"]
    (s0, ok_s0), (s1, ok_s1) = b.ledgers["slime"]
    assert not ok_ff0 and ok_s0 and ok_s1  # the baseline's invalidity is its own, not slime's
    assert ff0.ettr == 1.0  # against itself, invalid or not
    assert s0.ettr is None and s0.useful_tps == s1.useful_tps  # left out; the other figures stand
    assert s1.ettr == 0.5  # against seed 1's valid fault-free run
    slime0 = next(r for r in b.doc["runs"] if (r["policy"], r["seed"]) == ("slime", 0))
    assert slime0["ettr_invalid"] == "the fault-free run of seed 0 is invalid (loop lag p99 0.9 s > 0.1 x 2 s)"
    assert "ETTR not reported: the fault-free run of seed 0 is invalid" in capsys.readouterr().out
    _, figures = bench.summary(b.ledgers)
    assert figures["slime"]["ettr_reported"] is False  # one seed's ETTR: fewer than MIN_SEEDS


def test_an_unknown_policy_is_refused_naming_the_flag(bench, capsys, tmp_path) -> None:
    assert bench.main(["--only", "bogus", "--out", str(tmp_path / "g.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("--only: unknown policies ['bogus']") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "g.json").exists()
