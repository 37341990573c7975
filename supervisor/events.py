"""The daemon's event bus: what happened, told to readers of the control socket's stream and to
the components inside the daemon (the events: docs/operations.md).

`Subscription`s (the socket's event streams, the journal follower) get every event as a dict on
a bounded queue; one that falls too far behind loses its stream, never our memory. `Listener`s
(the statistics, the fleet, the sync and push coordinators, the router feed), wired at start-up
in order, are called synchronously on every engine transition, heartbeat, routing change, round
boundary and publication: one caller instead of components calling each other.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from .states import ProbeOutcome, Transition


class Subscription:
    """One reader of the event stream. `lost` is set if it fell too far behind."""

    def __init__(self, maxsize: int):
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize)
        self.lost = False


class Listener:
    """A component told of what happens in the fleet; each hook does nothing unless overridden."""

    def on_transition(self, t: Transition) -> None:
        pass

    def on_probe(self, engine: str, outcome: ProbeOutcome) -> None:
        pass

    def on_joined_routing(self, engines: frozenset[str], at: float) -> None:
        pass

    def on_membership(self, routable: frozenset[str]) -> None:
        """The routable set changed (told in the same turn that recomputed it)."""

    def on_round_started(self, n: int) -> None:
        pass

    def on_round_ended(self, n: int) -> None:
        pass

    def on_weights_published(self, version: int) -> None:
        pass


class EventBus:
    def __init__(self) -> None:
        self._subscribers: set[Subscription] = set()
        self.listeners: list[Listener] = []

    # -- the stream ------------------------------------------------------------------------

    def subscribe(self, maxsize: int = 10000) -> Subscription:
        sub = Subscription(maxsize)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)

    def emit(self, name: str, /, **fields: Any) -> None:
        event = {"event": str(name), "ts": time.time(), **fields}  # an Event's value, a plain str
        for sub in list(self._subscribers):
            try:
                sub.queue.put_nowait(event)
            except asyncio.QueueFull:  # a stalled reader loses its stream, not our memory
                sub.lost = True
                self._subscribers.discard(sub)

    # -- the daemon's own components -------------------------------------------------------

    def add_listener(self, listener: Listener) -> None:
        """Listeners are told in the order they were added."""
        self.listeners.append(listener)

    def transition(self, t: Transition) -> None:
        for listener in self.listeners:
            listener.on_transition(t)

    def probed(self, engine: str, outcome: ProbeOutcome) -> None:
        for listener in self.listeners:
            listener.on_probe(engine, outcome)

    def joined_routing(self, engines: frozenset[str], at: float) -> None:
        for listener in self.listeners:
            listener.on_joined_routing(engines, at)

    def membership(self, routable: frozenset[str]) -> None:
        for listener in self.listeners:
            listener.on_membership(routable)

    def round_started(self, n: int) -> None:
        for listener in self.listeners:
            listener.on_round_started(n)

    def round_ended(self, n: int) -> None:
        for listener in self.listeners:
            listener.on_round_ended(n)

    def weights_published(self, version: int) -> None:
        for listener in self.listeners:
            listener.on_weights_published(version)
