"""The fleet: every engine's runner, rounds, the current weight version, routing membership.

Decisions that span engines live here: whether a dead engine may restart now (only in a
round gap, unless restart_immediately), which engines are routable (RUNNING or SUSPECT at the
current version), the membership epoch, and the min_healthy floor.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import structlog

from .config import Config
from .fsm import ProbeOutcome, Transition
from .states import State

S = State
log = structlog.get_logger("vime.fleet")


class Subscription:
    """One reader of the event stream. `lost` is set if it fell too far behind."""

    def __init__(self, maxsize: int):
        self.queue: asyncio.Queue = asyncio.Queue(maxsize)
        self.lost = False


class Fleet:
    def __init__(self, cfg: Config, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock
        self.runners: dict[str, Any] = {}  # name -> EngineRunner (engine.py imports us)
        self.current_version: str | None = None
        self.checkpoint: str | None = None
        self.round: int | None = None  # last round started
        self.round_open = False
        self.epoch = 0
        self._routable: frozenset[str] = frozenset()
        self._floor_armed = False  # the floor counts once the fleet first reached it
        self._below_floor = False
        self._subscribers: set[Subscription] = set()
        self.started_at = time.time()

    # -- events ----------------------------------------------------------------------------

    def subscribe(self, maxsize: int = 10000) -> "Subscription":
        sub = Subscription(maxsize)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: "Subscription") -> None:
        self._subscribers.discard(sub)

    def emit(self, kind: str, **fields: Any) -> None:
        event = {"event": kind, "ts": time.time(), **fields}
        for sub in list(self._subscribers):
            try:
                sub.queue.put_nowait(event)
            except asyncio.QueueFull:  # a stalled reader loses its stream, not our memory
                sub.lost = True
                self._subscribers.discard(sub)

    def on_transition(self, t: Transition) -> None:
        level = log.warning if t.to_state in (S.UNHEALTHY, S.FATAL, S.EXITED) else log.info
        level("engine.transition", engine=t.engine, from_state=t.from_state.value,
              to_state=t.to_state.value, reason=t.reason, incarnation=t.incarnation)
        self.emit("transition", engine=t.engine, from_state=t.from_state.value,
                  to_state=t.to_state.value, reason=t.reason, incarnation=t.incarnation)
        self._membership_changed()

    def on_probe(self, runner: Any, outcome: ProbeOutcome) -> None:
        if not outcome.ok:
            log.info("engine.probe_failed", engine=runner.name, detail=outcome.detail)

    # -- routing ---------------------------------------------------------------------------

    def is_routable(self, runner: Any) -> bool:
        fsm = runner.fsm
        return fsm.routable and (self.current_version is None or fsm.weight_version == self.current_version)

    def routable(self) -> list[Any]:
        return [r for r in self.runners.values() if self.is_routable(r)]

    def _membership_changed(self) -> None:
        now = frozenset(r.name for r in self.routable())
        if now != self._routable:
            self._routable = now
            self.epoch += 1
            self.emit("membership", epoch=self.epoch, routable=sorted(now))
        self._check_floor(len(now))

    def _check_floor(self, n: int) -> None:
        floor = self.cfg.min_healthy
        if n >= floor:
            self._floor_armed = True
            if self._below_floor:
                self._below_floor = False
                log.info("fleet.floor_restored", routable=n, min_healthy=floor)
                self.emit("floor_restored", routable=n, min_healthy=floor)
        elif self._floor_armed and not self._below_floor:
            self._below_floor = True
            log.error("fleet.below_min_healthy", routable=n, min_healthy=floor,
                      engines={r.name: r.fsm.state.value for r in self.runners.values()})
            self.emit("floor_breach", routable=n, min_healthy=floor)

    # -- restarts --------------------------------------------------------------------------

    def may_restart(self, runner: Any) -> tuple[bool, str | None]:
        """A dead engine restarts in a round gap; during round N it waits for its end."""
        if not self.cfg.use_fault_tolerance:
            return False, "fault tolerance off: not restarted"
        if self.round_open and not self.cfg.restart_immediately:
            return False, f"restart after round {self.round}"
        return True, None

    def wake_all(self) -> None:
        for r in self.runners.values():
            r.wake()
