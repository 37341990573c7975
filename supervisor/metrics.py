"""Prometheus metrics, computed from the fleet at scrape time (no state of their own)."""

from __future__ import annotations

import bisect

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .fleet import Fleet
from .states import State


class Histogram:
    """Cumulative buckets, kept by the fleet and exposed at scrape time."""

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


class FleetCollector:
    def __init__(self, fleet: Fleet):
        self.fleet = fleet

    def collect(self):
        fleet = self.fleet
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
        for (engine, kind), n in sorted(fleet.detections.items()):
            detections.add_metric([engine, kind], n)
        syncs = CounterMetricFamily("vime_syncs", "Weight syncs of restarted engines, by outcome", labels=["outcome"])
        for outcome in ("verified", "failed"):
            syncs.add_metric([outcome], fleet.syncs.get(outcome, 0))
        yield from (state, restarts, version, latency, routable, detections, syncs)
        yield fleet.probe_latency.family("vime_probe_latency_seconds", "Latency of answered heartbeats")
        yield fleet.recovery_time.family("vime_detection_to_routable_seconds",
                                         "From a detected failure to the engine routable again")
        yield fleet.sync_time.family("vime_sync_duration_seconds", "From SYNCING to verified")
        yield GaugeMetricFamily("vime_routable_engines", "Engines that may take traffic", value=len(fleet.routable()))
        yield GaugeMetricFamily("vime_membership_epoch", "Changes whenever the routable set changes", value=fleet.epoch)
        yield GaugeMetricFamily("vime_round", "Last round started (-1: none)", value=-1 if fleet.round is None else fleet.round)
        yield GaugeMetricFamily("vime_round_open", "1 while a round is open", value=1 if fleet.round_open else 0)
        yield GaugeMetricFamily("vime_weight_version", "Current weight version (-1: base)",
                                value=-1 if fleet.current_version is None else fleet.current_version)
        yield GaugeMetricFamily("vime_below_min_healthy", "1 while routable engines are below min_healthy",
                                value=1 if fleet.below_floor else 0)
        yield CounterMetricFamily("vime_floor_breaches", "Times the fleet fell below min_healthy", value=fleet.floor_breaches)


def render(fleet: Fleet) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(fleet))
    return generate_latest(registry)
