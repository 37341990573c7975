"""bench/goodput.py's flags: what cannot rank policies or would size an absurd fleet is refused
with a message that says what to pass (argparse's exit 2), before anything starts."""

from __future__ import annotations

import pytest

from support.bench_scripts import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("goodput", siblings=True)


@pytest.mark.parametrize("argv, said", [
    (["--mtbf", "inf"], "--mtbf must be a finite number of engine seconds, at least 60"),
    (["--mtbf", "0.001"], "--mtbf must be a finite number of engine seconds, at least 60"),
    (["--mtbf", "nan"], "--mtbf must be a finite number"),
    (["--engines", "6", "--spares", "7"], "--spares must be at most --engines"),
    (["--quick", "--spares", "9"], "--spares must be at most --engines"),
    (["--only", ","], "--only takes policy names"),
    (["--mutation", "stale", "--only", "slime"], "--mutation runs one policy of its own"),
])
def test_refused_with_what_to_pass(bench, capsys, argv, said):
    with pytest.raises(SystemExit) as ei:
        bench.parse(argv)
    assert ei.value.code == 2
    assert said in capsys.readouterr().err


def test_accepted_and_spares_never_outnumber_the_fleet(bench):
    a = bench.parse(["--mtbf", "stress", "--engines", "8", "--spares", "8", "--only", "slime"])
    assert a.mtbf == 3600.0 and a.spares == 8
    assert bench.parse(["--mtbf", "60"]).mtbf == 60.0
    from vime.harness.fleet_plan import spares_for
    assert spares_for(6, 60.0, 100.0) > 6 and bench.sized_spares(6, 60.0, 100.0) == 6
    assert bench.sized_spares(64, 86400.0, 100.0) == spares_for(64, 86400.0, 100.0) < 64


def test_an_out_in_a_folder_not_there_is_refused_before_any_run(bench, capsys, tmp_path):
    with pytest.raises(SystemExit) as ei:
        bench.parse(["--out", str(tmp_path / "typo" / "g.json")])
    assert ei.value.code == 2
    assert f"error: --out {tmp_path}/typo/g.json: the folder {tmp_path}/typo does not exist" in capsys.readouterr().err
    assert bench.parse(["--out", str(tmp_path / "g.json")]).out == str(tmp_path / "g.json")
