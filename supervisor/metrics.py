"""The daemon's statistics and their Prometheus rendering.

`FleetStats` is fed by the event bus (a listener): detections by engine and kind, restarts
by cause, heartbeats by outcome, weight-sync outcomes and three histograms (probe latency,
detection to routable, sync duration). Labels are read from each transition's structured
cause and each probe's kind, never from reason text. `render` turns the statistics and the
fleet's state into Prometheus' text format at scrape time. Every label set an engine can
have is there from the start at 0, so the first detection is an increase() like any other.

`MetricsServer` serves GET /metrics over loopback TCP for Prometheus (config
`metrics_address`): the same families as the control socket's /v1/metrics, plus the
daemon's own process_* and python_* (prometheus_client's collectors) and what it knows of
itself (selfwatch.py: loop lag, watchdog lateness). The same listener answers the probe
endpoints Kubernetes asks (/livez, /readyz, /startupz: healthz.py).
"""

from __future__ import annotations

import asyncio
import bisect
from typing import Awaitable, Callable, Iterable, Iterator, Protocol

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from . import healthz
from .config import parse_metrics_address
from .engine.runner import EngineRunner
from .events import EventBus, Listener
from .policy import FleetPolicy
from .engine.probes import PROBE_KINDS
from .states import DETECTION_KINDS, Cause, ProbeOutcome, State, Transition, WeightsMode, detection_kind

log = structlog.get_logger("vime.metrics")


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
PUSH_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# vime_pushes_total{outcome}: how announced pushes ended (expired: never ended by the trainer).
PUSH_OUTCOMES = ("ok", "failed", "expired")
# vime_push_receiver_failures_total{cause}: receivers lost to a push: reported (named in the
# trainer's `failed`), deadline (the daemon condemned it: paused past the push's deadline).
PUSH_FAILURE_CAUSES = ("reported", "deadline")
# vime_fingerprint_mismatches_total{at}: engines whose outputs did not match the published
# fingerprint while /weight_info said the version: when the version was published, after a sync,
# at a push's end (a receiver's /weight_info read again), or as the engine became ready or
# recovered (a restart, an attach, a daemon restart's re-adoption).
FINGERPRINT_CHECKS_AT = ("publish", "sync", "push", "ready")


# vime_engine_restarts_total{cause}: why the incarnation before a restart ended (the cause of
# the transition that took it down), or "operator" when an operator asked for the start.
RESTART_CAUSES = tuple(c.value for c in (
    Cause.EXIT, Cause.HANG, Cause.BUSY, Cause.PAUSED, Cause.REPORTED, Cause.POISONED, Cause.SYNC_FAILED,
    Cause.FINGERPRINT, Cause.START_FAILED, Cause.SLOW_START, Cause.OPERATOR))
# Starts that are restarts (the first start, and a re-adoption after a daemon restart, are not).
_RESTART_STARTS = frozenset({Cause.RESTART, Cause.RETRY, Cause.OPERATOR})


class FleetStats(Listener):
    """Counters and histograms, fed by the bus."""

    def __init__(self, bus: EventBus):
        self.bus = bus
        self.detections: dict[tuple[str, str], int] = {}  # (engine, kind: see detection_kind) -> count
        self.probe_latency = Histogram(PROBE_BUCKETS)
        self.recovery_time = Histogram(RECOVERY_BUCKETS)
        self.sync_time = Histogram(SYNC_BUCKETS)
        self.syncs: dict[str, int] = {}  # "verified" | "failed" -> count
        self.restarts: dict[tuple[str, str], int] = {}  # (engine, cause: see RESTART_CAUSES) -> count
        self.probes: dict[tuple[str, str], int] = {}  # (engine, probes.PROBE_KINDS) -> count
        self._detected_at: dict[str, float] = {}  # engine -> when its last failure was seen
        self._sync_began: dict[str, float] = {}
        self._last_cause: dict[str, Cause] = {}  # engine -> cause of its last transition
        self.push_time = Histogram(PUSH_BUCKETS)
        self.pushes: dict[str, int] = {}  # PUSH_OUTCOMES -> count
        self.push_failures: dict[str, int] = {}  # PUSH_FAILURE_CAUSES -> receivers
        self.push_bytes = 0  # announced bytes of the pushes ended ok
        self.push_receivers = 0  # of the last push announced
        self.pushes_in_flight = 0
        self.fingerprint_mismatches: dict[str, int] = {}  # FINGERPRINT_CHECKS_AT -> engines

    # -- announced pushes (told by sync.PushCoordinator, not by the bus) ---------------------

    def push_announced(self, receivers: int) -> None:
        self.push_receivers = receivers
        self.pushes_in_flight += 1

    def push_ended(self, outcome: str, seconds: float | None, nbytes: int, failed: int = 0) -> None:
        self.pushes_in_flight = max(0, self.pushes_in_flight - 1)
        self.pushes[outcome] = self.pushes.get(outcome, 0) + 1
        if seconds is not None:
            self.push_time.observe(seconds)
        if outcome == "ok":
            self.push_bytes += nbytes
        if failed:
            self.push_failures["reported"] = self.push_failures.get("reported", 0) + failed

    def push_receiver_failed(self, cause: str) -> None:
        self.push_failures[cause] = self.push_failures.get(cause, 0) + 1

    def fingerprint_mismatch(self, at: str) -> None:
        self.fingerprint_mismatches[at] = self.fingerprint_mismatches.get(at, 0) + 1

    def on_transition(self, t: Transition) -> None:
        if t.to_state is State.STARTING and t.cause in _RESTART_STARTS and t.incarnation > 1:
            down = self._last_cause.get(t.engine, t.cause)
            cause = (Cause.OPERATOR if t.cause is Cause.OPERATOR else down).value
            self.restarts[(t.engine, cause)] = self.restarts.get((t.engine, cause), 0) + 1
        self._last_cause[t.engine] = t.cause
        kind = detection_kind(t)
        if kind:
            self.detections[(t.engine, kind)] = self.detections.get((t.engine, kind), 0) + 1
            self._detected_at.setdefault(t.engine, t.at)
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
        kind = outcome.kind or ("ok" if outcome.ok else "error")
        self.probes[(engine, kind)] = self.probes.get((engine, kind), 0) + 1
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


