"""Busy or hung from the operating system's side: the group's CPU time and process states
(supervisor/engine/activity.py), judged with vLLM's counters and the pause (probes.judge_late), and
an engine's weight version read as untrusted input. Pure functions, plus /proc of processes
this test starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from vime.supervisor.engine.activity import GroupSample, Member, busy, cpu_seconds, sample_group
from vime.supervisor.engine.probes import Progress, judge_late, parse_version


def sample(at: float, *members: tuple[int, str, float]) -> GroupSample:
    return GroupSample(at, tuple(Member(pid, "p", state, cpu) for pid, state, cpu in members))


def test_cpu_is_counted_per_pid():
    before = sample(0.0, (1, "S", 10.0), (2, "R", 5.0), (3, "R", 2.0))
    # pid 3 left (its time went with it), pid 4 is a compiler started meanwhile.
    after = sample(0.5, (1, "S", 10.0), (2, "R", 5.3), (4, "R", 0.2))
    assert cpu_seconds(before, after) == pytest.approx(0.5)
    assert busy(before, after) == (True, pytest.approx(1.0))


def test_a_group_that_does_not_burn_cpu_is_not_busy():
    before = sample(0.0, (1, "S", 10.0), (2, "S", 5.0))
    after = sample(0.5, (1, "S", 10.0), (2, "S", 5.01))  # one clock tick: a stopped group's noise
    working, cores = busy(before, after)
    assert not working and cores == pytest.approx(0.02)


PROG = Progress(100.0, 2.0, 50.0)


def test_late_probe_verdicts():
    idle = sample(0.0, (1, "S", 1.0)), sample(0.5, (1, "S", 1.0))
    burning = sample(0.0, (1, "S", 1.0), (2, "R", 3.0)), sample(0.5, (1, "S", 1.0), (2, "R", 3.45))
    stopped = sample(0.0, (1, "S", 1.0), (2, "T", 3.0))
    moved = Progress(104.0, 2.0, 50.0)

    out = judge_late(2.0, PROG, moved, *idle, paused=False)
    assert out.ok and out.excuse is None and "4 tokens processed" in out.detail
    out = judge_late(2.0, PROG, PROG, *burning, paused=False)
    assert out.ok and out.excuse == "busy" and "90% of a core" in out.detail
    out = judge_late(2.0, PROG, PROG, *idle, paused=False)
    assert not out.ok and out.detail.startswith("timeout after 2s, no progress (processes at 0% of a core")
    out = judge_late(2.0, PROG, PROG, *idle, paused=True)
    assert out.ok and out.excuse == "paused"
    # A stopped member means hung, whatever else moved.
    out = judge_late(2.0, PROG, moved, stopped, stopped, paused=True)
    assert not out.ok and "stopped: p(2) T" in out.detail
    # Attached engines (no group): counters and pause only.
    assert not judge_late(2.0, PROG, PROG, None, None, paused=False).ok
    assert judge_late(2.0, None, None, None, None, paused=False).detail == "timeout after 2s, no progress"


def test_sample_group_sees_cpu_and_a_stopped_member():
    """Real processes: a leader of its own group with a child that burns CPU, then is stopped."""
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time;"
         "subprocess.Popen([sys.executable, '-c', 'while True: pass']); time.sleep(60)"],
        start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(sample_group(leader.pid).members) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        first = sample_group(leader.pid)
        assert len(first.members) == 2 and not first.stopped
        time.sleep(0.5)
        second = sample_group(leader.pid)
        assert busy(first, second)[0], (first, second)
        child = next(m.pid for m in second.members if m.pid != leader.pid)
        os.kill(child, signal.SIGSTOP)
        time.sleep(0.1)
        third = sample_group(leader.pid)
        assert [m.pid for m in third.stopped] == [child]
        time.sleep(0.5)
        assert not busy(third, sample_group(leader.pid))[0]
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


@pytest.mark.parametrize("raw, want", [
    ("7", 7), ("default", None), (None, None), (12, None), ("9223372036854775807", 2**63 - 1),
    ("9223372036854775808", "9223372036854775808"), ("²", "²"), ("v3", "v3"),
])
def test_weight_version_from_the_engine_is_untrusted(raw, want):
    """Fault 9: "²" and 5,000 digits raised ValueError and ended the engine's supervision."""
    assert parse_version(raw) == want


def test_fault9_a_5000_digit_version_is_a_short_opaque_label():
    out = parse_version("9" * 5000)
    assert isinstance(out, str) and len(out) == 64 and out.endswith("...")
