"""The daemon watching itself: how late its event loop runs, how late its systemd watchdog pings
go out, and whether its first fleet is up (the startup probe's answer, READY=1's rule).

A `LagMeter` times sleeps on the loop: a sleep that wakes late measures what held the loop (a
blocking call, a long callback, a starved CPU). The daemon runs one on a fine tick (the loop's
lag) and times its watchdog's sleeps with another (how close systemd came to killing it). Both
are exported beside process_* on the metrics listener (metrics.MetricsServer).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from .metrics import Histogram

LOOP_TICK = 0.25  # seconds between the loop-lag meter's wakes
LAG_WINDOW = 60.0  # the *_max gauges: the largest lag over this many seconds
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LagMeter:
    """How late each timed sleep woke: a histogram and the largest over the last LAG_WINDOW."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window: float = LAG_WINDOW):
        self.clock = clock
        self.window = window
        self.histogram = Histogram(LAG_BUCKETS)
        self.last = 0.0
        self._recent: deque[tuple[float, float]] = deque()  # (at, lag), lags decreasing: a window max

    def record(self, lag: float, at: float) -> None:
        self.last = lag
        self.histogram.observe(lag)
        while self._recent and self._recent[-1][1] <= lag:
            self._recent.pop()
        self._recent.append((at, lag))

    def recent_max(self) -> float:
        cutoff = self.clock() - self.window
        while self._recent and self._recent[0][0] < cutoff:
            self._recent.popleft()
        return self._recent[0][1] if self._recent else 0.0

    async def sleep(self, seconds: float) -> None:
        due = self.clock() + seconds
        await asyncio.sleep(seconds)
        now = self.clock()
        self.record(max(0.0, now - due), now)

    async def run(self, tick: float = LOOP_TICK) -> None:
        while True:
            await self.sleep(tick)


class SelfWatch:
    """What the daemon knows of itself, for the metrics listener and the probes."""

    def __init__(self, watchdog_interval: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.loop = LagMeter(clock)
        self.watchdog = LagMeter(clock)
        # systemd's WATCHDOG_USEC: pings go out every half of it (sdnotify.Notifier). None: off.
        self.watchdog_timeout = 2 * watchdog_interval if watchdog_interval else None
        self.started = False  # every engine's first start has concluded (READY=1 was sent)

    def loop_lag_max(self) -> float:
        return self.loop.recent_max()

    def families(self) -> Iterator[Metric]:
        yield self.loop.histogram.family("vime_event_loop_lag_seconds",
                                         f"How late the daemon's event loop woke from a {LOOP_TICK:g} s sleep")
        yield GaugeMetricFamily("vime_event_loop_lag_max_seconds",
                                f"The event loop's largest lag over the last {LAG_WINDOW:g} s",
                                value=self.loop.recent_max())
        yield GaugeMetricFamily("vime_watchdog_timeout_seconds",
                                "systemd's watchdog timeout (WATCHDOG_USEC; 0: no watchdog)",
                                value=self.watchdog_timeout or 0.0)
        yield GaugeMetricFamily("vime_watchdog_lateness_seconds",
                                f"How late the latest-sent watchdog ping over the last {LAG_WINDOW:g} s went out "
                                "(systemd kills the daemon past half the timeout; 0: no watchdog)",
                                value=self.watchdog.recent_max())
        yield GaugeMetricFamily("vime_started", "1 once every engine's first start has concluded (READY=1)",
                                value=1 if self.started else 0)
