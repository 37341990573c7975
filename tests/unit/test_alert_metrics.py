"""The fleet gauges the alert rules read beside the state (deploy/prometheus/vime-alerts.yml):
the floor, the spares configured and those ready."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from vime.supervisor.events import EventBus
from vime.supervisor.metrics import FleetStats, render
from vime.supervisor.policy import FleetPolicy
from vime.supervisor.states import State


def gauges(states: list[State], *, spares: int, min_healthy: int) -> dict[str, float]:
    n = len(states)
    policy = FleetPolicy(min_healthy=min_healthy, strength=n - spares, target=n - spares if spares else None)
    runners = {f"e{i}": SimpleNamespace(name=f"e{i}", fsm=SimpleNamespace(state=s, weight_version=None, last_probe=None))
               for i, s in enumerate(states)}
    fleet = SimpleNamespace(runners=runners, policy=policy, stats=FleetStats(EventBus()),
                            is_routable=lambda r: r.fsm.state is State.RUNNING,
                            routable=lambda: [r for r in runners.values() if r.fsm.state is State.RUNNING])
    return {s.name: s.value for f in text_string_to_metric_families(render(fleet).decode()) for s in f.samples
            if not s.labels}


def test_spares_configured_and_ready():
    g = gauges([State.RUNNING, State.RUNNING, State.STANDBY], spares=1, min_healthy=2)
    assert (g["vime_spares"], g["vime_spares_ready"], g["vime_min_healthy"]) == (1, 1, 2)
    # The spare promoted after a failure, the failed engine not back: none ready.
    g = gauges([State.EXITED, State.RUNNING, State.RUNNING], spares=1, min_healthy=2)
    assert (g["vime_spares"], g["vime_spares_ready"]) == (1, 0)


def test_no_spares_configured():
    g = gauges([State.RUNNING, State.STARTING], spares=0, min_healthy=1)
    assert (g["vime_spares"], g["vime_spares_ready"], g["vime_min_healthy"]) == (0, 0, 1)
