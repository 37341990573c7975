"""The daemon's view of itself (supervisor/selfwatch.py): a blocked event loop shows as lag, the
window forgets old lag, and the probes' verdicts (supervisor/healthz.py)."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, generate_latest

from vime.supervisor import healthz
from vime.supervisor.selfwatch import LagMeter, SelfWatch


async def test_a_blocking_call_on_the_loop_shows_as_lag():
    meter = LagMeter()
    task = asyncio.create_task(meter.run(0.01))
    await asyncio.sleep(0.05)
    time.sleep(0.3)  # blocks the loop, as a synchronous call in a coroutine would
    await asyncio.sleep(0.05)
    task.cancel()
    assert 0.25 <= meter.recent_max() < 2.0
    assert sum(meter.histogram.counts) >= 5  # every tick is counted, late or not


def test_the_window_forgets_old_lag_and_keeps_the_largest_recent():
    now = [0.0]
    meter = LagMeter(clock=lambda: now[0], window=60.0)
    meter.record(2.0, at=0.0)
    meter.record(0.5, at=30.0)
    assert meter.recent_max() == 2.0
    now[0] = 61.0
    assert meter.recent_max() == 0.5
    now[0] = 91.0
    assert meter.recent_max() == 0.0


def test_families_with_and_without_systemds_watchdog():
    def text(w: SelfWatch) -> str:
        reg = CollectorRegistry(auto_describe=False)
        reg.register(type("C", (), {"collect": lambda self: w.families()})())
        return generate_latest(reg).decode()

    assert "vime_watchdog_timeout_seconds 0.0" in text(SelfWatch(None))
    on = SelfWatch(watchdog_interval=15.0)
    on.started = True
    out = text(on)
    assert "vime_watchdog_timeout_seconds 30.0" in out and "vime_started 1.0" in out
    assert 'vime_event_loop_lag_seconds_bucket{le="+Inf"} 0.0' in out


def test_probe_verdicts():
    assert healthz.live(0.2)[0] is True
    assert healthz.startup(False) == (False, "first starts in progress: not every engine's first start has concluded")
    assert healthz.ready(False, 4, 1)[0] is False  # not before the first fleet, whatever is routable
    assert healthz.ready(True, 1, 2) == (False, "below min_healthy: 1 routable engines, min_healthy 2")
    assert healthz.ready(True, 2, 2)[0] is True
