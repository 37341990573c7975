"""When a runner's next heartbeat is due: every `interval`; after a failure, one `timeout`
after the last one started, so a hang is confirmed back to back (UNHEALTHY at most interval +
timeout x threshold after it began). Also counts the heartbeats that start late."""

from __future__ import annotations

import asyncio
from typing import Callable

from ..config import ProbePolicy


class HeartbeatSchedule:
    def __init__(self, policy: ProbePolicy, clock: Callable[[], float]):
        self.policy = policy
        self.clock = clock
        self.due = clock()
        # Heartbeats that started more than one interval behind their schedule: the daemon
        # itself is too loaded to watch the engine as configured (status: late_probes).
        self.late = 0

    def restart(self) -> HeartbeatSchedule:
        """A heartbeat loop begins: the first one is due now (the late count goes on)."""
        self.due = self.clock()
        return self

    def begin(self) -> float:
        """A heartbeat starts now: its start time, counted late if it is."""
        started = self.clock()
        if started - self.due > self.policy.interval:
            self.late += 1
        return started

    async def wait_next(self, started: float, failing: bool) -> None:
        """Sleep until the next heartbeat is due: one timeout after `started` while probes
        fail (consecutive failures), else one interval."""
        self.due = started + (self.policy.timeout if failing else self.policy.interval)
        await asyncio.sleep(max(0.0, self.due - self.clock()))
