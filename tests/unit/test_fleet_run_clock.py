"""harness/fleet_run.py's fault clock stops at the work's end: a fault due after it is never
struck (the run leaves it out of its injections, so the daemon's restart of it would count as
a false restart), and a strike under way then is finished and recorded. The strikes here are a
subclass's (no process is killed, no engine asked); the clock and its recording are the run's."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from vime.harness.fault_clock import ScheduledFault
from vime.harness.fleet_plan import Workload, policies
from vime.harness.fleet_run import FleetRun


class Recording(FleetRun):
    """Strikes that only note what they were asked; a hang takes `hang_s` to land."""

    hang_s = 0.0

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.struck: list[tuple[str, str]] = []

    def _kill(self, name: str) -> None:
        self.struck.append(("kill", name))

    async def _emulator_fault(self, session, name: str, fault: str) -> None:
        await asyncio.sleep(self.hang_s)
        self.struck.append((fault, name))
        return None


def run_of(tmp_path, schedule: list[ScheduledFault]) -> Recording:
    w = replace(Workload(), engines=4, scale=1.0)
    return Recording(w, policies(0)["slime"], schedule, 0, tmp_path)


async def clock(run: Recording, stop_after: float) -> float:
    stop = asyncio.Event()
    t0 = time.time()
    task = asyncio.ensure_future(run._inject(None, t0, stop))
    await asyncio.sleep(stop_after)
    stop.set()
    await asyncio.wait_for(task, 5.0)
    return time.time() - t0


def test_no_fault_is_struck_after_the_work_ends(tmp_path) -> None:
    run = run_of(tmp_path, [ScheduledFault(0.05, "kill", (1,), 0), ScheduledFault(30.0, "kill", (2,), 1)])
    took = asyncio.run(clock(run, 0.3))
    assert run.struck == [("kill", "e1")]
    assert [(i.kind, i.engines) for i in run.injections] == [("kill", ("e1",))]
    assert took < 5.0  # the clock woke at the stop, not at the next fault's time


def test_a_strike_under_way_at_the_end_is_finished_and_recorded(tmp_path) -> None:
    run = run_of(tmp_path, [ScheduledFault(0.05, "hang", (3,), 0)])
    run.hang_s = 0.4
    asyncio.run(clock(run, 0.15))  # the stop comes while the hang's request is on its way
    assert run.struck == [("hang", "e3")]
    assert [(i.kind, i.engines) for i in run.injections] == [("hang", ("e3",))]
    assert run.injected and run.injected[0]["kind"] == "hang"
