"""bench/fleet_soak.py's pure parts: the faults of a long run (the fleet's draw, the daemon's kills
on a clock of their own), the per-window figures, the verdict and its exit status, the flags;
and the daemon's config with the soak's retention (written, no engine started)."""

from __future__ import annotations

import math
import tomllib

import pytest

from support.bench_scripts import load_bench
from vime.harness import growth
from vime.harness.fault_clock import STRESS_MTBF_S
from vime.harness.goodput_ledger import Ledger
from vime.harness.soak import HOURS_RETENTION, retention_limits


@pytest.fixture(scope="module")
def soak():
    return load_bench("fleet_soak")


def test_the_daemon_is_killed_by_its_own_clock_and_the_fleet_by_fault_clock(soak):
    kw = dict(seed=3, engines=256, hours=2.0, mtbf_s=STRESS_MTBF_S, scale=1.0, daemon_every_min=30.0)
    sched = soak.soak_schedule(**kw)
    assert sched == soak.soak_schedule(**kw)  # the same arguments, the same faults
    assert [f.seq for f in sched] == list(range(len(sched)))
    assert [f.at_s for f in sched] == sorted(f.at_s for f in sched)
    daemon = [f for f in sched if f.kind == "daemon"]
    fleet = [f for f in sched if f.kind != "daemon"]
    assert all(f.engines == () for f in daemon)
    assert all(f.engines and max(f.engines) < 256 for f in fleet)
    # 256 engines at one fault per engine-hour, over 1.5 x 2 h of engine time: ~768 faults of
    # every kind but the daemon's; the daemon's kills a mean of 30 min apart: ~6.
    assert {f.kind for f in fleet} == {"kill", "hang", "push", "crash-start", "node"}
    assert 650 < len(fleet) < 890
    assert 1 <= len(daemon) <= 16
    assert all(len(f.engines) == 8 for f in fleet if f.kind == "node")


def test_the_daemon_clock_is_wall_minutes_whatever_the_scale(soak):
    gaps = []
    for seed in range(40):
        d = [f.wall_s(0.2) for f in soak.soak_schedule(seed=seed, engines=8, hours=10.0, mtbf_s=STRESS_MTBF_S,
                                                        scale=0.2, daemon_every_min=30.0, margin=1.0)
             if f.kind == "daemon"]
        gaps += [b - a for a, b in zip([0.0, *d], d)]
    assert 25 * 60 < sum(gaps) / len(gaps) < 35 * 60


def test_faults_per_hour_counts_the_run_s_hours_only(soak):
    sched = soak.soak_schedule(seed=1, engines=64, hours=1.0, mtbf_s=STRESS_MTBF_S, scale=0.5,
                               daemon_every_min=30.0)
    per_h = soak.faults_per_hour(sched, 0.5, 1.0)
    assert sum(per_h.values()) == sum(1 for f in sched if f.wall_s(0.5) < 3600.0)
    assert sum(per_h.values()) < len(sched)  # the margin's faults past the hour are not counted


def test_window_quantiles_count_what_was_gained_between_reads(soak):
    inf = math.inf
    prev = {0.01: 100.0, 0.1: 100.0, inf: 100.0}
    now = {0.01: 100.0, 0.1: 150.0, inf: 160.0}  # 60 more: 50 under 0.1 s, 10 above
    assert soak.window_quantile(prev, now, 0.5) == 0.1
    assert soak.window_quantile(prev, now, 0.99) == inf
    assert soak.window_quantile(now, now) is None
    le = [0.001, 0.01]
    totals = soak.delay_totals({("e0", 1): (le, [5, 0, 0]), ("e1", 2): (le, [5, 1, 0])})
    assert totals == (le, [10, 1, 0])
    assert soak.window_delay([10, 0, 0], totals) == 0.01
    assert soak.window_delay([10, 1, 0], totals) is None
    assert soak.window_delay([], (le, [0, 0, 3])) == inf


def test_cpu_delta_counts_new_processes_whole_and_gone_ones_not(soak):
    assert soak.cpu_delta({1: 2.0, 2: 5.0}, {1: 3.5, 3: 0.25}) == pytest.approx(1.75)
    assert soak.cpu_delta({1: 2.0}, {1: 1.0}) == 0.0  # a reused pid that started again


def test_headroom_is_median_and_range_per_field(soak):
    h = soak.headroom([{"host_cores": 1.0, "routable": 8}, {"host_cores": 2.0}, {"host_cores": 1.5, "routable": 6}])
    assert h["host_cores"] == {"median": 1.5, "max": 2.0, "min": 1.0, "n": 3.0}
    assert h["routable"]["median"] == 7.0
    assert h["daemon_cores"]["median"] is None


def _ledger(**kw):
    base = dict(policy="everything-on", seed=0, wall_s=100.0, ettr=None, useful_tps=1.0, time_to_start_s=1.0,
                recover_s=(), failures=0, on_down=0, capacity_lost_s=0.0, tokens_lost=0, rounds=3, rounds_lost=0,
                stale_samples=0, false_restarts=0, spare_exhaustions=0)
    return Ledger(**{**base, **kw})