class RouterReadings(Protocol):
    """What a scrape reads of the router (router.link.RouterLink), handed in by the daemon."""

    def families(self) -> Iterator[Metric]: ...


class FleetCollector:
    def __init__(self, fleet: FleetReadings, router: RouterReadings | None = None):
        self.fleet = fleet
        self.router = router

    def collect(self) -> Iterator[Metric]:
        yield from _engine_families(self.fleet)
        yield from _outcome_families(self.fleet.stats)
        yield from _push_families(self.fleet.stats)
        yield from _routing_families(self.fleet)
        yield from _round_families(self.fleet.policy)
        yield from _floor_families(self.fleet)
        if self.router is not None:
            yield from self.router.families()


def _counter(name: str, doc: str, label: str, values: Iterable[str], counts: dict[str, int]) -> CounterMetricFamily:
    """A counter with one label, every one of `values` present (0 until counted)."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for value in values:
        family.add_metric([value], counts.get(value, 0))
    return family


def _engine_families(fleet: FleetReadings) -> Iterator[Metric]:
    """Per engine: what it is now (state, version, latency, routable, lag) and its counters."""
    runners = list(fleet.runners.values())
    state, version, latency, routable, lag = _engine_readings(fleet, runners)
    restarts, probes, detections = _engine_counts(fleet.stats, runners)
    yield from (state, restarts, probes, version, latency, routable, lag, detections)


def _engine_readings(fleet: FleetReadings, runners: list[EngineRunner]) -> tuple[GaugeMetricFamily, ...]:
    state = GaugeMetricFamily("vime_engine_state", "1 for the state each engine is in", labels=["engine", "state"])
    version = GaugeMetricFamily("vime_engine_weight_version", "Weight version each engine reports (-1: base)",
                                labels=["engine"])
    latency = GaugeMetricFamily("vime_engine_probe_latency_seconds", "Latency of the last answered probe",
                                labels=["engine"])
    routable = GaugeMetricFamily("vime_engine_routable", "1 if the engine may take traffic", labels=["engine"])
    lag = GaugeMetricFamily("vime_engine_version_lag", "Weight versions each engine is behind the current one "
                            "(engines whose version is comparable: a published one)", labels=["engine"])
    for r in runners:
        for s in State:
            state.add_metric([r.name, s.value], 1.0 if r.fsm.state is s else 0.0)
        v = r.fsm.weight_version
        version.add_metric([r.name], float(v) if isinstance(v, int) else -1.0)
        if r.fsm.last_probe is not None and r.fsm.last_probe.latency is not None:
            latency.add_metric([r.name], r.fsm.last_probe.latency)
        routable.add_metric([r.name], 1.0 if fleet.is_routable(r) else 0.0)
        behind = fleet.policy.lag(v)
        if behind is not None:
            lag.add_metric([r.name], behind)
    return state, version, latency, routable, lag


def _engine_counts(stats: FleetStats, runners: list[EngineRunner]) -> tuple[CounterMetricFamily, ...]:
    restarts = CounterMetricFamily("vime_engine_restarts", "Restarts of each engine, by why the last incarnation "
                                   "ended (a Cause; operator: asked for)", labels=["engine", "cause"])
    probes = CounterMetricFamily("vime_probes", "Heartbeats of each engine, by outcome", labels=["engine", "outcome"])
    detections = CounterMetricFamily("vime_detections", "Failures detected, by engine and kind "
                                     "(exit, hang, poisoned, reported)", labels=["engine", "kind"])
    unusual: dict[str, set[str]] = {}  # restart causes outside RESTART_CAUSES, shown when they happen
    for engine, cause in stats.restarts:
        if cause not in RESTART_CAUSES:
            unusual.setdefault(engine, set()).add(cause)
    for r in runners:
        for cause in (*RESTART_CAUSES, *sorted(unusual.get(r.name, ()))):
            restarts.add_metric([r.name, cause], stats.restarts.get((r.name, cause), 0))
        for kind in PROBE_KINDS:
            probes.add_metric([r.name, kind], stats.probes.get((r.name, kind), 0))
        for kind in DETECTION_KINDS:
            detections.add_metric([r.name, kind], stats.detections.get((r.name, kind), 0))
    return restarts, probes, detections


def _outcome_families(stats: FleetStats) -> Iterator[Metric]:
    """How syncs ended, and how long probes, recoveries and syncs took."""
    yield _counter("vime_syncs", "Weight syncs of restarted engines, by outcome", "outcome", ("verified", "failed"),
                   stats.syncs)
    yield stats.probe_latency.family("vime_probe_latency_seconds", "Latency of answered heartbeats")
    yield stats.recovery_time.family("vime_detection_to_routable_seconds",
                                     "From a detected failure to the engine routable again")
    yield stats.sync_time.family("vime_sync_duration_seconds", "From SYNCING to verified")


def _push_families(stats: FleetStats) -> Iterator[Metric]:
    """The announced weight pushes and the fingerprint checks of what they loaded."""
    yield _counter("vime_pushes", "Announced weight pushes, by how they ended (expired: never ended by the "
                   "trainer)", "outcome", PUSH_OUTCOMES, stats.pushes)
    yield _counter("vime_push_receiver_failures", "Receivers lost to announced pushes, by cause (reported by the "
                   "trainer; deadline: paused past the push's deadline)", "cause", PUSH_FAILURE_CAUSES,
                   stats.push_failures)
    yield _counter("vime_fingerprint_mismatches", "Engines whose outputs did not match the published fingerprint "
                   "while /weight_info said the version, by when it was checked", "at", FINGERPRINT_CHECKS_AT,
                   stats.fingerprint_mismatches)
    yield stats.push_time.family("vime_push_seconds", "From a push's announcement to its end (ended ones)")
    yield CounterMetricFamily("vime_push_bytes", "Bytes announced by the pushes that ended ok", value=stats.push_bytes)
    yield GaugeMetricFamily("vime_push_receivers", "Receivers of the last push announced",
                            value=stats.push_receivers)
    yield GaugeMetricFamily("vime_pushes_in_flight", "Announced pushes not yet ended or expired",
                            value=stats.pushes_in_flight)


def _routing_families(fleet: FleetReadings) -> Iterator[Metric]:
    """The routable set: its size, the target at full strength and the time short of it, its epoch."""
    policy = fleet.policy
    yield GaugeMetricFamily("vime_routable_engines", "Engines that may take traffic", value=len(fleet.routable()))
    if policy.strength is not None:
        yield GaugeMetricFamily("vime_routable_target", "Routable engines at full strength (engines less spares)",
                                value=policy.strength)
        yield CounterMetricFamily("vime_below_target_seconds", "Seconds with fewer routable engines than the "
                                  "target, once it was first reached", value=policy.seconds_below_strength())
    yield GaugeMetricFamily("vime_membership_epoch", "Changes whenever the routable set changes", value=policy.epoch)


def _round_families(policy: FleetPolicy) -> Iterator[Metric]:
    """The trainer's side: the round, the current weight version and the rule it is served by."""
    yield GaugeMetricFamily("vime_round", "Last round started (-1: none)",
                            value=-1 if policy.round is None else policy.round)
    yield GaugeMetricFamily("vime_round_open", "1 while a round is open", value=1 if policy.round_open else 0)
    yield GaugeMetricFamily("vime_weight_version", "Current weight version (-1: base)",
                            value=-1 if policy.current_version is None else policy.current_version)
    mode = GaugeMetricFamily("vime_weights_mode", "1 for the [weights] mode the routing rule applies", labels=["mode"])
    for m in WeightsMode:
        mode.add_metric([m.value], 1.0 if policy.rule.mode is m else 0.0)
    yield mode
    yield GaugeMetricFamily("vime_max_staleness", "Versions behind the current one an engine may serve at "
                            "(0 in sync mode)", value=policy.rule.bound)


