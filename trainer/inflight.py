"""An in-flight weight update (async mode): the engines take a new version while requests
stream, in waves, so that the fleet never drops below a serving fraction (0: all at once).

For each wave, for each of its engines at once: the rollout clients hold it (no new attempt
goes to it), it is paused (`mode`, below), the weights are pushed (`push`, the caller's:
weight_sync's sender, a checkpoint reload), `/weight_info` must say the version, `POST /resume`,
and the clients list it at the new version. After the last wave the version is published to
the daemon. With a supervisor client given, each wave is an announced push (`push_begin` of
the wave's engines before it, `push_end` after, its failed engines named; docs/control-socket.md
"Announced pushes"): the daemon excuses their pauses until the push's deadline and, at its end,
reads each one's /weight_info again, so its listing follows the engines wave by wave, before the
publish. What happens to the requests in flight on a paused engine is the mode's (vLLM's
`/pause?mode=`):

- "abort" (default; exact): every request ends with finish reason "abort" and the tokens so
  far; the client continues it from them (trainer/continuation.py) on an engine at its last
  piece's version or newer, the first one back if every other is held; the prefix's KV cache
  is recomputed by that engine's weights, so each piece is what its version alone makes.
- "keep" (PipelineRL's; mixed): the requests freeze and resume on the new weights with the KV
  cache the old ones computed (`/pause?mode=keep&clear_cache=false`: with vLLM 0.32's default
  clear_cache=true a keep resets the caches and preempts the frozen requests, which are then
  recomputed on the new weights: exact, but not a keep). Nothing is recomputed, but the tokens after the update are not
  what either version alone makes: the client splits each such sample where the engine froze
  (the tokens it had read once the engine paused and its streams went quiet) and labels the
  piece after it with `kv_version`, the version whose KV cache it attended to
  (RolloutResult.splits; outcome KEPT on the piece before).
- "wait" (drain): the engine finishes its requests on the old weights first; nothing is cut
  or mixed, and the fleet waits for the longest of them.

An attempt sent just before the hold may reach the engine once it is paused (every mode queues
it until the resume, where it would run on the new weights under the old version's label): it
is aborted, again until no client has an attempt left on the engine, and re-sent elsewhere.

    update = InFlightUpdate([rollout], push=push_into, serving_fraction=0.5, nbytes=model_bytes)
    report = await update.run(7, supervisor=AsyncSupervisorClient())
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import aiohttp

from vime.supervisor.states import VersionRule

from .rollout import RolloutClient
from .rollout_types import Engine

__all__ = ["MODES", "InFlightUpdate", "UpdateReport", "waves"]

Push = Callable[[Engine, int], Awaitable[None]]
MODES = ("abort", "keep", "wait")


def waves(names: Sequence[str], serving_fraction: float) -> list[list[str]]:
    """The engines in waves, in order, each small enough that ceil(serving_fraction x N) serve
    while it updates: 0 updates all at once. ValueError when no wave can keep that floor."""
    if not 0 <= serving_fraction < 1:
        raise ValueError(f"serving_fraction must be in [0, 1) (the share of engines that keep serving during an "
                         f"update), got {serving_fraction!r}")
    n = len(names)
    floor = math.ceil(serving_fraction * n)
    if n and floor >= n:
        raise ValueError(f"serving_fraction {serving_fraction:g} keeps all {n} engine(s) serving: none could be "
                         f"updated; lower it (at most {(n - 1) / n:g} for {n} engines)")
    size = max(1, n - floor)
    return [list(names[i:i + size]) for i in range(0, n, size)]


@dataclass
class UpdateReport:
    """What one update did: its mode and waves, each engine's time from pause to serving again,
    the fewest engines serving at any point, the engines whose update failed (why), and in
    keep mode the requests each engine resumed on the new weights over the old KV cache
    (request id -> output tokens made before the update); with a supervisor, the daemon's
    answer to each wave's push_end (or the error it raised, as text)."""

    version: int
    waves: list[list[str]]
    mode: str = "abort"
    seconds: dict[str, float] = field(default_factory=dict)
    serving_min: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    kept: dict[str, dict[str, int]] = field(default_factory=dict)
    published: Any = None  # the daemon's answer to the publish
    pushes: list[Any] = field(default_factory=list)


