"""The whole Prometheus exposition of a fleet that has been through something (restarts, an
unusual restart cause, probes, detections, a sync, pushes, a fingerprint mismatch, a round, a
current version, spares, a router's families), compared line by line with the reviewed one in
metrics_exposition.txt: dashboards and alert rules read these names, labels and values, so a
change to how they are collected must not change what is exposed.

A deliberate change to the families rewrites the reviewed file (then read its diff):
    VIME_UPDATE_EXPOSITION=1 python -m pytest tests/unit/test_metrics_exposition.py
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from prometheus_client.core import GaugeMetricFamily

from vime.supervisor.events import EventBus
from vime.supervisor.metrics import FleetStats, render
from vime.supervisor.policy import FleetPolicy
from vime.supervisor.states import Cause, ProbeOutcome, State, Transition

REVIEWED = Path(__file__).with_name("metrics_exposition.txt")
S = State


def busy_fleet() -> SimpleNamespace:
    stats = FleetStats(EventBus())
    for t in (
        ("e0", S.STOPPED, S.STARTING, Cause.START, 1, 0.0),
        ("e0", S.STARTING, S.RUNNING, Cause.READY, 1, 1.0),
        ("e0", S.RUNNING, S.UNHEALTHY, Cause.HANG, 1, 10.0),  # a detection
        ("e0", S.UNHEALTHY, S.STOPPING, Cause.HANG, 1, 10.5),
        ("e0", S.STOPPING, S.EXITED, Cause.HANG, 1, 11.0),
        ("e0", S.EXITED, S.STARTING, Cause.RESTART, 2, 12.0),  # restarts{cause="hang"}
        ("e0", S.STARTING, S.SYNCING, Cause.SYNC, 2, 20.0),
        ("e0", S.SYNCING, S.RUNNING, Cause.VERIFIED, 2, 23.0),  # a verified sync of 3 s
        ("e1", S.STOPPED, S.STARTING, Cause.START, 1, 0.0),
        ("e1", S.EXITED, S.STARTING, Cause.RESTART, 2, 2.0),  # restarts{cause="start"}: unusual
        ("e2", S.STOPPED, S.STARTING, Cause.START, 1, 0.0),
        ("e2", S.STARTING, S.SYNCING, Cause.SYNC, 1, 5.0),
        ("e2", S.SYNCING, S.UNHEALTHY, Cause.SYNC_FAILED, 1, 6.0),  # a failed sync
    ):
        stats.on_transition(Transition(t[0], t[1], t[2], "the words play no part", t[5], t[4], t[3]))
    stats.on_joined_routing(frozenset({"e0"}), 40.0)  # detected at 10, routable at 40
    for outcome in (ProbeOutcome(True, "ok", 0.02, kind="ok"), ProbeOutcome(True, "ok", 0.3, kind="ok"),
                    ProbeOutcome(False, "x", kind="refused"), ProbeOutcome(False, "reported: x")):
        stats.on_probe("e0", outcome)
    stats.push_announced(3)
    stats.push_ended("ok", 2.0, 4096)
    stats.push_announced(3)
    stats.push_ended("failed", None, 4096, failed=1)
    stats.push_announced(2)  # still in flight
    stats.push_receiver_failed("deadline")
    stats.fingerprint_mismatch("sync")

    clock = iter(range(0, 1000, 10))
    policy = FleetPolicy(min_healthy=2, strength=2, target=2, clock=lambda: float(next(clock)))
    policy.restore(round_number=4, round_open=False, version=7, checkpoint="/ckpt/7")
    policy.start_round(5)
    policy.set_routable({"e0", "e1"})
    policy.set_routable({"e0"})  # below the floor and the strength

    def runner(name: str, state: State, version: int | str | None, latency: float | None) -> SimpleNamespace:
        probe = None if latency is None else ProbeOutcome(True, "ok", latency)
        return SimpleNamespace(name=name, fsm=SimpleNamespace(state=state, weight_version=version, last_probe=probe))

    runners = {r.name: r for r in (runner("e0", S.RUNNING, 7, 0.02), runner("e1", S.STANDBY, 6, 0.01),
                                   runner("e2", S.UNHEALTHY, None, None))}
    return SimpleNamespace(runners=runners, policy=policy, stats=stats,
                           is_routable=lambda r: r.name == "e0", routable=lambda: [runners["e0"]])


class Router:
    def families(self):
        yield GaugeMetricFamily("vime_router_stand_in", "A router family, passed through", value=1)


def test_the_exposition_of_a_busy_fleet_is_the_reviewed_one():
    got = render(busy_fleet(), Router()).decode()
    if os.environ.get("VIME_UPDATE_EXPOSITION") == "1":
        REVIEWED.write_text(got)
    assert got.splitlines() == REVIEWED.read_text().splitlines()
