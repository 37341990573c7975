"""The router's one owner in the daemon ([router]): the feed (feed.py), the spawned router
(child.py, with router.spawn) and the HTTP session to the router's admin API (docs/router.md).

Built at the composition root (daemon.py) and handed, typed, to whoever needs it: the fleet
asks it to settle and drain (fleet.RouterGate), the journal records its child, status and the
metrics read it. Started once the engines' runners exist: the feed follows the routable set
from the first change on, and the child is started before the feed's first reconcile.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

import aiohttp
import structlog
from prometheus_client.core import Metric

from ..config import Config
from ..events import EventBus
from ..tasks import TaskSet
from . import make_router
from .base import RouterError
from .child import RouterChild
from .feed import RouterFeed

if TYPE_CHECKING:
    from ..engine.runner import EngineRunner
    from ..fleet import Fleet

__all__ = ["RouterLink"]

log = structlog.get_logger("vime.router")


class RouterLink:
    def __init__(self, cfg: Config, emit: Callable[..., None], persist: Callable[[], None]):
        assert cfg.router is not None
        self.cfg, self.rcfg = cfg, cfg.router
        # [router] spawn: the router runs as our child, journaled and adopted like an engine.
        self.child: RouterChild | None = RouterChild(cfg, emit, persist) if cfg.router.spawn else None
        self.feed: RouterFeed | None = None  # made by start()
        self._session: aiohttp.ClientSession | None = None  # to the router (its token, not the engines' key)
        self._engines: aiohttp.ClientSession | None = None  # the daemon's to the engines: a drain's /pause

    def start(self, fleet: Fleet, bus: EventBus, engines: aiohttp.ClientSession, tasks: TaskSet) -> None:
        """The feed follows the routable set from the first change on. Its own session: the
        engines' API key is not the router's token."""
        rcfg = self.rcfg
        self._engines = engines
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=8))
        router = make_router(rcfg.kind, rcfg.url, self._session, worker_type=rcfg.worker_type, token=rcfg.token)
        self.feed = RouterFeed(fleet, rcfg, router)
        bus.add_listener(self.feed)
        child = self.child
        if child is not None:  # started now, before the feed's first reconcile
            async def answers() -> bool:
                try:
                    await router.workers(1.0)
                    return True
                except RouterError:
                    return False

            child.answers = answers
            child.on_up = self.feed.refill
            child.start(tasks)
        log.info("router.feeding", kind=rcfg.kind, url=rcfg.url, observe_only=rcfg.observe_only,
                 prune_unknown=rcfg.prune_unknown, period=rcfg.period)

    async def answered(self, bound: float) -> bool:
        """The spawned router has answered (at most `bound` s); True at once when none is spawned."""
        return self.child is None or await self.child.answered(bound)

    # -- what the fleet asks (fleet.RouterGate) --------------------------------------------

    def drains(self) -> bool:
        """A planned stop takes the engine out of the router first: the feed runs and may
        change the router's list (observe-only changes nothing, so it pauses nothing either)."""
        return self.feed is not None and not self.rcfg.observe_only

    @property
    def remove_timeout(self) -> float:
        return self.rcfg.remove_timeout

    async def settle(self) -> list[str]:
        return [] if self.feed is None else await self.feed.settle()

    def open(self) -> bool:
        """The feed runs and its session to the router is still open (not after the close)."""
        return self.feed is not None and self._session is not None and not self._session.closed

    async def drain(self, runner: EngineRunner) -> str:
        """Out of the router, then the engine's requests in flight end (RouterFeed.drain)."""
        assert self.feed is not None
        engines = self._engines if self._engines is not None and not self._engines.closed else None
        return await self.feed.drain(runner, engines)

    def release(self, runner: EngineRunner) -> None:
        if self.feed is not None:
            self.feed.release(runner)

    # -- the journal, status and the metrics -----------------------------------------------

    def journal_entry(self) -> dict[str, Any] | None:
        return self.child.journal_entry() if self.child is not None else None

    def status(self) -> dict[str, Any] | None:
        if self.feed is None:
            return None
        out = self.feed.status()
        if self.child is not None:
            out["process"] = self.child.status()
        return out

    def families(self) -> Iterator[Metric]:
        if self.feed is not None:
            yield from self.feed.families()
            if self.child is not None:
                yield from self.child.families()

    # -- the end ---------------------------------------------------------------------------

    async def detach(self) -> None:
        """A reload: the spawned router is left running for the next image to adopt."""
        if self.child is not None:
            await self.child.detach()

    async def stop(self) -> None:
        """The daemon's shutdown, after the engines (every one out of its list): the removals
        in flight are answered, then the spawned router is stopped. The feed's task ends first."""
        if self.child is None:
            return
        if self.feed is not None:
            await self.feed.settle()
        await self.child.stop()

    async def close(self) -> None:
        if self.feed is not None:
            await self.feed.close()
        if self._session is not None:
            await self._session.close()
