"""A PROTOCOL STAND-IN for vllm-router's admin API (GET/POST /workers, DELETE /workers/URL, as
0.1.17 answers them), served on a thread of its own, for the paths the real binary cannot be
made to show on demand: a POST that the daemon gives up on and that the router still completes
later (vllm-router's POST waits for the worker's /health), a DELETE that fails, a router that
stops answering. What is the real router's (its own health checks, its routing) is tested
against the binary (tests/daemon/test_router_standin.py, tests/engine/test_router_real.py).

    post_delay    seconds a POST waits before it adds the worker; the add happens whether or
                  not the caller is still waiting (as the real router's does)
    fail_deletes  every DELETE answers 503
    fail_next_delete  the next DELETE answers 503 (once)
    hold_deletes  every DELETE waits until this is cleared (after it is recorded in `deletes`)
    hang          every call waits until this is cleared
"""

from __future__ import annotations

import asyncio
import threading
import time
from urllib.parse import unquote

from aiohttp import web

from vime.harness.local_daemon import free_port


class StandinRouter:
    def __init__(self, *, post_delay: float = 0.0) -> None:
        self.post_delay = post_delay
        self.fail_deletes = False
        self.fail_next_delete = False
        self.hold_deletes = False
        self.hang = False
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._workers: list[str] = []
        self._lock = threading.Lock()
        self.posts: list[tuple[float, str]] = []  # (monotonic time received, url)
        self.landed: list[tuple[float, str]] = []  # (monotonic time a POST's add took effect, url)
        self.deletes: list[tuple[float, str]] = []  # (monotonic time received, url)
        self.loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(10), "the stand-in router did not start"

    # -- what the test reads and does (any thread) -------------------------------------------

    def workers(self) -> list[str]:
        with self._lock:
            return list(self._workers)

    def add(self, url: str) -> None:
        """A registration from outside the daemon (an engine or the RL framework)."""
        with self._lock:
            if url not in self._workers:
                self._workers.append(url)

    def close(self) -> None:
        async def down() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
        asyncio.run_coroutine_threadsafe(down(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    # -- the server -------------------------------------------------------------------------

    async def _held(self) -> None:
        while self.hang:
            await asyncio.sleep(0.02)

    def app(self) -> web.Application:
        async def listed(_):
            await self._held()
            return web.json_response({"workers": [{"url": u} for u in self.workers()]})

        async def added(req):
            await self._held()
            url = (await req.json())["url"]
            self.posts.append((time.monotonic(), url))

            async def later() -> None:
                await asyncio.sleep(self.post_delay)
                self.add(url)
                self.landed.append((time.monotonic(), url))

            # Not cancelled with the request: the router finishes an add its caller gave up on.
            await asyncio.shield(asyncio.ensure_future(later()))
            return web.json_response({"status": "ok"})

        async def removed(req):
            await self._held()
            url = unquote(req.match_info["worker"])
            self.deletes.append((time.monotonic(), url))
            while self.hold_deletes:
                await asyncio.sleep(0.02)
            if self.fail_deletes or self.fail_next_delete:
                self.fail_next_delete = False
                return web.json_response({"error": "busy (stand-in)"}, status=503)
            with self._lock:
                if url in self._workers:
                    self._workers.remove(url)
            return web.json_response({"status": "ok"})

        app = web.Application()
        app.router.add_get("/workers", listed)
        app.router.add_post("/workers", added)
        app.router.add_delete("/workers/{worker:.*}", removed)
        return app

    def _serve(self, ready: threading.Event) -> None:
        async def up() -> None:
            self._runner = web.AppRunner(self.app(), access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
            ready.set()

        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(up())
        self.loop.run_forever()


def listed_stretches(samples: list[tuple[float, list[str]]], url: str) -> list[float]:
    """From (time, router list) samples: how long each unbroken stretch listing `url` lasted
    (first sample listing it to the first sample no longer listing it, or the last sample)."""
    out, since = [], None
    for t, listed in samples:
        if url in listed and since is None:
            since = t
        elif url not in listed and since is not None:
            out.append(t - since)
            since = None
    if since is not None:
        out.append(samples[-1][0] - since)
    return out


def listed_after(samples: list[tuple[float, list[str]]], url: str, since: float) -> float:
    """How long `url` stayed listed after `since` (an add that landed then): to the first
    sample at or after it that no longer lists it."""
    for t, listed in samples:
        if t >= since and url not in listed:
            return t - since
    raise AssertionError(f"{url} still listed at the last sample")