class InFlightUpdate:
    """`clients`: the rollout clients sending to these engines (each holds and relists them);
    `engines`: default the first client's routable engines; `push(engine, version)`: puts the
    version's weights into the paused engine; `serving_fraction`: the share that keeps serving
    (waves); `mode`: "abort", "keep" or "wait" (the module docstring); `settle`: keep mode,
    seconds without a token from a frozen engine's streams before its requests' split points
    are read; `timeout`: seconds one engine's pause (a drain included) may take;
    `api_key`: the engines' key, as the rollout client's. Announced to a supervisor (run):
    `nbytes`, the bytes one engine receives; `push_deadline`, seconds a wave may take (its
    engines still paused past it are condemned), default 3 x timeout: a drain, the push and
    the resume."""

    def __init__(self, clients: Sequence[RolloutClient], *, push: Push, engines: Sequence[Engine] | None = None,
                 serving_fraction: float = 0.5, mode: str = "abort", settle: float = 0.2, timeout: float = 60.0,
                 api_key: str | None = None, nbytes: int = 0, push_deadline: float | None = None):
        if not clients:
            raise ValueError("give the rollout clients that send to these engines (they hold and relist them)")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)} (abort + continue, keep the KV cache, "
                             f"wait for the requests to drain), got {mode!r}")
        self.mode, self.settle = mode, settle
        self.clients, self.push, self.timeout = list(clients), push, timeout
        self.engines = list(engines) if engines is not None else list(clients[0].engines)
        waves([e.name for e in self.engines], serving_fraction)  # refused now, not mid-update
        self.serving_fraction = serving_fraction
        self.nbytes = nbytes
        self.push_deadline = 3 * timeout if push_deadline is None else push_deadline
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def run(self, version: int, *, supervisor: Any = None, publish: bool = True) -> UpdateReport:
        """Update every engine to `version` wave by wave, each wave announced to `supervisor`
        (an AsyncSupervisorClient) when given, as a push of its engines; then publish it there
        (unless `publish` is False: the caller publishes). An engine whose update fails is
        resumed as it was and named in `failed`, and in its wave's push_end (its /weight_info
        decides what the daemon makes of it). A refused announcement (an engine in another
        push, an older version) raises before that wave's engines are touched."""
        plan = waves([e.name for e in self.engines], self.serving_fraction)
        report = UpdateReport(version, plan, self.mode, serving_min=len(self.engines))
        by_name = {e.name: e for e in self.engines}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)) as session:
            for wave in plan:
                push = None
                if supervisor is not None:
                    push = await supervisor.push_begin(version, wave, self.nbytes, self.push_deadline)
                for c in self.clients:
                    c.hold(wave)
                report.serving_min = min(report.serving_min, len(self.engines) - len(wave))
                await asyncio.gather(*(self._one(session, by_name[n], version, report) for n in wave))
                if push is not None:
                    report.pushes.append(await self._push_end(supervisor, push, wave, report))
        if supervisor is not None and publish:
            report.published = await supervisor.publish_weights(version)
        return report

    @staticmethod
    async def _push_end(supervisor: Any, push: str, wave: list[str], report: UpdateReport) -> Any:
        """End a wave's announced push, its failed engines named: the daemon's answer, once it
        has read each engine's /weight_info again; an error (the push expired) as its text,
        which leaves the update going (the engines are resumed; the publish reads them)."""
        failed = {n: report.failed[n] for n in wave if n in report.failed}
        try:
            return await supervisor.push_end(push, ok=not failed, failed=failed or None)
        except Exception as e:  # noqa: BLE001 - see the docstring
            return f"push_end {push}: {type(e).__name__}: {e}"

    async def _one(self, session: aiohttp.ClientSession, engine: Engine, version: int, report: UpdateReport) -> None:
        t0 = time.monotonic()
        ok = False
        try:
            read: dict[str, int] = {}
            if self.mode == "keep":  # vLLM 0.32 clears the caches on a keep too unless told not to
                await self._post(session, engine, "/pause?mode=keep&clear_cache=false")
            elif self.mode == "wait":
                await self._post(session, engine, "/pause?mode=wait")  # returns once drained
            if self.mode == "keep":
                read = await self._frozen_at(engine)
            await self._pause_until_clear(session, engine, skip=set(read))
            await self.push(engine, version)
            got = await self._weight_version(session, engine)
            if VersionRule.lag(got, version) != 0:
                raise RuntimeError(f"/weight_info says {got!r} after the push, not {version}")
            if read:  # before the resume: the first token on the new weights is then labelled
                for c in self.clients:
                    c.kept(engine.name, version, read)
                report.kept[engine.name] = read
            ok = True
        except Exception as e:
            report.failed[engine.name] = f"{type(e).__name__}: {e}"
        finally:
            try:
                await self._post(session, engine, "/resume")
            except Exception as e:  # dead or gone: the daemon sees it; the clients' failures report it
                report.failed.setdefault(engine.name, f"resume: {type(e).__name__}: {e}")
                ok = False
            for c in self.clients:
                if ok:
                    c.updated(engine.name, version)
                else:
                    c.released(engine.name)
            report.seconds[engine.name] = round(time.monotonic() - t0, 4)

    async def _frozen_at(self, engine: Engine) -> dict[str, int]:
        """Keep mode, the engine paused: each request in flight on it -> the output tokens the
        clients have read, once its streams have gone `settle` seconds without a token (what
        the engine made before the pause may still be on its way)."""
        def read() -> dict[str, int]:
            return {rid: p.tokens for c in self.clients for rid, p in c.progress().items() if p.engine == engine.name}

        last, quiet_since = read(), time.monotonic()
        deadline = quiet_since + self.timeout
        while time.monotonic() - quiet_since < self.settle:
            await asyncio.sleep(min(0.02, self.settle))
            now = read()
            if now != last:
                last, quiet_since = now, time.monotonic()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{engine.name}'s streams still moved {self.timeout:g}s after its pause (keep)")
        return last

    async def _pause_until_clear(self, session: aiohttp.ClientSession, engine: Engine, skip: set[str]) -> None:
        """Paused with abort (abort mode), again until no client has an attempt on it but those
        in `skip` (keep mode's frozen requests): an attempt sent just before the hold may reach
        the engine after the pause, and would wait there for the resume. In keep and wait mode
        an abort is sent only for such a late attempt (it aborts every request on the engine:
        keep's frozen ones too, which are then continued, not mixed)."""
        deadline = time.monotonic() + self.timeout
        while True:
            late = self._attempts_on(engine, skip)
            if self.mode == "abort" or late:
                await self._post(session, engine, "/pause?mode=abort")
                late = self._attempts_on(engine, skip)
            if not late:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests still in flight on {engine.name} {self.timeout:g}s after its pause")
            await asyncio.sleep(0.02)

    def _attempts_on(self, engine: Engine, skip: set[str]) -> int:
        return sum(1 for c in self.clients for rid, p in c.progress().items() if p.engine == engine.name
                   and rid not in skip)

    async def _post(self, session: aiohttp.ClientSession, engine: Engine, path: str) -> None:
        async with session.post(f"{engine.url}{path}", headers=self._auth) as r:
            if r.status != 200:
                raise RuntimeError(f"{engine.name} answered {path} with HTTP {r.status}: {(await r.text())[:200]}")

    async def _weight_version(self, session: aiohttp.ClientSession, engine: Engine) -> int | str | None:
        async with session.get(f"{engine.url}/weight_info", headers=self._auth) as r:
            body = await r.json(content_type=None)
        raw = body.get("weight_version") if isinstance(body, dict) else None
        return int(raw) if isinstance(raw, str) and raw.isdigit() else raw
