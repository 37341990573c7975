"""The daemon's one owner of tasks: spawned tasks are kept until they end, a failure is logged,
and closing cancels and awaits whatever is left."""

from __future__ import annotations

import asyncio

from vime.supervisor.tasks import TaskSet, cancel_and_wait


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