def _growth(spread_se: float = 0.1):
    samples = [{"t": 60.0 * i, "daemon_pid": 7, "daemon_started": 0.0, "daemon_rss": 50 * growth.MIB,
                "daemon_fds": 20, "daemon_threads": 6, "loop_lag_ms": 1.0, "journal_bytes": 1000,
                "daemon_log_bytes": 1000 * i, "engines_rss": 100 * growth.MIB, "engine_logs_bytes": 0,
                "incidents_bytes": 0, "log_bytes": 0, "engine_log_files_max": 1, "engine_old_logs_bytes_max": 0,
                "incident_dirs": 0} for i in range(40)]
    rep = growth.report(samples, warmup_s=0.0, limits=HOURS_RETENTION, start=0.0)
    for r in rep["quantities"]:
        if r["key"] == "loop_lag_ms":
            r["se per h"], r["slope per h"] = spread_se, 0.0
    return rep


def test_verdict_passes_a_clean_run_and_says_why_otherwise(soak):
    ok = soak.verdict(growth_rep=_growth(), ledger=_ledger(), invalid=None, problems=[], error=None)
    assert (ok.code, ok.failed, ok.not_passed, ok.word) == (0, [], [], "passed")

    wide = soak.verdict(growth_rep=_growth(spread_se=6.0), ledger=_ledger(), invalid=None, problems=[], error=None)
    assert wide.code == soak.EXIT_NOT_PASSED and "loop lag" in wide.not_passed[0]

    slow = soak.verdict(growth_rep=_growth(), ledger=_ledger(), invalid="lag above the bound", problems=[], error=None)
    assert slow.code == soak.EXIT_NOT_PASSED and slow.word == "NOT PASSED"

    stale = soak.verdict(growth_rep=_growth(), ledger=_ledger(stale_samples=2), invalid="x", problems=[], error=None)
    assert stale.code == soak.EXIT_FAILED  # failed over not passed
    assert stale.failed == ["stale_samples = 2 (must be 0)"]

    false = soak.verdict(growth_rep=_growth(), ledger=_ledger(false_restarts=1), invalid=None, problems=[], error=None)
    assert false.code == soak.EXIT_FAILED

    rep = _growth()
    rep["ok"] = False
    rep["quantities"][0].update(ok=False, verdict="GROWS: +9 MiB/h > 4")
    grew = soak.verdict(growth_rep=rep, ledger=_ledger(), invalid=None, problems=[], error=None)
    assert grew.code == soak.EXIT_FAILED and "GROWS" in grew.failed[0]

    broke = soak.verdict(growth_rep=None, ledger=None, invalid=None, problems=[], error="RuntimeError: x")
    assert broke.code == soak.EXIT_FAILED and len(broke.failed) == 3

    trouble = soak.verdict(growth_rep=_growth(), ledger=_ledger(), invalid=None, problems=["inject: boom"], error=None)
    assert trouble.code == soak.EXIT_FAILED


@pytest.mark.parametrize("argv, said", [
    (["--mtbf", "10"], "--mtbf must be a finite number of engine seconds, at least 60"),
    (["--hours", "0"], "--hours must be a finite number > 0"),
    (["--time-scale", "nan"], "--time-scale must be a finite number > 0"),
    (["--daemon-every", "-1"], "--daemon-every must be a finite number > 0"),
    (["--hours", "0.01"], "fewer than 3 samples"),
    (["--engines", "4", "--spares", "5"], "--spares must be between 0 and --engines"),
])
def test_flags_refused_with_what_to_pass(soak, tmp_path, capsys, argv, said):
    with pytest.raises(SystemExit) as ei:
        soak.parse([*argv, "--out", str(tmp_path / "new")])
    assert ei.value.code == 2
    assert said in capsys.readouterr().err


def test_an_out_folder_with_a_run_in_it_is_refused(soak, tmp_path, capsys):
    (tmp_path / "samples.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit):
        soak.parse(["--out", str(tmp_path)])
    assert "is not an empty folder" in capsys.readouterr().err
    a = soak.parse(["--out", str(tmp_path / "new")])
    assert (a.engines, a.hours, a.mtbf, a.time_scale) == (256, 2.0, STRESS_MTBF_S, soak.DEFAULT_SCALE)


def test_the_policy_is_goodput_s_with_its_spares_sized(soak):
    w = soak.soak_workload(256, 1.0, 1.0)
    pol = soak.soak_policy("everything-on", 256, STRESS_MTBF_S, w, None)
    assert pol.spares == 14 and pol.restart_immediately and pol.faults  # 256 x 110 s / 3600 s down: 7.8 + 2 sd
    assert soak.soak_policy("defaults", 256, STRESS_MTBF_S, w, 3).spares == 0
    with pytest.raises(ValueError, match="unknown policy 'fault-free'"):
        soak.soak_policy("fault-free", 256, STRESS_MTBF_S, w, None)


def test_the_daemon_config_keeps_the_soak_s_retention(soak, tmp_path):
    w = soak.soak_workload(2, 1.0, 1.0)
    pol = soak.soak_policy("defaults", 2, STRESS_MTBF_S, w, None)
    run = soak.SoakRun(w, pol, [], 0, tmp_path / "fleet", out=tmp_path, hours=1.0, sample_every=60.0)
    (tmp_path / "fleet").mkdir()
    cfg = run._config()
    doc = tomllib.loads(cfg.read_text())
    assert retention_limits(cfg) == HOURS_RETENTION
    assert [e["name"] for e in doc["engines"]] == ["e0", "e1"]
    assert doc["health_check"]["interval"] == 10.0  # the daemon's timings scaled (1.0) as FleetRun writes them


def test_an_unknown_policy_is_refused_naming_the_flag(soak, capsys, tmp_path) -> None:
    assert soak.main(["--policy", "bogus", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("--policy: unknown policy 'bogus'") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
