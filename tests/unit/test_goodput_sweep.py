"""bench/goodput_sweep.py's pure parts: which cells meet a fault, what a cell's JSON gives, where a
policy falls below the threshold, and the flags it refuses (nothing is run)."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from support.bench_scripts import load_bench

sweep = load_bench("goodput_sweep", siblings=True)


EVERY_SYNC = ("fault-free", "slime", "defaults", "everything-on")


def _doc(runs: list[dict], engines: int = 8, rounds: int = 6, mtbf: float = 3600.0, scale: float = 0.2,
         policies: tuple[str, ...] = EVERY_SYNC) -> dict:
    return {"workload": {"engines": engines, "rounds": rounds, "scale": scale}, "mtbf_s": mtbf, "mutation": None,
            "policies": {p: {} for p in policies}, "runs": runs}


def _run(policy: str, seed: int, ettr: float | None, invalid: str | None = None, ettr_invalid: str | None = None):
    return {"policy": policy, "seed": seed, "invalid": invalid, "ettr_invalid": ettr_invalid, "ledger": {"ettr": ettr}}


def test_ettrs_keep_only_valid_runs_against_a_valid_baseline() -> None:
    doc = _doc([_run("fault-free", 0, 1.0), _run("slime", 0, 0.9), _run("slime", 1, 0.8, invalid="lag"),
                _run("slime", 2, 0.7, ettr_invalid="baseline invalid"), {"policy": "slime", "seed": 3, "error": "x"}])
    assert sweep.ettrs(doc) == {"fault-free": [1.0], "slime": [0.9]}


def test_falls_below_names_the_lowest_rate_with_a_median_under_the_threshold() -> None:
    cells = {86400.0: [1.0, 0.99, 1.0], 3600.0: [0.97, 0.96, 0.98], 900.0: [0.9, 0.93, 0.96]}
    assert sweep.falls_below(cells) == "below 0.95 from MTBF 900 s"
    cells[3600.0] = [0.94, 0.9, 0.99]
    assert sweep.falls_below(cells) == "below 0.95 from MTBF 1 h (stress)"


def test_falls_below_says_how_far_it_held_or_that_it_could_not_judge() -> None:
    assert sweep.falls_below({86400.0: [1.0] * 3, 900.0: [0.96] * 3}) == "at or above 0.95 down to MTBF 900 s"
    # two valid seeds are not enough to judge a cell
    assert sweep.falls_below({900.0: [0.5, 0.5]}).startswith("not judged")
    assert sweep.falls_below({900.0: None}).startswith("not judged")


def test_a_cell_with_no_fault_in_any_seeds_work_is_known_before_it_runs() -> None:
    assert sweep.faults_in_work(8, sweep.HEADLINE_MTBF_S, 3, 6) == 0   # 8 engines meet a fault per 3 engine-hours
    assert sweep.faults_in_work(64, 900.0, 3, 6) > 0


def test_a_run_made_by_hand_is_taken_for_its_cell_by_what_it_ran() -> None:
    a = argparse.Namespace(rounds=6, seeds=3, time_scale=None, only=None)
    doc = _doc([_run("fault-free", s, 1.0) for s in range(3)], engines=64, mtbf=3600.0)
    assert sweep.same_cell(doc, 64, 3600.0, a)
    assert not sweep.same_cell(doc, 8, 3600.0, a)
    assert not sweep.same_cell(doc, 64, 900.0, a)
    assert not sweep.same_cell(_doc([_run("fault-free", 0, 1.0)], engines=64), 64, 3600.0, a)  # one seed of three
    assert not sweep.same_cell(doc, 64, 3600.0, argparse.Namespace(rounds=6, seeds=3, time_scale=0.1, only=None))


def test_the_table_has_a_row_per_policy_and_says_why_a_cell_has_no_figure() -> None:
    results = {(8, 86400.0): "no fault",
               (8, 3600.0): {"fault-free": [1.0, 1.0, 1.0], "slime": [0.9, 0.92, 0.97]}}
    lines = sweep.table([8], [86400.0, 3600.0], results, 3)
    text = "\n".join(lines)
    assert "no fault" in text
    assert "0.920 [0.90-0.97] (3/3)" in text
    assert "below 0.95 from MTBF 1 h (stress)" in text


@pytest.mark.parametrize("argv", [["--engines", "0"], ["--engines", "a"], ["--mtbf", "-5"], ["--mtbf", "nan"],
                                  ["--seeds", "0"], ["--time-scale", "inf"], ["--mtbf", ","]])
def test_bad_flags_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        sweep.parse(argv)
    assert e.value.code == 2


@pytest.mark.parametrize("argv, said", [(["--mtbf", "900,bogus"], "--mtbf takes headline, stress or engine seconds"),
                                        (["--mtbf", "5"], "--mtbf takes"), (["--engines", "8,x"], "--engines takes")])
def test_a_bad_list_is_refused_naming_its_flag(capsys, argv: list[str], said: str) -> None:
    with pytest.raises(SystemExit):
        sweep.parse(argv)
    assert f"error: {said}" in capsys.readouterr().err


def test_rates_are_swept_from_the_rarest_fault_down() -> None:
    a = sweep.parse(["--mtbf", "900,headline,stress", "--engines", "64,8"])
    assert a.mtbfs == [86400.0, 3600.0, 900.0] and a.sizes == [8, 64]


@pytest.mark.parametrize("text", ["{not json", "[]", '{"workload": "x", "runs": []}', '{"workload": {}, "runs": [1]}',
                                  '{"workload": {}, "runs": [{"policy": "slime", "ledger": {"ettr": "high"}}]}', "\xff"])
def test_a_json_in_dir_that_is_not_a_cells_is_said_not_a_traceback(tmp_path, text: str) -> None:
    """A corrupt or foreign file where a cell's JSON goes: --report-only names it in the cell."""
    (tmp_path / "cell-64-3600.json").write_bytes(text.encode("latin-1"))
    a = sweep.parse(["--engines", "64", "--mtbf", "stress", "--dir", str(tmp_path), "--report-only"])
    got, rc = sweep.run_cell(64, 3600.0, a, tmp_path)
    assert rc == 0 and isinstance(got, str) and "cell-64-3600.json" in got, got


