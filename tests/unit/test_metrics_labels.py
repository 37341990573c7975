"""The labels of the Prometheus counters, judged on structured fields (pure): each late-probe
verdict's outcome kind (vime_probes_total{outcome}), why a restart happened
(vime_engine_restarts_total{cause}), and the label sets rendered at 0 before anything happened.
"""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from vime.supervisor.engine.activity import GroupSample, Member
from vime.supervisor.events import EventBus
from vime.supervisor.states import ProbeOutcome, Transition
from vime.supervisor.logs import exit_fields
from vime.supervisor.metrics import DETECTION_KINDS, RESTART_CAUSES, FleetStats, render
from vime.supervisor.policy import FleetPolicy
from vime.supervisor.engine.probes import PROBE_KINDS, Progress, judge_late
from vime.supervisor.states import Cause, State

S = State
PROG = Progress(generation_tokens=10, requests_running=1)
MOVED = Progress(generation_tokens=12, requests_running=1)


def group(cpu: float, at: float, state: str = "S") -> GroupSample:
    return GroupSample(at, (Member(1, "python3", state, cpu),))


def test_each_late_probe_verdict_has_its_kind():
    idle, burning = (group(1.0, 0.0), group(1.0, 1.0)), (group(1.0, 0.0), group(1.9, 1.0))
    stopped = group(1.0, 1.0, "T")
    cases = {
        "late_progress": judge_late(2.0, PROG, MOVED, *idle, paused=False),
        "late_busy": judge_late(2.0, PROG, PROG, *burning, paused=False),
        "paused": judge_late(2.0, PROG, PROG, *idle, paused=True),
        "stopped": judge_late(2.0, PROG, MOVED, stopped, stopped, paused=True),
        "timeout": judge_late(2.0, PROG, PROG, *idle, paused=False),
    }
    for kind, outcome in cases.items():
        assert outcome.kind == kind and kind in PROBE_KINDS, (kind, outcome)
    assert judge_late(2.0, None, None, None, None, paused=False).kind == "timeout"


def t(from_state: State, to_state: State, cause: Cause, incarnation: int) -> Transition:
    return Transition("e0", from_state, to_state, "the words play no part", 0.0, incarnation, cause)


def test_restarts_are_labelled_by_why_the_last_incarnation_ended():
    stats = FleetStats(EventBus())
    for tr in (
        t(S.STOPPED, S.STARTING, Cause.START, 1),  # the first start: no restart
        t(S.STARTING, S.RUNNING, Cause.READY, 1),
        t(S.RUNNING, S.UNHEALTHY, Cause.BUSY, 1),
        t(S.UNHEALTHY, S.STOPPING, Cause.BUSY, 1),
        t(S.STOPPING, S.EXITED, Cause.BUSY, 1),
        t(S.EXITED, S.STARTING, Cause.RESTART, 2),  # busy too long
        t(S.STARTING, S.BACKOFF, Cause.SLOW_START, 2),
        t(S.BACKOFF, S.STARTING, Cause.RETRY, 3),  # a retry after a slow start
        t(S.STARTING, S.FATAL, Cause.START_FAILED, 3),
        t(S.FATAL, S.STARTING, Cause.OPERATOR, 4),  # an operator's start
        t(S.STARTING, S.RUNNING, Cause.READY, 4),
    ):
        stats.on_transition(tr)
    assert stats.restarts == {("e0", "busy"): 1, ("e0", "slow_start"): 1, ("e0", "operator"): 1}
    # Re-adopting after a daemon restart is no engine restart.
    stats.on_transition(t(S.STOPPED, S.STARTING, Cause.RESTORED, 5))
    assert sum(stats.restarts.values()) == 3


def test_probe_outcomes_are_counted_by_kind():
    stats = FleetStats(EventBus())
    for outcome in (ProbeOutcome(True, "ok", 0.01, kind="ok"), ProbeOutcome(False, "x", kind="refused"),
                    ProbeOutcome(False, "reported: x")):  # no kind: read by its ok
        stats.on_probe("e0", outcome)
    assert stats.probes == {("e0", "ok"): 1, ("e0", "refused"): 1, ("e0", "error"): 1}


def test_every_label_set_is_rendered_at_zero_before_anything_happened():
    policy = FleetPolicy(min_healthy=1, use_fault_tolerance=True, restart_immediately=False)
    runner = SimpleNamespace(name="e0", fsm=SimpleNamespace(state=S.STARTING, weight_version=None, last_probe=None))
    fleet = SimpleNamespace(runners={"e0": runner}, policy=policy, stats=FleetStats(EventBus()),
                            is_routable=lambda r: False, routable=lambda: [])
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(render(fleet).decode()) for s in f.samples}
    for kind in DETECTION_KINDS:
        assert got[("vime_detections_total", (("engine", "e0"), ("kind", kind)))] == 0
    for cause in RESTART_CAUSES:
        assert got[("vime_engine_restarts_total", (("cause", cause), ("engine", "e0")))] == 0
    for kind in PROBE_KINDS:
        assert got[("vime_probes_total", (("engine", "e0"), ("outcome", kind)))] == 0


def test_exit_fields():
    assert exit_fields(0) == {"exit_code": 0} and exit_fields(2) == {"exit_code": 2}
    assert exit_fields(-9) == {"signal": "SIGKILL"} and exit_fields(-15) == {"signal": "SIGTERM"}
    assert exit_fields(-200) == {"signal": "200"}
