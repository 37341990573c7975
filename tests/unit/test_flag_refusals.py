"""Flag combinations refused (exit 2, with what to set) or kept in bounds by bench/goodput.py and
trainer/rl_loop.py. Parsing only (nothing runs)."""

from __future__ import annotations

import pytest

from vime.trainer import rl_loop

from support.bench_scripts import load_bench


def _goodput():
    return load_bench("goodput", siblings=True)


def test_goodput_refuses_an_infinite_time_scale():
    with pytest.raises(SystemExit) as e:
        _goodput().parse(["--quick", "--time-scale", "inf"])
    assert e.value.code == 2


def test_goodput_quick_with_one_engine_never_gets_more_spares_than_engines():
    g = _goodput()
    plan = g.plan_of(g.parse(["--quick", "--engines", "1"]))
    assert plan.spares <= plan.w.engines


def test_rl_loop_refuses_serving_fraction_without_async():
    ap = rl_loop.build_parser()
    args = ap.parse_args(["--model", "m", "--serving-fraction", "0.5"])
    with pytest.raises(SystemExit) as e:
        rl_loop.check_args(ap, args)
    assert e.value.code == 2


def test_goodput_runs_a_policy_named_twice_once():
    g = _goodput()
    assert g.plan_of(g.parse(["--quick", "--only", "slime,slime"])).names == ["fault-free", "slime"]


@pytest.mark.parametrize("flag", ["--num-rollout", "--rollout-batch-size", "--n-samples-per-prompt",
                                  "--rollout-max-response-len"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_rl_loop_refuses_counts_below_one(flag: str, value: str, capsys):
    ap = rl_loop.build_parser()
    args = ap.parse_args(["--model", "m", flag, value])
    with pytest.raises(SystemExit) as e:
        rl_loop.check_args(ap, args)
    assert e.value.code == 2 and f"{flag} must be at least 1" in capsys.readouterr().err