def _floor_families(fleet: FleetReadings) -> Iterator[Metric]:
    """The min_healthy floor and the warm spares (what the alert rules read)."""
    policy = fleet.policy
    yield GaugeMetricFamily("vime_below_min_healthy", "1 while routable engines are below min_healthy",
                            value=1 if policy.below_floor else 0)
    yield CounterMetricFamily("vime_floor_breaches", "Times the fleet fell below min_healthy",
                              value=policy.floor_breaches)
    yield GaugeMetricFamily("vime_min_healthy", "The floor of routable engines (min_healthy)", value=policy.min_healthy)
    # Warm spares: the configured ones are the engines beyond the routing target.
    spares = len(fleet.runners) - policy.target if policy.target is not None else 0
    yield GaugeMetricFamily("vime_spares", "Warm spares configured (spares)", value=max(0, spares))
    yield GaugeMetricFamily("vime_spares_ready", "Spares up, verified and ready to be promoted (STANDBY)",
                            value=sum(1 for r in fleet.runners.values() if r.fsm.state is State.STANDBY))


def render(fleet: FleetReadings, router: RouterReadings | None = None) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(fleet, router))
    return generate_latest(registry)


# The daemon's own process (CPU, memory, descriptors, start time), interpreter and GC: what
# prometheus_client's default registry would hold, kept apart from the fleet's families.
_PROCESS = CollectorRegistry(auto_describe=False)
for _collector in (ProcessCollector, PlatformCollector, GCCollector):
    _collector(registry=_PROCESS)
