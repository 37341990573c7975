"""harness/bench_runs.py, what the fleet benches share: the --only check, the --mtbf flag, a run's
folder kept or removed, and the JSON's first and last keys (nothing is run)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest

from vime.harness import bench_runs as br


def test_policy_names_put_each_baseline_first_and_name_each_policy_once() -> None:
    assert br.policy_names(None, "sync") == ["fault-free", "slime", "defaults", "everything-on"]
    assert br.policy_names("slime, slime,fault-free", "sync") == ["fault-free", "slime"]
    assert br.policy_names("defaults-async,defaults", "both") == ["fault-free", "defaults", "fault-free-async",
                                                                  "defaults-async"]


def test_an_unknown_policy_is_named_with_the_known_ones_and_the_mode_that_has_it() -> None:
    with pytest.raises(ValueError, match=r"unknown policies \['bogus'\] with --weights sync; known: fault-free, slime"):
        br.policy_names("slime,bogus", "sync")
    with pytest.raises(ValueError, match="defaults-async is of the other weights mode: pass --weights async"):
        br.policy_names("defaults-async", "sync")
    with pytest.raises(ValueError) as e:  # a bench without --weights is not told to pass it
        br.policy_names("defaults-async", "sync", weights_flag=False)
    assert "--weights" not in str(e.value) and "known: fault-free, slime, defaults, everything-on" in str(e.value)
    for empty in ("", " , "):
        with pytest.raises(ValueError, match="no policy name"):
            br.policy_names(empty, "sync")


def test_mtbf_takes_the_named_rates_or_seconds_from_a_minute() -> None:
    assert (br.mtbf_of("headline"), br.mtbf_of("stress"), br.mtbf_of("60")) == (86400.0, 3600.0, 60.0)
    for bad in ("59", "nan", "inf", "often"):
        with pytest.raises(argparse.ArgumentTypeError, match="--mtbf"):
            br.mtbf_of(bad)


def _run_folder(root: Path, name: str) -> Path:
    tmp = root / "tmp" / name
    tmp.mkdir(parents=True)
    (tmp / "daemon.log").write_text("log")
    (tmp / "daemon.sock").write_text("")
    return tmp


def test_a_run_s_folder_is_kept_only_when_it_failed_or_is_suspect_or_keep_asks(tmp_path: Path) -> None:
    f = br.RunFolders(None, str(tmp_path / "out.json"), "failed-runs")
    assert f.failed_dir == tmp_path / "failed-runs"
    clean = _run_folder(tmp_path, "clean")
    f.ran(clean, "defaults seed 0", [], suspect=False)
    assert not clean.exists() and not f.failed_dir.exists() and f.failed == []
    suspect = _run_folder(tmp_path, "suspect")
    f.ran(suspect, "defaults seed 1", [], suspect=True)
    assert not suspect.exists() and (f.failed_dir / "suspect" / "daemon.log").exists() and f.failed == []
    assert not (f.failed_dir / "suspect" / "daemon.sock").exists()
    problem = _run_folder(tmp_path, "problem")
    f.ran(problem, "slime seed 0", ["engine 3 never came back"], suspect=False)
    assert (f.failed_dir / "problem").is_dir() and f.failed == ["slime seed 0: ['engine 3 never came back']"]
    broke = _run_folder(tmp_path, "broke")
    f.broke(broke, "slime seed 1: boom")
    assert (f.failed_dir / "broke").is_dir() and f.failed[-1] == "slime seed 1: boom"
    kept = br.RunFolders(str(tmp_path / "keep"), str(tmp_path / "out.json"), "failed-runs")
    kept.ran(_run_folder(tmp_path, "any"), "defaults seed 2", [], suspect=False)
    assert kept.failed_dir == tmp_path / "keep" and (tmp_path / "keep" / "any" / "daemon.log").exists()


def test_finish_writes_the_json_and_exits_1_on_any_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "b.json"
    doc = {**br.run_header("goodput.py", ["--quick"]), "failed": []}
    assert doc["command"] == "python bench/goodput.py --quick"
    assert br.finish(doc, str(out), time.monotonic(), []) == 0
    assert json.loads(out.read_text())["took_s"] >= 0 and "FAIL" not in capsys.readouterr().out
    assert br.finish(doc, str(out), time.monotonic(), ["slime seed 0: boom"], gap="\n") == 1
    said = capsys.readouterr().out
    assert said.startswith("\n  took ") and "  FAIL: slime seed 0: boom" in said


def test_an_out_the_json_cannot_be_written_to_is_said_at_once(tmp_path: Path) -> None:
    assert br.out_file_error(str(tmp_path / "g.json")) is None
    assert br.out_file_error("goodput.json") is None  # the working folder
    assert br.out_file_error(str(tmp_path / "typo" / "g.json")) == \
        f"--out {tmp_path}/typo/g.json: the folder {tmp_path}/typo does not exist: create it or name another"
    (tmp_path / "f").write_text("x")
    assert br.out_file_error(str(tmp_path / "f" / "g.json")) == \
        f"--out {tmp_path}/f/g.json: the folder {tmp_path}/f is not a folder: create it or name another"
    assert br.out_file_error(str(tmp_path)) == f"--out {tmp_path} is a folder: name a file (the JSON) in it"
