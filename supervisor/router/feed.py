"""The router follows the daemon: its worker list is kept equal to the routable set.

A reconcile loop (one task): the desired set is the daemon's routable engines (the fleet's one
rule, Fleet.is_routable: RUNNING or SUSPECT, verified at a weight version the [weights] mode
allows, states.VersionRule: the current one in sync mode, up to max_staleness behind in async), less
those being drained; the actual set is the router's own list. Their diff (router/plan.py, pure)
is applied on every membership change and every `period` (drift repair: a router restarted
empty, a hand edit). Between two, the list is read every `watch` seconds (one GET), and an
engine of ours listed while not routable (one that registered itself, an add the router
finished after our call timed out) is removed at once. Only this daemon's engines' URLs are
added or removed; others are reported as drift, and removed only with `prune_unknown`. A listed
URL is ours under any spelling of its host (`localhost`, `127.0.0.1`, a hostname: each host
resolved once, cached, router/base.HostResolver).

An engine that leaves the routable set is removed at once, outside the loop: its DELETE is sent
in the same event-loop turn that recomputed the set, bounded by `remove_timeout`, retried with
jittered backoff on transient errors only, and never once the engine is routable again. Nothing of the supervision awaits a router call:
a router that is down or hangs is logged, counted, shown in status, and repaired when back.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Iterator

import aiohttp
import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from ..config import RouterConfig
from ..events import Listener
from ..states import Transition
from ..tasks import wait_event
from ..metrics import Histogram
from ..protocol import Event
from .base import HostResolver, Router, RouterError, normalize_url
from .plan import Plan, plan

if TYPE_CHECKING:
    from ..engine.runner import EngineRunner
    from ..fleet import Fleet

log = structlog.get_logger("vime.router")

ATTEMPTS = 3  # per call: the first and two retries on transient errors
REMOVAL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
OPS = ("list", "add", "remove")
# What the daemon keeps true while the router does not answer, and what it cannot (logged and
# evented at the first failed attempt).
UNANSWERED_KEEPS = ("engines are still probed, stopped and restarted; the routable set, status and metrics "
                    "stay exact; each removal is retried until the router answers")
UNANSWERED_CANNOT = ("the router's list cannot change: an engine that left the routable set stays listed "
                     "(and routed to), one that joined gets no traffic, until the router answers")


class Superseded(Exception):
    """A call not sent: what it was for no longer holds (a removal's engine is routable again)."""


def _transient(e: BaseException) -> bool:
    return isinstance(e, RouterError) and e.transient


class RouterFeed(Listener):
    def __init__(self, fleet: Fleet, cfg: RouterConfig, router: Router, *,
                 clock: Callable[[], float] = time.monotonic):
        self.fleet, self.cfg, self.router, self.clock = fleet, cfg, router, clock
        self.desired: frozenset[str] = frozenset()  # normalized URLs routable now
        self.held: set[str] = set()  # being drained: out of the router whatever the set says
        self.state = "starting"  # in_sync, drift, unreachable (observing: drift is only reported)
        self.error: str | None = None  # the last call's failure, until one succeeds
        self.failing: str | None = None  # an attempt failed and the call is being retried
        self.listed: tuple[str, ...] | None = None  # the router's list after the last reconcile
        self.last: Plan | None = None  # what the last reconcile found
        self.checked_at: float | None = None  # wall time of the last answered GET /workers
        self.calls: Counter[tuple[str, str]] = Counter()
        self.removal_time = Histogram(REMOVAL_BUCKETS)  # left the routable set -> router said removed
        self._wake = asyncio.Event()
        self._pending: set[asyncio.Task[Any]] = set()
        self._removing: dict[asyncio.Task[Any], str] = {}  # removals of engines that left the set -> URL
        self.resolver = HostResolver()
        self.same: dict[str, str] = {}  # listed URL (normalized) -> ours it names under another host spelling
        self.unanswered = False  # an attempt failed and no call has succeeded since (told once)

    def refill(self) -> None:
        """The spawned router answers again (restarted empty): reconcile now, not after `period`."""
        self._wake.set()

    # -- the sets --------------------------------------------------------------------------

    def own(self) -> dict[str, str]:
        """normalized URL -> engine name, for every engine of this daemon's."""
        return {normalize_url(r.spec.base_url): r.name for r in self.fleet.runners.values()}

    def _desired_now(self) -> frozenset[str]:
        return frozenset(normalize_url(r.spec.base_url) for r in self.fleet.routable()) - self.held

    def _key(self, listed_url: str) -> str:
        """A listed URL as the engine of ours it names (normalized), under any host spelling."""
        n = normalize_url(listed_url)
        return self.same.get(n, n)

    async def _read(self) -> tuple[list[str], dict[str, str]]:
        """The router's list (RouterError if it could not be read), and which of its URLs name
        an engine of ours under another host spelling."""
        listed = await self._call("list")
        self.checked_at = time.time()
        self.same = await self.resolver.same_workers(listed, self.own())
        return listed, self.same

    def _listed_out(self, listed: list[str]) -> list[str]:
        """Listed spellings of our engines that are not desired now (the routing rule's verdict
        as of this turn)."""
        own = self.own()
        return [u for u in listed if self._key(u) in own and self._key(u) not in self.desired]

    # -- told by the bus -------------------------------------------------------------------

    def on_membership(self, routable: frozenset[str]) -> None:
        self._changed()

    def on_transition(self, t: Transition) -> None:
        self._wake.set()  # an own engine that registered itself is looked for sooner

    def _changed(self) -> None:
        new = self._desired_now()
        gone = self.desired - new
        self.desired = new
        for key in sorted(gone):
            # Ours as spelled, and any other spelling of it the router listed at the last read.
            spellings = [key] + sorted(u for u in self.listed or () if self._key(u) == key and normalize_url(u) != key)
            for url in spellings:
                task = self._spawn(self._remove(url, since=self.clock(), why="left the routable set"))
                if task is not None:
                    self._removing[task] = url
                    task.add_done_callback(lambda t: self._removing.pop(t, None))
        self._wake.set()

    def _spawn(self, coro: Any) -> asyncio.Task[Any] | None:
        if self.cfg.observe_only:
            coro.close()
            return None
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def settle(self) -> list[str]:
        """Wait for the removals under way, at most remove_timeout: a publish is answered once
        the engines it made STALE are out of the router, so a trainer that sends its next
        rollout through the router the moment the publish returns never reaches one. A
        removal still retrying past that goes on in the background. The engines whose removal
        the router has not confirmed, by name."""
        if not self._removing:
            return []
        own, pending = self.own(), dict(self._removing)
        await asyncio.wait(list(pending), timeout=self.cfg.remove_timeout)
        return sorted(own.get(self._key(url), url) for task, url in pending.items()
                      if not task.done() or task.cancelled() or task.exception() is not None or not task.result())

    # -- calls -----------------------------------------------------------------------------

    async def _call(self, op: str, *args: Any, still: Callable[[], bool] | None = None) -> Any:
        """One router call, retried on transient errors with jittered backoff; RouterError if
        it failed for good. Each attempt is bounded (remove_timeout for a removal). `still`,
        asked before each attempt: False raises Superseded instead of sending it (a removal
        whose engine came back between two attempts must not land after its re-add)."""
        timeout = self.cfg.remove_timeout if op == "remove" else self.cfg.timeout
        methods: dict[str, Callable[..., Any]] = {"list": self.router.workers, "add": self.router.add,
                                                  "remove": self.router.remove}
        method = methods[op]
        tries = 0
        try:
            async for attempt in AsyncRetrying(retry=retry_if_exception(_transient), reraise=True,
                                               stop=stop_after_attempt(ATTEMPTS),
                                               wait=wait_random_exponential(multiplier=0.1, max=2.0),
                                               before_sleep=lambda st: self._attempt_failed(op, st)):
                with attempt:
                    if still is not None and not still():
                        raise Superseded(f"{op} {' '.join(map(str, args))}")
                    tries += 1
                    result = await method(*args, timeout)
        except RouterError as e:
            self.calls[(op, "error")] += 1
            self._unanswered(op, e, attempt=tries)
            if self.error != str(e):
                log.warning("router.call_failed", op=op, error=str(e), transient=e.transient,
                            router=self.router.url, action="supervision goes on; retried on the next change "
                                                           f"or within {self.cfg.period:g}s")
                self.fleet.emit(Event.ROUTER_ERROR, op=op, error=str(e), router=self.router.url, attempt=tries,
                                final=True)
            self.error, self.failing = str(e), None
            raise
        self.calls[(op, "ok")] += 1
        self.error = self.failing = None
        if self.unanswered:
            self.unanswered = False
            log.info("router.answering", op=op, router=self.router.url)
        return result

    def _attempt_failed(self, op: str, state: Any) -> None:
        """An attempt failed and another follows: shown at once (status, vime_router_up), not
        only once every attempt has (a hung router costs each attempt its whole timeout)."""
        if state.outcome is not None and state.outcome.failed:
            e = state.outcome.exception()
            self.failing = str(e)
            if isinstance(e, RouterError):
                self._unanswered(op, e, attempt=state.attempt_number)

    def _unanswered(self, op: str, e: RouterError, attempt: int) -> None:
        """The first attempt the router did not answer (refused, reset, timed out) since it last
        did: logged and evented now, with what holds meanwhile, not once every attempt of a call
        has failed (a hung router costs each attempt its whole timeout)."""
        if self.unanswered or e.answered:
            return
        self.unanswered = True
        log.warning("router.not_answering", op=op, error=str(e), attempt=attempt, router=self.router.url,
                    keeps=UNANSWERED_KEEPS, cannot=UNANSWERED_CANNOT)
        self.fleet.emit(Event.ROUTER_ERROR, op=op, error=str(e), router=self.router.url, attempt=attempt,
                        final=False, keeps=UNANSWERED_KEEPS, cannot=UNANSWERED_CANNOT)

    def _meant_out(self, url: str) -> Callable[[], bool]:
        return lambda: self._key(url) not in self.desired

    async def _remove(self, url: str, *, since: float | None = None, why: str) -> bool:
        engine = self.own().get(self._key(url))
        try:
            await self._call("remove", url, still=self._meant_out(url))
        except RouterError:
            self._wake.set()  # the loop tries again within its period
            return False
        except Superseded:
            log.info("router.remove_superseded", engine=engine, url=url, router=self.router.url,
                     why="routable again before the removal was sent: left listed")
            return False
        if since is not None:
            self.removal_time.observe(self.clock() - since)
        log.info("router.removed", engine=engine, url=url, why=why, router=self.router.url)
        self.fleet.emit(Event.ROUTER, action="removed", engine=engine, url=url, why=why)
        return True

    async def _add(self, url: str) -> bool:
        engine = self.own().get(self._key(url))
        try:
            # Each attempt only while it is routable: a retry never lists one that left meanwhile.
            await self._call("add", url, still=lambda: normalize_url(url) in self.desired)
        except Superseded:
            return False
        except RouterError as e:
            if e.transient:
                # vllm-router's POST waits for the worker's /health: the router may have added
                # it all the same, or add it later. Read its list now; one that lands later is
                # the watch's (within `watch`).
                await self._out_if_listed(url)
            return False
        if normalize_url(url) not in self.desired:  # it left while the POST ran: out again
            await self._remove(url, why="left the routable set while it was being added")
            return False
        log.info("router.added", engine=engine, url=url, router=self.router.url)
        self.fleet.emit(Event.ROUTER, action="added", engine=engine, url=url, why="routable: verified at a version the mode allows")
        return True

    async def _out_if_listed(self, url: str) -> None:
        """After an add that failed: if the router lists it while it is not routable, out."""
        try:
            listed, _ = await self._read()
        except RouterError:
            return
        key = normalize_url(url)
        gone = [u for u in listed if self._key(u) == key and key not in self.desired]
        await asyncio.gather(*(self._remove(u, why="listed after an add that failed, not routable") for u in gone))

    # -- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            self._wake.clear()
            await self.reconcile()
            # Until the next reconcile (woken, or `period`): the list watched every `watch`.
            until = self.clock() + self.cfg.period
            while (left := until - self.clock()) > 0:
                if await wait_event(self._wake, min(self.cfg.watch, left)):
                    break
                if self.clock() < until:
                    await self.watch_once()

    async def watch_once(self) -> list[str]:
        """One read of the router's list; engines of ours listed while not routable (registered
        by themselves, or added by a POST the router finished late) are removed now. The
        removed spellings."""
        if self.cfg.observe_only:
            return []
        self.desired = self._desired_now()
        try:
            listed, _ = await self._read()
        except RouterError:
            return []
        out = self._listed_out(listed)
        if not out:
            return []
        results = await asyncio.gather(*(self._remove(u, why="not routable") for u in out))
        return [u for u, ok in zip(out, results) if ok]

    async def reconcile(self) -> Plan | None:
        """Read the router's list and make it match; None when the router could not be read."""
        self.desired = self._desired_now()
        try:
            listed, same = await self._read()
        except RouterError:
            self._set_state("unreachable")
            return None
        own = self.own()
        # Desired URLs are sent as the engines' own base URLs.
        by_norm = {normalize_url(r.spec.base_url): r.spec.base_url for r in self.fleet.runners.values()}
        p = plan([by_norm[u] for u in self.desired], listed, own, prune_unknown=self.cfg.prune_unknown, same=same)
        if self.last is None or set(p.unknown) != set(self.last.unknown):
            if p.unknown:
                log.warning("router.unknown_workers", urls=list(p.unknown[:20]), count=len(p.unknown),
                            router=self.router.url,
                            action="removed" if self.cfg.prune_unknown and not self.cfg.observe_only
                            else "left alone: not this daemon's engines (set router.prune_unknown to remove)")
            self.fleet.emit(Event.ROUTER_DRIFT, unknown=list(p.unknown), missing=list(p.add),
                            extra=list(p.remove))
        self.last = p
        now = set(listed)
        if not self.cfg.observe_only:
            adds = [self._add(u) for u in p.add]
            removes = [self._remove(u, why="not routable" if self._key(u) in own else "unknown: pruned")
                       for u in p.remove]
            results = await asyncio.gather(*adds, *removes)
            for u, ok in zip(p.add, results[:len(adds)]):
                if ok:
                    now.add(u)
            for u, ok in zip(p.remove, results[len(adds):]):
                if ok:
                    now.discard(u)
        self.listed = tuple(sorted(now))
        after = plan([by_norm[u] for u in self.desired], now, own, prune_unknown=self.cfg.prune_unknown, same=same)
        self._set_state("in_sync" if after.in_sync else "drift")
        return p

    def _set_state(self, state: str) -> None:
        if state == self.state:
            return
        old, self.state = self.state, state
        level = log.warning if state == "unreachable" else log.info
        level("router.state", state=state, previous=old, router=self.router.url, error=self.error)
        self.fleet.emit(Event.ROUTER_STATE, state=state, previous=old, router=self.router.url, error=self.error)

    # -- a planned stop --------------------------------------------------------------------

    async def drain(self, runner: EngineRunner, session: aiohttp.ClientSession | None) -> str:
        """Before a planned stop: out of the router first, then vLLM's POST /pause?mode=wait
        lets the requests in flight end (at most drain_timeout). What it did, for the log."""
        url = normalize_url(runner.spec.base_url)
        self.held.add(url)
        self._changed()
        said = "removed from the router"  # what the router answered, reported as such
        if not self.cfg.observe_only:
            try:
                await self._call("remove", runner.spec.base_url, still=self._meant_out(runner.spec.base_url))
            except RouterError as e:
                said = f"not removed from the router ({e}); retried in the background"
                log.warning("router.drain_not_removed", engine=runner.name, error=str(e))
            except Superseded:  # released before the removal went out: it serves on
                said = "left in the router: routable again before the removal was sent"
        if session is None or not runner.spec.spawned or runner.pid is None:
            return said  # an attached engine is not ours to pause
        started = self.clock()
        why = ""
        try:
            async with session.post(runner.spec.base_url + "/pause", params={"mode": "wait"},
                                    timeout=aiohttp.ClientTimeout(total=self.cfg.drain_timeout)) as resp:
                await resp.read()
                ok = resp.status == 200
                why = "" if ok else f"/pause answered {resp.status}"
        except asyncio.CancelledError:
            # The stop was abandoned mid-drain (the control server shutting down for a reload,
            # a client gone): the engine is not stopped, so it must not be left paused.
            await asyncio.shield(self._resume(runner, session))
            raise
        except asyncio.TimeoutError:
            ok, why = False, f"requests still running after drain_timeout ({self.cfg.drain_timeout:g}s)"
        except (aiohttp.ClientError, OSError) as e:
            ok, why = False, f"/pause failed: {e or type(e).__name__}"
        took = self.clock() - started
        log.info("router.drained", engine=runner.name, drained=ok, seconds=round(took, 3),
                 drain_timeout=self.cfg.drain_timeout, why=why or None)
        return f"{said}; " + (f"drained in {took:.1f}s" if ok else f"not drained: {why}, after {took:.1f}s")

    async def _resume(self, runner: EngineRunner, session: aiohttp.ClientSession) -> None:
        try:
            async with session.post(runner.spec.base_url + "/resume",
                                    timeout=aiohttp.ClientTimeout(total=self.cfg.remove_timeout)) as resp:
                await resp.read()
            log.warning("router.drain_cancelled", engine=runner.name, resumed=resp.status == 200)
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
            log.warning("router.drain_cancelled", engine=runner.name, resumed=False, error=str(e) or type(e).__name__)

    def release(self, runner: EngineRunner) -> None:
        """After the stop: the engine rejoins once it is routable again."""
        self.held.discard(normalize_url(runner.spec.base_url))
        self._changed()

    async def close(self) -> None:
        for task in list(self._pending):
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)

    # -- what status and metrics read ------------------------------------------------------

    def status(self) -> dict[str, Any]:
        p, own = self.last, self.own()
        listed = self.listed or ()
        # Sets, once: a router shared by many daemons can list thousands of workers, and this
        # runs at every status call and every scrape.
        keys = [self._key(u) for u in listed]
        key_set, listed_set = set(keys), set(listed)
        return {
            "kind": self.router.kind,
            "url": self.router.url,
            "state": self.state,
            "observe_only": self.cfg.observe_only,
            "workers": len(listed),
            "ours": sorted(own[k] for k in keys if k in own),
            "missing": [] if p is None else sorted(own.get(normalize_url(u), u) for u in p.add
                                                   if normalize_url(u) not in key_set),
            "extra": sorted(own[k] for k in keys if k in own and k not in self.desired),
            "unknown": [] if p is None else sorted(u for u in p.unknown if u in listed_set),
            "error": self.error or self.failing,
            "checked_at": self.checked_at,
        }

    def families(self) -> Iterator[Metric]:
        st = self.status()
        up = self.state not in ("unreachable", "starting") and self.error is None and self.failing is None
        yield GaugeMetricFamily("vime_router_up", "1 if the router answered the last call", value=1 if up else 0)
        yield GaugeMetricFamily("vime_router_in_sync", "1 if the router lists exactly the routable engines",
                                value=1 if up and self.state == "in_sync" else 0)
        yield GaugeMetricFamily("vime_router_workers", "Workers the router lists", value=st["workers"])
        yield GaugeMetricFamily("vime_router_unknown_workers", "Workers the router lists that are not ours",
                                value=len(st["unknown"]))
        yield GaugeMetricFamily("vime_router_missing_workers", "Routable engines the router does not list",
                                value=len(st["missing"]))
        calls = CounterMetricFamily("vime_router_calls", "Router admin calls, by operation and result",
                                    labels=["op", "result"])
        for op in OPS:
            for result in ("ok", "error"):
                calls.add_metric([op, result], self.calls.get((op, result), 0))
        yield calls
        yield self.removal_time.family("vime_router_removal_seconds",
                                       "From an engine leaving the routable set to the router removing it")
