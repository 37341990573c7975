"""The daemon's one owner of tasks: spawned tasks are kept until they end, a failure is logged,
and closing cancels and awaits whatever is left."""

from __future__ import annotations

import asyncio
import sys

import pytest

from vime.supervisor.tasks import TaskSet, cancel_and_wait, sleep_until, wait_event, within


async def test_aclose_cancels_and_awaits_every_task_left():
    tasks = TaskSet("test")
    ended: list[str] = []

    async def forever(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(name)

    a, b = tasks.spawn(forever("a"), name="a"), tasks.spawn(forever("b"), name="b")
    await asyncio.sleep(0)
    assert len(tasks) == 2
    await tasks.aclose()
    assert a.cancelled() and b.cancelled()
    assert sorted(ended) == ["a", "b"] and len(tasks) == 0


async def test_a_task_that_ends_leaves_the_set_and_a_failure_does_not_propagate():
    tasks = TaskSet("test")

    async def boom() -> None:
        raise RuntimeError("a bug")

    t = tasks.spawn(boom(), name="boom")
    await asyncio.wait([t])
    await asyncio.sleep(0)
    assert len(tasks) == 0
    await tasks.aclose()  # nothing left, nothing raised


async def test_cancel_and_wait_takes_none_and_finished_tasks():
    done = asyncio.ensure_future(asyncio.sleep(0))
    await done
    await cancel_and_wait(None, done)
    slow = asyncio.ensure_future(asyncio.sleep(3600))
    await cancel_and_wait(slow)
    assert slow.cancelled()


async def test_a_loop_on_wait_event_ends_when_cancelled_as_its_event_is_set():
    # asyncio.wait_for on 3.11 returns the event's result instead of raising when the cancel
    # and the set come in one turn: such a loop never ended, and a shutdown awaiting it hung.
    ev = asyncio.Event()
    woken = []

    async def loop() -> None:
        while True:
            woken.append(await wait_event(ev, 10))
            ev.clear()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.01)
    ev.set()
    task.cancel()
    await asyncio.wait({task}, timeout=1)
    assert task.cancelled()
    ev.clear()
    assert await wait_event(ev, 0.01) is False  # a timeout is False, not an error


async def test_within_never_swallows_a_cancel_that_comes_as_its_awaitable_completes():
    # The shutdown hang: a runner in proc.stop (wait_for on the group's end) was cancelled by the
    # daemon's shutdown in the turn the group ended; wait_for returned, the runner restarted
    # the engine, and the shutdown waited for it forever.
    async def cancelled_as_it_completes(wait) -> asyncio.Task:
        fut = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(wait(fut, 10))
        await asyncio.sleep(0.01)
        fut.set_result("gone")
        task.cancel()
        await asyncio.wait({task}, timeout=1)
        return task

    assert (await cancelled_as_it_completes(within)).cancelled()
    if sys.version_info < (3, 12):  # the flaw within() exists for
        assert (await cancelled_as_it_completes(asyncio.wait_for)).result() == "gone"
    # Otherwise as wait_for: the result, a timeout (the awaitable cancelled), no bound with None.
    assert await within(asyncio.sleep(0, "ok"), 1) == "ok"
    slow = asyncio.ensure_future(asyncio.sleep(3600))
    with pytest.raises(asyncio.TimeoutError):
        await within(slow, 0.01)
    assert slow.cancelled()
    assert await within(asyncio.sleep(0.01, "late"), None) == "late"


async def test_sleep_until_waits_out_a_loop_whose_time_is_stale():
    # The loop's timers run on the loop's own time, which may lag the clock a deadline is read
    # on (uvloop caches it per iteration): one asyncio.sleep(when - clock()) then ends early.
    # Stand-in: the clock's first two reads (the deadline, the first delay) are 50 ms ahead.
    loop = asyncio.get_running_loop()

    def stale_for_two_reads():
        reads = 0

        def clock() -> float:
            nonlocal reads
            reads += 1
            return loop.time() + (0.05 if reads <= 2 else 0.0)
        return clock

    # One asyncio.sleep(when - clock()) would sleep 0.1 s from a read 50 ms ahead: 50 ms early.
    clock = stale_for_two_reads()
    when = clock() + 0.1
    await sleep_until(when, clock)
    assert clock() >= when

