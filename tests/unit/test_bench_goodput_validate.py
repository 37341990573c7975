"""bench/goodput_validate.py's pure parts with known inputs (nothing is run): its flags, the
policies it runs, the per-policy figures, the checks' verdicts and the side-by-side table."""

from __future__ import annotations

import pytest

from tests.support.bench_scripts import load_bench

gv = load_bench("goodput_validate")


def run(fleet: str, policy: str, seed: int, ettr: float | None, restarts: list[float], **more: float) -> object:
    return gv.RunResult(fleet, policy, seed, {"ettr": ettr, **more}, restarts)


def test_flags_refuse_what_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in (["--seeds", "0"], ["--only", "nosuch"], ["--emulated-scale", "0"], ["--reuse-real", "/no/such.json"]):
        with pytest.raises(SystemExit) as e:
            gv.parse(bad)
        assert e.value.code == 2
    assert "--only takes policies" in capsys.readouterr().err


def test_fault_free_always_runs_first() -> None:
    assert gv.policy_names(gv.parse(["--quick"])) == ["fault-free", "defaults"]
    assert gv.policy_names(gv.parse(["--only", "slime,fault-free"])) == ["fault-free", "slime"]
    assert gv.policy_names(gv.parse([])) == ["fault-free", "slime", "defaults", "everything-on"]


def test_the_checks_from_known_runs() -> None:
    real = [run("real", "fault-free", s, 1.0, []) for s in (0, 1, 2)] + \
        [run("real", "defaults", s, e, r) for s, e, r in ((0, 0.60, [44.0, 46.0]), (1, 0.62, [50.0]), (2, 0.64, []))]
    emu = [run("emulated", "fault-free", s, 1.0, []) for s in (0, 1, 2)] + \
        [run("emulated", "defaults", s, e, r) for s, e, r in ((0, 0.70, [50.0]), (1, 0.72, [52.0]), (2, 0.74, [60.0]))]
    pairs, restart = gv.checks(real, emu)
    (p,) = pairs
    assert (p.figure, p.a, p.b) == ("ettr", "fault-free", "defaults") and p.judged and p.ok
    assert restart["real_s"] == 46.0 and restart["emulated_s"] == 52.0   # medians of the pooled restarts
    assert restart["ratio"] == pytest.approx(52 / 46) and restart["ok"]
    # the emulated restarts 25 % slower: outside 20 %
    slow = [run("emulated", "defaults", 0, 0.7, [57.5])]
    assert not gv.checks(real, slow)[1]["ok"]
    # no restart came back in the emulated fleet: the check fails, saying where
    _, none = gv.checks(real, [run("emulated", "defaults", 0, 0.7, [])])
    assert not none["ok"] and "emulated" in none["why"]


def test_a_failed_run_adds_no_figure_and_the_table_shows_both_fleets() -> None:
    real = [run("real", "fault-free", 0, 1.0, []), run("real", "defaults", 0, 0.6, [45.0], capacity_lost_s=30.0),
            gv.RunResult("real", "defaults", 1, error="boom")]
    emu = [run("emulated", "fault-free", 0, 1.0, []), run("emulated", "defaults", 0, 0.7, [50.0])]
    assert gv.by_policy(real)["defaults"] == {"ettr": [0.6], "capacity_lost_s": [30.0], "restart_to_ready_s": [45.0]}
    lines = gv.table(real, emu, ["fault-free", "defaults"])
    assert len(lines) == 5 and lines[0].split()[:3] == ["policy", "fleet", "runs"]
    row = lines[3].split()
    assert row[:4] == ["defaults", "real", "1/2", "0.600"] and row[-1] == "45.0"


def test_an_out_in_a_folder_not_there_is_refused_before_any_run(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    with pytest.raises(SystemExit) as e:
        gv.parse(["--out", str(tmp_path / "typo" / "v.json")])
    assert e.value.code == 2
    assert f"error: --out {tmp_path}/typo/v.json: the folder {tmp_path}/typo does not exist" in capsys.readouterr().err
