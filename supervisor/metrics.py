"""The daemon's statistics and their Prometheus rendering.

`FleetStats` is fed by the event bus (a listener): detections by engine and kind, weight-sync
outcomes and three histograms (probe latency, detection to routable, sync duration). Labels
are read from each transition's structured cause, never from its reason text. `render` turns
the statistics and the fleet's state into Prometheus' text format at scrape time.
"""

from __future__ import annotations

import bisect
from typing import Iterator, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from .engine import EngineRunner
from .events import EventBus, Listener
from .fsm import ProbeOutcome, Transition
from .policy import FleetPolicy
from .protocol import Event
from .states import Cause, State


class Histogram:
    """Cumulative buckets, kept by FleetStats and exposed at scrape time."""

    def __init__(self, buckets: tuple[float, ...]):
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        running, buckets = 0, []
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts):
            running += n
            buckets.append((bound, running))
        return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=self.sum)


PROBE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RECOVERY_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
SYNC_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)


def detection_kind(t: Transition) -> str | None:
    """How an engine was found unusable, for vime_detections_total{kind}, from the transition's
    cause: "exit" (it died), "poisoned" (a weight sync failed midway, or the trainer said so),
    "reported" (the trainer's failure reports crossed the threshold), "hang" (probes: failed,
    or excused as busy or paused for too long). None: not a detection."""
    if t.to_state is State.EXITED:
        return "exit" if t.from_state is not State.STOPPING else None
    if t.to_state is not State.UNHEALTHY:
        return None
    if t.cause in (Cause.POISONED, Cause.SYNC_FAILED):
        return "poisoned"
    if t.cause is Cause.REPORTED:
        return "reported"
    return "hang"


class FleetStats(Listener):
    """Counters and histograms, fed by the bus. A detection is also an event on the stream."""

    def __init__(self, bus: EventBus):
        self.bus = bus
        self.detections: dict[tuple[str, str], int] = {}  # (engine, kind: see detection_kind) -> count
        self.probe_latency = Histogram(PROBE_BUCKETS)
        self.recovery_time = Histogram(RECOVERY_BUCKETS)
        self.sync_time = Histogram(SYNC_BUCKETS)
        self.syncs: dict[str, int] = {}  # "verified" | "failed" -> count
        self._detected_at: dict[str, float] = {}  # engine -> when its last failure was seen
        self._sync_began: dict[str, float] = {}

    def on_transition(self, t: Transition) -> None:
        kind = detection_kind(t)
        if kind:
            self.detections[(t.engine, kind)] = self.detections.get((t.engine, kind), 0) + 1
            self._detected_at.setdefault(t.engine, t.at)
            self.bus.emit(Event.DETECTION, engine=t.engine, kind=kind, reason=t.reason, cause=t.cause.value)
        if t.to_state in (State.STOPPED, State.FATAL):
            self._detected_at.pop(t.engine, None)  # no recovery to time: it was stopped or gave up
        if t.to_state is State.SYNCING:
            self._sync_began[t.engine] = t.at
        elif t.from_state is State.SYNCING:
            outcome = "failed" if t.to_state in (State.UNHEALTHY, State.STOPPING, State.EXITED) else "verified"
            self.syncs[outcome] = self.syncs.get(outcome, 0) + 1
            if outcome == "verified" and t.engine in self._sync_began:
                self.sync_time.observe(t.at - self._sync_began.pop(t.engine))

    def on_probe(self, engine: str, outcome: ProbeOutcome) -> None:
        if outcome.ok and outcome.latency is not None:
            self.probe_latency.observe(outcome.latency)

    def on_joined_routing(self, engines: frozenset[str], at: float) -> None:
        for name in engines:
            if name in self._detected_at:  # back in routing after a failure: time to recover
                self.recovery_time.observe(at - self._detected_at.pop(name))


class FleetReadings(Protocol):
    """What a scrape reads of the fleet (fleet.Fleet)."""

    runners: dict[str, EngineRunner]
    policy: FleetPolicy
    stats: FleetStats

    def is_routable(self, runner: EngineRunner) -> bool: ...

    def routable(self) -> list[EngineRunner]: ...


class FleetCollector:
    def __init__(self, fleet: FleetReadings):
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        fleet, policy, stats = self.fleet, self.fleet.policy, self.fleet.stats
        runners = list(fleet.runners.values())
        state = GaugeMetricFamily("vime_engine_state", "1 for the state each engine is in", labels=["engine", "state"])
        restarts = CounterMetricFamily("vime_engine_restarts", "Restarts of each engine", labels=["engine"])
        version = GaugeMetricFamily("vime_engine_weight_version", "Weight version each engine reports (-1: base)",
                                    labels=["engine"])
        latency = GaugeMetricFamily("vime_engine_probe_latency_seconds", "Latency of the last answered probe",
                                    labels=["engine"])
        routable = GaugeMetricFamily("vime_engine_routable", "1 if the engine may take traffic", labels=["engine"])
        for r in runners:
            for s in State:
                state.add_metric([r.name, s.value], 1.0 if r.fsm.state is s else 0.0)
            restarts.add_metric([r.name], r.fsm.restarts)
            v = r.fsm.weight_version
            version.add_metric([r.name], float(v) if isinstance(v, int) else -1.0)
            if r.fsm.last_probe is not None and r.fsm.last_probe.latency is not None:
                latency.add_metric([r.name], r.fsm.last_probe.latency)
            routable.add_metric([r.name], 1.0 if fleet.is_routable(r) else 0.0)
        detections = CounterMetricFamily("vime_detections", "Failures detected, by engine and kind (exit, hang)",
                                         labels=["engine", "kind"])
        for (engine, kind), n in sorted(stats.detections.items()):
            detections.add_metric([engine, kind], n)
        syncs = CounterMetricFamily("vime_syncs", "Weight syncs of restarted engines, by outcome", labels=["outcome"])
        for outcome in ("verified", "failed"):
            syncs.add_metric([outcome], stats.syncs.get(outcome, 0))
        yield from (state, restarts, version, latency, routable, detections, syncs)
        yield stats.probe_latency.family("vime_probe_latency_seconds", "Latency of answered heartbeats")
        yield stats.recovery_time.family("vime_detection_to_routable_seconds",
                                         "From a detected failure to the engine routable again")
        yield stats.sync_time.family("vime_sync_duration_seconds", "From SYNCING to verified")
        yield GaugeMetricFamily("vime_routable_engines", "Engines that may take traffic", value=len(fleet.routable()))
        yield GaugeMetricFamily("vime_membership_epoch", "Changes whenever the routable set changes", value=policy.epoch)
        yield GaugeMetricFamily("vime_round", "Last round started (-1: none)",
                                value=-1 if policy.round is None else policy.round)
        yield GaugeMetricFamily("vime_round_open", "1 while a round is open", value=1 if policy.round_open else 0)
        yield GaugeMetricFamily("vime_weight_version", "Current weight version (-1: base)",
                                value=-1 if policy.current_version is None else policy.current_version)
        yield GaugeMetricFamily("vime_below_min_healthy", "1 while routable engines are below min_healthy",
                                value=1 if policy.below_floor else 0)
        yield CounterMetricFamily("vime_floor_breaches", "Times the fleet fell below min_healthy",
                                  value=policy.floor_breaches)


def render(fleet: FleetReadings) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(fleet))
    return generate_latest(registry)
