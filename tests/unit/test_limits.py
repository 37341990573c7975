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


def test_attached_engines_count_at_what_they_hold_not_at_a_warm_up():
    assert nofile_needed(0, attached=4096) == limits.BASE + 4096 * limits.PER_ATTACHED
    assert nofile_needed(0, attached=4096) <= 20000 < nofile_needed(4096)  # this machine's hard limit
    assert nofile_needed(10, 8, attached=5) == nofile_needed(10, 8) + 5 * limits.PER_ATTACHED
    assert nofile_problem(0, 20000, hard=True, attached=4096) is None
    line = nofile_problem(2, 100, hard=True, attached=300)
    assert line is not None and "2 spawned engine(s)" in line and "300 attached engine(s) about 3 each" in line
    assert "302 engine(s)" in line


def test_fleet_counts_splits_spawned_from_attached():
    class Spec:
        def __init__(self, spawned):
            self.spawned = spawned
    assert limits.fleet_counts([Spec(True), Spec(False), Spec(False)]) == (1, 2)
    assert limits.fleet_counts([]) == (0, 0)


def test_a_fresh_start_is_refused_below_the_need_and_an_adopting_one_is_not():
    need = nofile_needed(10, attached=100)
    assert limits.start_problem(10, need, attached=100) == (True, None)
    ok, problem = limits.start_problem(10, need - 1, attached=100)
    assert not ok and problem == nofile_problem(10, need - 1, hard=True, attached=100)
    ok, problem = limits.start_problem(10, need - 1, attached=100, adopting=3)
    assert ok and problem.startswith(nofile_problem(10, need - 1, hard=True, attached=100))
    assert problem.endswith("starting anyway to adopt 3 running engine(s)")
    assert limits.start_problem(10, INF, attached=100) == (True, None)


PROBE_OUT_OF_FDS = r"""
import asyncio, json, resource, socket, sys
import aiohttp
from vime.supervisor.engine.probes import Prober

async def main():
    session = aiohttp.ClientSession()
    prober = Prober(session, sys.argv[1], "tiny", 1.0)
    kept, soft = [], resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        while True:  # every descriptor the limit allows, taken
            kept.append(socket.socket())
    except OSError:
        pass
    outcome = await prober.check()
    for s in kept:
        s.close()
    again = await prober.check()  # the engine itself was never at fault
    await session.close()
    print(json.dumps([outcome.kind, outcome.ok, outcome.detail, again.kind]))

asyncio.run(main())
"""


@pytest.mark.parametrize("client", ["lean", "aiohttp"])
def test_a_probe_the_daemon_has_no_descriptor_for_is_not_the_engines_failure(tmp_path, client):
    """In a process out of descriptors (its soft limit 128, all taken), the probe of an engine
    that answers (a PROTOCOL STAND-IN) says daemon_limit, not refused or error; with
    descriptors again, the same engine answers ok."""
    from vime.harness.standin_engine import free_port_range
    import os
    port = free_port_range(1)
    standin = subprocess.Popen([sys.executable, "-m", "vime.harness.standin_engine", "--base-port", str(port),
                                "--count", "1"], stdout=subprocess.PIPE)
    try:
        assert standin.stdout.readline().startswith(b"ready")
        env = {**os.environ, "VIME_PROBE_HTTP": client}
        out = subprocess.run([sys.executable, "-c", PROBE_OUT_OF_FDS, f"http://127.0.0.1:{port}"], env=env,
                             capture_output=True, text=True, timeout=60,
                             preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128)))
        assert out.returncode == 0, out.stderr
        kind, ok, detail, again = json.loads(out.stdout)
        assert (kind, ok, again) == ("daemon_limit", False, "ok"), detail
        assert "out of descriptors" in detail and "--check-config" in detail
    finally:
        standin.kill()
        standin.wait()
