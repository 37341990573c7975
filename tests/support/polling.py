"""Wait for a condition with a deadline: the one polling helper of the suite."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable


def wait_until(pred: Callable[[], Any], timeout: float, what: str = "condition", interval: float = 0.1) -> Any:
    """pred's first true answer, polled every `interval` s; AssertionError naming `what` once
    `timeout` s have passed."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(interval)


async def until(pred: Callable[[], Any], timeout: float, what: str = "condition", interval: float = 0.01) -> Any:
    """wait_until on the running event loop, which keeps serving while it waits."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (got := pred()):
        assert loop.time() < deadline, f"not within {timeout}s: {what}"
        await asyncio.sleep(interval)
    return got