def test_a_rate_below_bench_goodputs_floor_is_refused() -> None:
    """bench/goodput.py refuses an MTBF under a minute; the fault clock's draw for one grows without bound."""
    with pytest.raises(SystemExit) as e:
        sweep.parse(["--mtbf", "0.001"])
    assert e.value.code == 2
    assert sweep.parse(["--mtbf", "60"]).mtbfs == [60.0]


def test_report_only_refuses_a_folder_that_is_not_there(tmp_path) -> None:
    assert sweep.main(["--report-only", "--dir", str(tmp_path / "typo")]) == 2
    assert not (tmp_path / "typo").exists()


def test_a_rate_with_many_digits_keeps_them_in_its_cell() -> None:
    a = sweep.parse(["--mtbf", "1234567"])
    assert sweep.cell_args(8, 1234567.0, a)[3] == "1234567"


@pytest.mark.parametrize("only", ["bogus", "slime,bogus", ",", "defaults-async"])
def test_a_bad_only_is_refused_before_any_cell_runs(tmp_path, capsys, only: str) -> None:
    """bench/goodput.py's own check, once, up front: not every cell's goodput.py exiting 1."""
    assert sweep.main(["--only", only, "--engines", "64", "--mtbf", "stress", "--dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip()
    assert not (tmp_path / "d").exists()  # refused before the folder, so before any cell
    assert len(err.splitlines()) == 1 and err.startswith("--only: "), err
    if only != ",":
        assert "known: fault-free, slime, defaults, everything-on" in err and "--weights" not in err, err


def _child(monkeypatch, writes: dict | None, rc: int = 0) -> list[list[str]]:
    """bench/goodput.py's child stood in for: it writes `writes` to --out (None: nothing) and
    exits rc; the commands it was given, returned."""
    calls: list[list[str]] = []

    def run(cmd, stdout, stderr):
        calls.append(cmd)
        if writes is not None:
            Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps(writes))
        return subprocess.CompletedProcess(cmd, rc)

    monkeypatch.setattr(sweep, "subprocess", SimpleNamespace(run=run, STDOUT=subprocess.STDOUT))
    return calls


CELL = ["--engines", "64", "--mtbf", "stress"]


def _every(ettr: float = 1.0) -> dict:
    return _doc([_run(p, s, ettr) for p in EVERY_SYNC for s in range(3)], engines=64)


def test_a_cell_that_ran_more_policies_than_only_wants_is_read_not_run(tmp_path, monkeypatch) -> None:
    """A cell's JSON covers --only when it ran every policy --only names (more is fine): read, only
    those policies' figures taken, and the file left as it is."""
    calls = _child(monkeypatch, None)
    (tmp_path / "cell-64-3600.json").write_text(json.dumps(_every(0.9)))
    before = (tmp_path / "cell-64-3600.json").read_text()
    got, rc = sweep.run_cell(64, 3600.0, sweep.parse([*CELL, "--dir", str(tmp_path), "--only", "slime"]), tmp_path)
    assert calls == [] and rc == 0
    assert got == {"fault-free": [0.9] * 3, "slime": [0.9] * 3}
    assert (tmp_path / "cell-64-3600.json").read_text() == before


def test_a_read_cell_fails_only_for_the_policies_only_wants(tmp_path, monkeypatch) -> None:
    """A reused cell whose JSON records a failed run or a broken must-be-zero figure of a policy
    --only does not ask for is no failure of this sweep; one of a wanted policy is."""
    calls = _child(monkeypatch, None)
    doc = {**_every(0.9), "failed": ["defaults seed 1: the daemon did not start"],
           "must_be_zero": ["everything-on seed 2: stale = 1 (must be 0)"]}
    (tmp_path / "cell-64-3600.json").write_text(json.dumps(doc))
    for only, want in (("slime", 0), ("defaults", 1), ("everything-on", 1)):
        got, rc = sweep.run_cell(64, 3600.0, sweep.parse([*CELL, "--dir", str(tmp_path), "--only", only]), tmp_path)
        assert (calls, rc) == ([], want), only


def test_a_cell_lacking_a_wanted_policy_is_run_with_the_old_json_and_log_moved_aside(tmp_path, monkeypatch, capsys) -> None:
    slime = _doc([_run(p, s, 0.5) for p in ("fault-free", "slime") for s in range(3)], engines=64,
                 policies=("fault-free", "slime"))
    (tmp_path / "cell-64-3600.json").write_text(json.dumps(slime))
    (tmp_path / "cell-64-3600.log").write_text("the slime run's log")
    calls = _child(monkeypatch, _every(0.9))
    a = sweep.parse([*CELL, "--dir", str(tmp_path)])
    got, rc = sweep.run_cell(64, 3600.0, a, tmp_path)
    assert len(calls) == 1 and rc == 0 and got == {p: [0.9] * 3 for p in EVERY_SYNC}
    assert json.loads((tmp_path / "cell-64-3600.replaced-1.json").read_text()) == slime
    assert (tmp_path / "cell-64-3600.replaced-1.log").read_text() == "the slime run's log"
    said = [line for line in capsys.readouterr().out.splitlines() if "moved to" in line]
    assert said == ["cell 64 engines, MTBF 1 h (stress): cell-64-3600.json (ran fault-free, slime; not defaults, "
                    "everything-on) moved to cell-64-3600.replaced-1.json, its log too"], said
    # another workload in its place is moved aside too, to the next free name
    (tmp_path / "cell-64-3600.json").write_text(json.dumps(_doc([_run("fault-free", 0, 1.0)], engines=64)))
    sweep.run_cell(64, 3600.0, a, tmp_path)
    assert (tmp_path / "cell-64-3600.replaced-2.json").exists() and (tmp_path / "cell-64-3600.replaced-1.json").exists()


def test_a_rerun_that_writes_no_json_is_failed_not_the_old_figures(tmp_path, monkeypatch) -> None:
    (tmp_path / "cell-64-3600.json").write_text(json.dumps(_doc([_run("fault-free", 0, 1.0)], engines=64)))
    _child(monkeypatch, None, rc=1)
    got, rc = sweep.run_cell(64, 3600.0, sweep.parse([*CELL, "--dir", str(tmp_path)]), tmp_path)
    assert rc == 1 and got == "failed (exit 1: no JSON written)", got
    assert not (tmp_path / "cell-64-3600.json").exists()
    _child(monkeypatch, None, rc=0)  # exiting 0 without one is no better
    assert sweep.run_cell(64, 3600.0, sweep.parse([*CELL, "--dir", str(tmp_path)]), tmp_path)[1] == 1


def test_report_only_shows_the_wanted_policies_a_cell_ran_and_names_those_it_did_not(tmp_path, monkeypatch) -> None:
    calls = _child(monkeypatch, None)
    slime = _doc([_run(p, s, 0.9) for p in ("fault-free", "slime") for s in range(3)], engines=64,
                 policies=("fault-free", "slime"))
    (tmp_path / "cell-64-3600.json").write_text(json.dumps(slime))
    a = sweep.parse([*CELL, "--dir", str(tmp_path), "--report-only", "--only", "slime,defaults"])
    got, rc = sweep.run_cell(64, 3600.0, a, tmp_path)
    assert calls == [] and rc == 0
    assert got == {"fault-free": [0.9] * 3, "slime": [0.9] * 3, "defaults": "ran fault-free, slime; not defaults"}
    text = "\n".join(sweep.table([64], [3600.0], {(64, 3600.0): got}, 3))
    assert "0.900 (3/3)" in text and "ran fault-free, slime; not defaults" in text, text


def test_report_only_writes_nothing(tmp_path, monkeypatch) -> None:
    """sweep.json keeps the last run's cells and failures."""
    _child(monkeypatch, None)
    (tmp_path / "cell-64-3600.json").write_text(json.dumps(_every()))
    (tmp_path / "sweep.json").write_text('{"failed": ["64 engines, MTBF 900 s: exited 1"]}\n')
    assert sweep.main([*CELL, "--dir", str(tmp_path), "--report-only"]) == 0
    assert (tmp_path / "sweep.json").read_text() == '{"failed": ["64 engines, MTBF 900 s: exited 1"]}\n'
    assert sorted(x.name for x in tmp_path.iterdir()) == ["cell-64-3600.json", "sweep.json"]


@pytest.mark.parametrize("under", ["", "sub"])
def test_a_dir_that_is_a_file_or_under_one_is_refused_in_a_line(tmp_path, monkeypatch, capsys, under: str) -> None:
    calls = _child(monkeypatch, None)
    (tmp_path / "f").write_text("x")
    assert sweep.main([*CELL, "--dir", str(tmp_path / "f" / under)]) == 2
    err = capsys.readouterr().err.strip()
    assert calls == [] and len(err.splitlines()) == 1 and err.startswith(f"--dir {tmp_path / 'f'}"), err
