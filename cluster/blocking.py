"""The cluster client for plain (threaded) trainer code, and for asyncio code on any loop.

    with ClusterClient(socket_path=SOCK) as sup:          # places the agents, follows the nodes
        with sup.round(412):
            urls = [e["url"] for e in sup.routable_engines()["engines"]]
        agent = ResyncAgent(sup, weights).start()          # the sync agent, unchanged
        async with RolloutClient(sup.aio) as rollout: ...  # the same agents, from asyncio

One AsyncClusterClient runs on a private event loop thread; every method here is a call into
it, so the trainer's threads and its asyncio loop share one set of agents.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
from typing import Any, AsyncIterator, Iterator

from vime.supervisor.protocol import Role

from .client import CLUSTER_VERBS, AsyncClusterClient
_END = object()


class ClusterClient:
    """Blocking facade over AsyncClusterClient (same arguments; see there). `aio` is the same
    client for asyncio code on another loop. close() ends the event streams open now (as
    SupervisorClient.close() does); shutdown() ends everything and kills the agents."""

    def __init__(self, *args: Any, connect_timeout_s: float = 60.0, **kwargs: Any):
        self._owner = True
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vime-cluster-client", daemon=True)
        self._thread.start()
        self._client = AsyncClusterClient(*args, **kwargs)
        self._streams: set[threading.Event] = set()
        self._pumps: set[Any] = set()
        try:
            self._run(self._client.connect(connect_timeout_s))
        except BaseException:
            self.shutdown()
            raise
        self.aio = _AsyncFacade(self)

    def sibling(self) -> "ClusterClient":
        """Another facade on the same agents with event streams of its own: its close() ends
        only those (a ResyncAgent's stop() closes its client), its shutdown() nothing shared."""
        other = object.__new__(ClusterClient)
        other._owner = False
        other._loop, other._thread, other._client = self._loop, self._thread, self._client
        other._streams, other._pumps = set(), set()
        other.aio = _AsyncFacade(other)
        return other

    def _run(self, coro: Any) -> Any:
        if self._client._shut or not self._loop.is_running():
            coro.close()
            raise RuntimeError("this ClusterClient is shut down (shutdown() was called): make a new one")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __getattr__(self, name: str) -> Any:
        if name in CLUSTER_VERBS:
            verb = getattr(self._client, name)

            @functools.wraps(verb)
            def call(*args: Any, **kwargs: Any) -> Any:
                return self._run(verb(*args, **kwargs))
            return call
        raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")

    def __enter__(self) -> "ClusterClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    @property
    def view(self) -> Any:
        return self._client.view

    def nodes(self) -> dict[str, dict[str, Any]]:
        return self._loop_call(self._client.nodes)

    def _loop_call(self, fn: Any) -> Any:
        async def run() -> Any:
            return fn()
        return self._run(run())

    @contextlib.contextmanager
    def round(self, n: int) -> Iterator[dict[str, Any]]:
        result = self._run(self._client.start_round(n))
        try:
            yield result
        finally:
            self._run(self._client.end_round(n))

    def events(self, *, role: Role | str = Role.OBSERVER, keepalives: bool = False) -> Iterator[dict[str, Any]]:
        """The merged event stream (AsyncClusterClient.events), read from a plain thread."""
        out: queue.Queue = queue.Queue()  # bounded by the client's own queue (MAX_QUEUED) upstream
        done = threading.Event()
        self._streams.add(done)

        async def pump() -> None:
            try:
                async with contextlib.aclosing(self._client.events(role=role, keepalives=keepalives)) as stream:
                    async for ev in stream:
                        out.put(ev)
                        if done.is_set():
                            return
            finally:
                out.put(_END)

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        self._pumps.add(fut)
        try:
            while not done.is_set():
                try:
                    ev = out.get(timeout=0.5)
                except queue.Empty:
                    continue
                if ev is _END:
                    return
                yield ev
        finally:
            done.set()
            self._streams.discard(done)
            fut.cancel()
            self._pumps.discard(fut)

    def close(self) -> None:
        for done in list(self._streams):
            done.set()

    def shutdown(self) -> None:
        self.close()
        for fut in list(self._pumps):
            fut.cancel()
        if not self._owner:
            return
        if self._loop.is_running():
            for fut in list(self._pumps):
                fut.cancel()
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class _AsyncFacade:
    """The cluster client's verbs as coroutines for a loop other than its own (RolloutClient)."""

    def __init__(self, owner: ClusterClient):
        self._owner = owner

    def __getattr__(self, name: str) -> Any:
        if name not in CLUSTER_VERBS:
            raise AttributeError(name)
        verb = getattr(self._owner._client, name)

        @functools.wraps(verb)
        async def call(*args: Any, **kwargs: Any) -> Any:
            owner = self._owner
            if owner._client._shut or not owner._loop.is_running():
                raise RuntimeError("this ClusterClient is shut down (shutdown() was called): make a new one")
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(verb(*args, **kwargs), owner._loop))
        return call

    async def events(self, *, role: Role | str = Role.OBSERVER, keepalives: bool = False
                     ) -> AsyncIterator[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        owner = self._owner

        async def pump() -> None:
            try:
                async with contextlib.aclosing(owner._client.events(role=role, keepalives=keepalives)) as stream:
                    async for ev in stream:
                        loop.call_soon_threadsafe(out.put_nowait, ev)
            finally:
                with contextlib.suppress(RuntimeError):  # our loop closed first
                    loop.call_soon_threadsafe(out.put_nowait, _END)

        fut = asyncio.run_coroutine_threadsafe(pump(), owner._loop)
        try:
            while True:
                ev = await out.get()
                if ev is _END:
                    return
                yield ev
        finally:
            fut.cancel()
