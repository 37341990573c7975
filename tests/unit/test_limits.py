"""The open-file limit: the soft limit raised to the hard one, and the engine count's need."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from vime.supervisor import limits
from vime.supervisor.limits import nofile_needed, nofile_problem, soft_target

INF = resource.RLIM_INFINITY


def test_soft_target_is_the_hard_limit_capped_at_the_kernel_ceiling():
    assert soft_target(1024, 524288, 1 << 20) == 524288
    assert soft_target(1024, INF, 1 << 20) == 1 << 20  # infinite hard: nr_open, a number setrlimit takes
    assert soft_target(1024, 1 << 30, 1 << 20) == 1 << 20  # a hard limit above nr_open: nr_open
    assert soft_target(4096, 4096, 1 << 20) is None  # already there
    assert soft_target(INF, INF, 1 << 20) is None  # never lowered
    assert soft_target(2 << 20, INF, 1 << 20) is None


def raised_in_child(soft: int, hard: int) -> dict:
    """raise_nofile in a fresh interpreter started with (soft, hard): what it returned and what
    the kernel says afterwards."""
    code = ("import json, resource; from vime.supervisor.limits import raise_nofile; r = raise_nofile(); "
            "print(json.dumps({'returned': r, 'now': resource.getrlimit(resource.RLIMIT_NOFILE)}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    return json.loads(out.stdout)


def test_raise_nofile_lifts_a_lowered_soft_limit_to_the_hard_one():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    expect = soft_target(256, hard, limits.nr_open()) or 256
    got = raised_in_child(256, hard)
    assert got["returned"] == got["now"] == [expect, hard]
    assert expect > 256 or hard == 256


def test_raise_nofile_never_goes_above_the_hard_limit():
    got = raised_in_child(100, 300)
    assert got["returned"] == got["now"] == [300, 300]
    got = raised_in_child(300, 300)  # nothing to do: nothing changes
    assert got["now"] == [300, 300]


def test_nofile_needed_grows_with_engines_and_warmup():
    assert nofile_needed(0) == limits.BASE
    assert nofile_needed(300) == limits.BASE + 300 * (limits.PER_ENGINE + 8)
    assert nofile_needed(300, warmup_requests=0) < nofile_needed(300)
    assert nofile_needed(300) > nofile_needed(299)


def test_nofile_problem_names_the_number_and_what_to_raise():
    need = nofile_needed(300)
    assert nofile_problem(300, need) is None and nofile_problem(300, INF) is None
    soft = nofile_problem(300, 256)
    assert soft is not None and "\n" not in soft
    assert "soft open-file limit is 256" in soft and f"{need} descriptors 300 engine(s)" in soft
    assert f"LimitNOFILE={need}" in soft and f"ulimit -n {need}" in soft
    hard = nofile_problem(300, 4096, hard=True)
    assert hard is not None and "hard open-file limit is 4096" in hard
    assert f"LimitNOFILE={need}" in hard and f"ulimit -Hn {need}" in hard


@pytest.mark.parametrize("n", [1, 8, 64, 1024])
def test_the_problem_appears_exactly_below_the_need(n):
    need = nofile_needed(n)
    assert nofile_problem(n, need - 1) is not None
    assert nofile_problem(n, need) is None
