"""harness/fleet_validation.py, the pure part of the real-engine validation, with known inputs:
the calibration of the emulated timing from real figures, restart-to-ready from a run's record,
the ordering check of well-separated policy pairs, the 20 % check, and the seeds whose draw
fits a short run; and fleet_real's sample version and crash-at-start launcher."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vime.harness.fault_clock import FaultClock
from vime.harness.fleet_real import FAULT_ENV, LAUNCHER, sample_version
from vime.harness.fleet_validation import (Measured, boots_from_events, calibrate, fault_seeds, fit_step,
                                           in_engine_time, ordering, restart_to_ready, within)
from vime.harness.goodput_ledger import Restart, Serving
from vime.supervisor.engine.process import classify_failure
from vime.trainer.rollout_types import Split


def test_the_step_model_goes_through_both_measured_points() -> None:
    base, per_seq = fit_step(0.010, 0.017, 8)
    assert base == pytest.approx(0.009) and per_seq == pytest.approx(0.001)
    assert base + per_seq * 1 == pytest.approx(0.010) and base + per_seq * 8 == pytest.approx(0.017)
    # a batch measured faster than one sequence (noise): flat, never a negative slope
    assert fit_step(0.012, 0.011, 8) == (0.012, 0.0)
    with pytest.raises(ValueError, match="at least 2"):
        fit_step(0.01, 0.02, 1)


def test_boots_and_warm_ups_are_read_per_start_from_the_daemons_events() -> None:
    evs = [{"event": "engine.spawned", "engine": "e0", "t": 0.0},
           {"event": "engine.spawned", "engine": "e1", "t": 1.0},
           {"event": "engine.warmup", "engine": "e0", "t": 30.0},
           {"event": "engine.warmed_up", "engine": "e0", "t": 33.0},
           {"event": "engine.spawned", "engine": "e1", "t": 20.0},   # e1's first start never got to warm up
           {"event": "engine.warmup", "engine": "e1", "t": 55.0},
           {"event": "engine.warmed_up", "engine": "e1", "t": 56.5},
           {"event": "engine.warmup", "engine": "e0", "t": 90.0}]    # no spawn before it: not a start
    boots, warms = boots_from_events(evs, lambda ev: ev["t"])
    assert boots == [30.0, 35.0] and warms == [3.0, 1.5]
    # the restarts (spawned after the work began at 10) apart from the launch's starts
    assert boots_from_events(evs, lambda ev: ev["t"], after=10.0) == ([35.0], [1.5])
    assert boots_from_events(evs, lambda ev: ev["t"], before=10.0) == ([30.0], [3.0])


def test_calibration_from_known_real_figures() -> None:
    m = Measured(boot_s=[40.0, 44.0, 50.0], warmup_s=[3.0, 3.2, 2.8], step_1_s=[0.010, 0.011, 0.010],
                 step_batch_s=[0.017, 0.017, 0.018], batch=8, prefill_token_s=[1e-4, 2e-4, 3e-4],
                 push_s=[0.25, 0.3, 0.2], reload_s=[0.2, 0.1, 0.15], warm_requests=8, warm_tokens=16)
    cal = {k: v for k, (v, _) in calibrate(m, 16e9).items()}
    assert cal["boot_s"] == 44.0
    assert cal["step_base_s"] == pytest.approx(0.009) and cal["step_per_seq_s"] == pytest.approx(0.001)
    assert cal["first_batch_s"] == pytest.approx(3.0 - 16 * 0.017)   # the warm-up less its 16 steps at 8
    assert cal["prefill_token_s"] == pytest.approx(2e-4)
    assert cal["push_bytes_per_s"] == pytest.approx(16e9 / 0.25)     # the emulated bytes in the real time
    assert cal["reload_bytes_per_s"] == pytest.approx(16e9 / 0.15)
    with pytest.raises(ValueError, match="no measurement of the decode step"):
        calibrate(Measured(), 16e9)
    # no restart came back: the launch's starts, and the source says so
    m.boot_s, m.warmup_s, m.launch_boot_s, m.launch_warmup_s = [], [], [88.0], [16.7]
    boot, source = calibrate(m, 16e9)["boot_s"]
    assert boot == 88.0 and "launch" in source


def test_restart_to_ready_from_the_daemons_start_to_the_engine_back_in_service() -> None:
    restarts = [Restart(10.0, "e0", "exit"),
                Restart(20.0, "e1", "exit"), Restart(40.0, "e1", "retry"),   # the first start crashed
                Restart(60.0, "e2", "hang"),                                  # back as the warm spare
                Restart(90.0, "e0", "exit")]                                  # not back by the end
    serving = [Serving("e0", 0.0, 9.0), Serving("e0", 55.0, 89.0), Serving("e1", 0.0, 19.0), Serving("e1", 80.0)]
    spare = [Serving("e2", 0.0, 59.0), Serving("e2", 101.0)]
    back, never = restart_to_ready(restarts, serving, spare)
    assert back == [45.0, 40.0, 41.0] and never == 1


def test_a_well_separated_pair_must_be_ordered_the_same_way_in_both_fleets() -> None:
    real = {"fault-free": {"ettr": [1.0, 1.0, 1.0]}, "slime": {"ettr": [0.60, 0.64, 0.62]},
            "defaults": {"ettr": [0.70, 0.90, 0.80]}}
    emu = {"fault-free": {"ettr": [1.0, 1.0, 1.0]}, "slime": {"ettr": [0.75, 0.77, 0.76]},
           "defaults": {"ettr": [0.70, 0.72, 0.71]}}
    by = {(p.a, p.b): p for p in ordering(real, emu, ["ettr"])}
    ff_slime = by[("fault-free", "slime")]
    assert ff_slime.real_diff == pytest.approx(0.38) and ff_slime.real_spread == pytest.approx(0.02)
    assert ff_slime.judged and ff_slime.ok
    # slime - defaults: real -0.18 with a spread of 0.10 (not separated), emulated +0.05 with a
    # spread of 0.01 (separated): the real fleet orders them the other way
    s_d = by[("slime", "defaults")]
    assert not s_d.separated_real and s_d.separated_emulated and s_d.judged and not s_d.ok
    # a pair inside its spread in both fleets is not judged, whatever its order
    emu2 = {**emu, "slime": {"ettr": [0.60, 0.90, 0.75]}}
    s_d2 = {(p.a, p.b): p for p in ordering(real, emu2, ["ettr"])}[("slime", "defaults")]
    assert not s_d2.judged and s_d2.ok


def test_a_figure_a_policy_lacks_leaves_its_pairs_out() -> None:
    real = {"fault-free": {"ettr": [1.0]}, "defaults": {"ettr": [0.8], "mean_recover_s": [40.0]}}
    assert [(p.figure, p.a, p.b) for p in ordering(real, real, ["ettr", "mean_recover_s"])] == \
        [("ettr", "fault-free", "defaults")]


def test_restart_to_ready_matches_within_20_percent_of_the_real_figure() -> None:
    assert within(45.0, 50.0) == (pytest.approx(50 / 45), True)
    assert within(45.0, 54.0)[1] is True           # exactly +20 %
    assert within(45.0, 56.0)[1] is False
    assert within(45.0, 35.0)[1] is False          # -22 %
    with pytest.raises(ValueError):
        within(0.0, 10.0)


def test_emulated_figures_in_engine_time() -> None:
    assert in_engine_time("capacity_lost_s", 10.0, 0.5) == 20.0
    assert in_engine_time("useful_tps", 100.0, 0.5) == 50.0
    assert in_engine_time("ettr", 0.9, 0.5) == 0.9


def test_the_seeds_are_the_first_whose_draw_has_two_or_three_faults() -> None:
    seeds = fault_seeds(3, engines=2, window_s=45.0, mtbf_s=36.0)
    counts = {s: len(FaultClock(seed=s, engines=2, duration_s=45.0, mtbf_s=36.0).schedule())
              for s in range(seeds[-1] + 1)}
    assert [s for s, k in counts.items() if 2 <= k <= 3] == seeds
    with pytest.raises(ValueError, match="fewer than 1 seeds"):
        fault_seeds(1, engines=2, window_s=1.0, mtbf_s=1e9, limit=50)


def test_a_sample_s_version_is_its_first_piece_not_at_the_rounds() -> None:
    one = [Split("e0", "3", 0, 40, "ok")]
    assert sample_version(one, "3", 3) == 3
    continued = [Split("e0", 3, 0, 16, "died"), Split("e1", "2", 16, 24, "ok")]
    assert sample_version(continued, 3, 3) == 2
    assert sample_version([], "4", 3) == 4 and sample_version([], None, 3) == -1


def test_the_launcher_crashes_one_armed_start(tmp_path: Path) -> None:
    launcher = tmp_path / "engine-python"
    launcher.write_text(LAUNCHER.format(python=sys.executable, env=FAULT_ENV))
    launcher.chmod(0o755)
    armed = tmp_path / "fault"
    argv = [str(launcher), "-c", "import sys; print(sys.argv[1:])", "--model", "/the/model"]
    env = {FAULT_ENV: str(armed)}
    armed.write_text("crash-at-start\n")
    first = subprocess.run(argv, env=env, capture_output=True, text=True)
    second = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert first.returncode == 1 and "crash at start" in first.stderr and not armed.exists()
    assert classify_failure(first.stderr)[0] is False   # the daemon retries it, as the emulated one's
    # read and removed: the next start runs the engine's command line as given
    assert second.returncode == 0 and second.stdout.strip() == str(["--model", "/the/model"])
