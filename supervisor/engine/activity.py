"""What an engine's processes are doing, as Linux's /proc sees it: busy or hung when a probe is
late (docs/concepts.md).

vLLM's counters move only when an engine step ends, and one step (a first-use compile, a long
prefill) can take seconds. The process group's CPU time tells the two apart: a compiling Worker
burns ~97% of a core, a SIGSTOPped EngineCore's group under 1%; a member in state T is hung.
Reading is I/O (`sample_group`); judging two samples is pure (`cpu_seconds`, `busy`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from .process import all_procs

TICK = 1.0 / os.sysconf("SC_CLK_TCK")  # seconds per clock tick (usually 10 ms)
# A group burning at least this share of one core is working. Two orders of magnitude above
# a stopped group, and below a compile even on a machine shared with other engines.
BUSY_CORES = 0.10
STOPPED_STATES = frozenset({"T", "t"})  # stopped by a signal, or by a tracer


@dataclass(frozen=True)
class Member:
    pid: int
    comm: str
    state: str
    cpu: float  # seconds: user + system, plus reaped children's


@dataclass(frozen=True)
class GroupSample:
    at: float  # time.monotonic() of the reading
    members: tuple[Member, ...]

    @property
    def stopped(self) -> tuple[Member, ...]:
        return tuple(m for m in self.members if m.state in STOPPED_STATES)

    def describe(self) -> str:
        return describe(self.members)


def describe(members: tuple[Member, ...], limit: int = 4) -> str:
    """'python3(4711) R 12.3s cpu, VLLM::EngineCore(4790) S 3.1s cpu, +2 more'."""
    shown = [f"{m.comm}({m.pid}) {m.state} {m.cpu:.1f}s cpu" for m in members[:limit]]
    more = len(members) - limit
    return ", ".join(shown + ([f"+{more} more"] if more > 0 else [])) or "no live process"


def sample_group(pgid: int) -> GroupSample:
    """Every live member of process group `pgid` (zombies carry no more work)."""
    members = tuple(Member(st.pid, st.comm, st.state, st.cpu_ticks * TICK)
                    for st in all_procs() if st.pgrp == pgid and st.state != "Z")
    return GroupSample(time.monotonic(), members)


def cpu_seconds(before: GroupSample, after: GroupSample) -> float:
    """CPU the group used between two samples. Per pid, so a member that left the group (and
    took its time with it) does not cancel out one that worked; a new member (a compiler
    started meanwhile) counts whole."""
    old = {m.pid: m.cpu for m in before.members}
    return sum(max(0.0, m.cpu - old.get(m.pid, 0.0)) for m in after.members)


def busy(before: GroupSample, after: GroupSample) -> tuple[bool, float]:
    """(working, share of a core used) between two samples."""
    elapsed = max(after.at - before.at, TICK)
    cores = cpu_seconds(before, after) / elapsed
    return cores >= BUSY_CORES, cores
