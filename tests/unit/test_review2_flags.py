"""Defect demonstrations (review2, for the lead): flag combinations accepted where they should
exit 2 with what to set. Parsing only (nothing runs). Strict xfail: each passes (and so fails the
suite) once fixed; then drop the marker."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from vime.trainer import rl_loop

BENCH = Path(__file__).resolve().parents[2] / "bench" / "goodput.py"


def _goodput():
    spec = importlib.util.spec_from_file_location("review2_goodput", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.xfail(strict=True, reason="bench/goodput.py parse: `not a.time_scale > 0` refuses nan but lets inf "
                                       "through (--mtbf checks math.isfinite, --time-scale does not)")
def test_goodput_refuses_an_infinite_time_scale():
    with pytest.raises(SystemExit) as e:
        _goodput().parse(["--quick", "--time-scale", "inf"])
    assert e.value.code == 2


@pytest.mark.xfail(strict=True, reason="bench/goodput.py plan_of: --quick's default spares (QUICK_SPARES = 2) are "
                                       "not capped at --engines, though an explicit --spares above it is refused")
def test_goodput_quick_with_one_engine_never_gets_more_spares_than_engines():
    g = _goodput()
    plan = g.plan_of(g.parse(["--quick", "--engines", "1"]))
    assert plan.spares <= plan.w.engines


@pytest.mark.xfail(strict=True, reason="trainer/rl_loop.py check_args: --serving-fraction is read only with --async "
                                       "and is silently ignored without it")
def test_rl_loop_refuses_serving_fraction_without_async():
    ap = rl_loop.build_parser()
    args = ap.parse_args(["--model", "m", "--serving-fraction", "0.5"])
    with pytest.raises(SystemExit) as e:
        rl_loop.check_args(ap, args)
    assert e.value.code == 2
