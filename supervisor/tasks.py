"""Owning the daemon's asyncio tasks: one set per owner, closed in one call.

`TaskSet` is what the daemon's start-up and its components spawn their long-lived and
background tasks into: each task is kept until it ends (no task is lost to the garbage
collector), an exception that ends one is logged, and `aclose()` cancels and awaits whatever is
left. `cancel_and_wait` is the one way to end a single task.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

import structlog

log = structlog.get_logger("vime.tasks")


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel the tasks and wait until they have ended; what they raise is theirs to log.

    A cancellation of the caller itself still propagates."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    if live:
        await asyncio.wait(live)
    for t in live:  # retrieve what they raised, so asyncio does not complain about it later
        if not t.cancelled():
            t.exception()


T = TypeVar("T")


async def within(aw: Awaitable[T], timeout: float | None) -> T:
    """asyncio.wait_for without its Python 3.11 flaw: a cancellation of the caller that comes
    as `aw` completes is never swallowed. (It was: a runner stopping a hung engine went on to
    restart it after the daemon's shutdown had cancelled it, and the shutdown waited forever.)
    asyncio.TimeoutError once `timeout` passes (None: no bound); `aw` is then cancelled and
    awaited, as a caller's cancellation cancels and awaits it too."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # retrieved: the caller's cancellation is what propagates
        raise
    if not done:
        task.cancel()
        await asyncio.wait({task})
        if task.cancelled():
            raise asyncio.TimeoutError
    return task.result()


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Until `event` is set (True) or `timeout` passes (False). Unlike wait_for on Python 3.11,
    a cancellation that arrives as the event is set is never swallowed: a loop waiting here
    ends when its task is cancelled (a lost cancel hung the daemon's shutdown)."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return event.is_set()


async def sleep_until(when: float, clock: Callable[[], float]) -> None:
    """Until `clock()` reads at least `when`. One asyncio.sleep is not enough: uvloop's timers
    count whole milliseconds on a loop time cached per iteration, so about one sleep in five
    ends up to 2 ms before its target by time.monotonic (measured). A push's expiry did: it
    found the push not yet due and never expired it."""
    while (left := when - clock()) > 0:
        await asyncio.sleep(left)


class TaskSet:
    def __init__(self, owner: str):
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task.failed", owner=self.owner, task=task.get_name(), error=repr(task.exception()))

    async def aclose(self, *more: asyncio.Future[Any]) -> None:
        """Cancel and await every task still running (and `more`)."""
        await cancel_and_wait(*self._tasks, *more)