METRICS_ROUTE = "/metrics"


class SelfReadings(Protocol):
    """What the daemon knows of itself (selfwatch.SelfWatch)."""

    started: bool

    def loop_lag_max(self) -> float: ...

    def families(self) -> Iterator[Metric]: ...


class _SelfCollector:
    def __init__(self, readings: SelfReadings):
        self.readings = readings

    def collect(self) -> Iterator[Metric]:
        return self.readings.families()


# A connection with no request in flight for this long is closed (a scrape reconnects cheaply).
IDLE_CLOSE_S = 10.0


class MetricsServer:
    """GET /metrics over TCP at `address` (config metrics_address, "127.0.0.1:9464"; "" for
    none), for Prometheus, and the probe endpoints (healthz.py) for Kubernetes' kubelet. A
    listener that cannot bind is logged and left out: supervision never waits on the metrics.
    Scrapes never block the event loop: the fleet's families are read on it (its state belongs
    to the loop) from memory, the process' (/proc reads) on a worker thread."""

    def __init__(self, fleet: FleetReadings, address: str, router: RouterReadings | None = None,
                 itself: SelfReadings | None = None):
        self.fleet = fleet
        self.router = router
        self.address = address
        self.itself = itself
        self._runner: web.AppRunner | None = None

    async def start(self) -> bool:
        if not self.address:
            return False
        host, port = parse_metrics_address(self.address)
        app = web.Application()
        app.router.add_get(METRICS_ROUTE, self._metrics)
        if self.itself is not None:
            for path, handler in ((healthz.LIVEZ, self._livez), (healthz.READYZ, self._readyz),
                                  (healthz.STARTUPZ, self._startupz)):
                app.router.add_get(path, _answer(handler))
        # aiohttp keeps an idle connection open for ever by default: a client that connects and
        # sends nothing would hold a file descriptor of the daemon's until it restarts.
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0,
                               keepalive_timeout=IDLE_CLOSE_S)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as e:
            await runner.cleanup()
            log.error("metrics.unavailable", address=self.address, error=e.strerror or str(e),
                      action="supervision goes on without the TCP metrics listener; free the port or change "
                             "supervisor.metrics_address, then restart the daemon (/v1/metrics on the socket still "
                             "answers)")
            return False
        self._runner = runner
        shown = f"[{host}]" if ":" in host else host
        log.info("metrics.listening", url=f"http://{shown}:{port}{METRICS_ROUTE}")
        return True

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, request: web.Request) -> web.Response:
        fleet = render(self.fleet, self.router)
        if self.itself is not None:
            fleet += generate_latest(_self_registry(self.itself))
        process = await asyncio.to_thread(generate_latest, _PROCESS)
        return web.Response(body=process + fleet, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    # The probes: answered from memory on the loop, so an answer proves the loop runs.
    def _livez(self) -> tuple[bool, str]:
        assert self.itself is not None
        return healthz.live(self.itself.loop_lag_max())

    def _startupz(self) -> tuple[bool, str]:
        assert self.itself is not None
        return healthz.startup(self.itself.started)

    def _readyz(self) -> tuple[bool, str]:
        assert self.itself is not None
        return healthz.ready(self.itself.started, len(self.fleet.routable()), self.fleet.policy.min_healthy)


def _self_registry(itself: SelfReadings) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SelfCollector(itself))
    return registry


def _answer(verdict: Callable[[], tuple[bool, str]]) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        ok, text = verdict()
        return web.Response(status=200 if ok else 503, text=text + "\n")
    return handler
