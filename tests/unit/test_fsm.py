"""The pure engine state machine, driven by a fake clock: no engines, no sleeping."""

from __future__ import annotations

import random

import pytest

from vime.supervisor.engine.fsm import vlabel, EngineFSM, IllegalTransition, backoff_delay
from vime.supervisor.config import ProbePolicy, RestartPolicy
from vime.supervisor.states import (
    DAEMON_LIMIT, TRANSITIONS, Cause, ProbeOutcome, State, Transition, detection_kind)

S = State
OK = ProbeOutcome(True, "ok", 0.01)
TIMEOUT = ProbeOutcome(False, "timeout after 5.0s")
BUSY = ProbeOutcome(False, "health 503")


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(*, now: float = 0.0, seed: int = 1234, probe: ProbePolicy | None = None,
         restart: RestartPolicy | None = None):
    clock = FakeClock(now)
    seen: list[Transition] = []
    fsm = EngineFSM("e0", probe or ProbePolicy(), restart or RestartPolicy(), clock,
                    rng=random.Random(seed), on_transition=seen.append)
    return fsm, clock, seen


def edges(seen: list[Transition]) -> list[tuple[State, State]]:
    return [(t.from_state, t.to_state) for t in seen]


def running(**kw):
    """An engine that started at t=0 and was ready on base weights at t=10."""
    fsm, clock, seen = make(**kw)
    assert fsm.begin_start("start")
    clock.now = 10.0
    fsm.became_ready(None, None)
    assert fsm.state is S.RUNNING
    seen.clear()
    return fsm, clock, seen


# -- bring-up -------------------------------------------------------------------------------


def test_new_fsm_is_stopped_since_construction():
    fsm, clock, seen = make(now=42.0)
    assert fsm.state is S.STOPPED
    assert fsm.reason == "not started"
    assert fsm.since == 42.0
    assert fsm.incarnation == 0
    assert fsm.uptime() is None
    assert seen == []


def test_stopped_starting_running_with_fake_clock_at_zero():
    fsm, clock, seen = make(now=0.0)
    assert fsm.begin_start("start") is True
    assert fsm.state is S.STARTING and fsm.reason == "start"
    assert fsm.incarnation == 1 and fsm.restarts == 0
    assert fsm.spawned_at == 0.0 and fsm.ready_at is None
    clock.now = 7.0
    t = fsm.became_ready(None, None)
    assert fsm.state is S.RUNNING
    # spawned at t=0 must still count as "spawned": 7 s, not 0 s.
    assert fsm.reason == "ready in 7.0s; base weights"
    assert t.reason == fsm.reason
    assert fsm.ready_at == 7.0 and fsm.since == 7.0
    clock.now = 19.5
    assert fsm.uptime() == 12.5
    assert seen == [
        Transition("e0", S.STOPPED, S.STARTING, "start", 0.0, 1, Cause.START),
        Transition("e0", S.STARTING, S.RUNNING, "ready in 7.0s; base weights", 7.0, 1, Cause.READY),
    ]


def test_ready_at_current_version_is_running_verified():
    fsm, clock, seen = make(now=100.0)
    fsm.begin_start("start")
    clock.now = 112.5
    fsm.became_ready(3, 3)
    assert fsm.state is S.RUNNING
    assert fsm.reason == "ready in 12.5s; weights v3, verified"
    assert fsm.weight_version == 3


@pytest.mark.parametrize("engine_version", [1, None])
def test_ready_on_old_weights_is_stale_then_syncs_to_running(engine_version):
    fsm, clock, seen = make(now=100.0)
    fsm.begin_start("start")
    clock.now = 130.0
    fsm.became_ready(engine_version, 2)
    assert fsm.state is S.STALE
    assert fsm.reason == f"ready in 30.0s; weights {vlabel(engine_version)}, current v2"
    assert not fsm.routable
    clock.now = 131.0
    fsm.sync_started("syncing to v2")
    assert fsm.state is S.SYNCING and not fsm.routable
    clock.now = 140.0
    fsm.sync_finished(2)
    assert fsm.state is S.RUNNING and fsm.routable
    assert fsm.weight_version == 2
    assert fsm.reason == "weights v2, verified"
    assert [(t.from_state, t.to_state, t.at) for t in seen] == [
        (S.STOPPED, S.STARTING, 100.0),
        (S.STARTING, S.STALE, 130.0),
        (S.STALE, S.SYNCING, 131.0),
        (S.SYNCING, S.RUNNING, 140.0),
    ]


def test_running_falls_behind_a_new_version_and_a_failed_sync_goes_back_to_stale():
    fsm, clock, seen = make()
    fsm.begin_start("start")
    fsm.became_ready(1, 1)
    fsm.version_behind(2)
    assert fsm.state is S.STALE
    assert fsm.reason == "weights v1, current v2"
    fsm.sync_started("syncing to v2")
    fsm.version_behind(2)  # the sync did not land
    assert fsm.state is S.STALE
    assert edges(seen)[-3:] == [(S.RUNNING, S.STALE), (S.STALE, S.SYNCING), (S.SYNCING, S.STALE)]


# -- probes ---------------------------------------------------------------------------------


def test_suspect_recovers_after_one_success_with_threshold_1():
    fsm, clock, seen = running()
    clock.now = 20.0
    assert fsm.probe_result(TIMEOUT) is False
    assert fsm.state is S.SUSPECT
    assert fsm.reason == "1/3 probe failures (last: timeout after 5.0s)"
    assert fsm.routable  # SUSPECT still takes traffic
    assert fsm.last_probe == TIMEOUT
    clock.now = 25.0
    assert fsm.probe_result(OK) is False
    assert fsm.state is S.RUNNING
    assert fsm.reason == "recovered: 1 probe successes"
    assert fsm.consecutive_failures == 0
    assert [(t.from_state, t.to_state, t.at) for t in seen] == [
        (S.RUNNING, S.SUSPECT, 20.0),
        (S.SUSPECT, S.RUNNING, 25.0),
    ]


def test_suspect_needs_consecutive_successes_with_threshold_2():
    fsm, clock, seen = running(probe=ProbePolicy(success_threshold=2))
    assert fsm.probe_result(TIMEOUT) is False
    assert fsm.state is S.SUSPECT
    assert fsm.probe_result(OK) is False
    assert fsm.state is S.SUSPECT  # one success is not enough
    assert fsm.probe_result(BUSY) is False  # a failure breaks the streak
    assert fsm.state is S.SUSPECT
    assert fsm.reason == "suspect; 1/3 probe failures (last: health 503)"
    assert fsm.probe_result(OK) is False
    assert fsm.state is S.SUSPECT
    assert fsm.probe_result(OK) is False
    assert fsm.state is S.RUNNING
    assert fsm.reason == "recovered: 2 probe successes"
    assert edges(seen) == [(S.RUNNING, S.SUSPECT), (S.SUSPECT, S.RUNNING)]


def test_failure_threshold_makes_it_unhealthy_and_asks_for_a_stop_exactly_then():
    fsm, clock, seen = running()
    results = []
    for i, outcome in enumerate([TIMEOUT, TIMEOUT, BUSY]):
        clock.now = 20.0 + 5 * i
        results.append(fsm.probe_result(outcome))
        if i == 1:
            assert fsm.state is S.SUSPECT
            assert fsm.reason == "suspect; 2/3 probe failures (last: timeout after 5.0s)"
    assert results == [False, False, True]
    assert fsm.state is S.UNHEALTHY
    assert fsm.reason == "hung: 3 consecutive probe failures (last: health 503)"
    assert not fsm.routable
    # One transition per change: the second failure changed the reason, not the state.
    assert [(t.from_state, t.to_state, t.at) for t in seen] == [
        (S.RUNNING, S.SUSPECT, 20.0),
        (S.SUSPECT, S.UNHEALTHY, 30.0),
    ]
    # Still hung: still "stop it", but no second transition.
    assert fsm.probe_result(TIMEOUT) is True
    assert len(seen) == 2


def test_a_success_in_between_restarts_the_failure_count():
    fsm, clock, seen = running()
    assert [fsm.probe_result(o) for o in (TIMEOUT, TIMEOUT, OK, TIMEOUT, TIMEOUT)] == [False] * 5
    assert fsm.state is S.SUSPECT
    assert fsm.consecutive_failures == 2
    assert fsm.probe_result(TIMEOUT) is True
    assert fsm.state is S.UNHEALTHY


def test_a_probe_the_daemon_could_not_make_is_never_held_against_the_engine():
    """EMFILE in the daemon (kind daemon_limit): no SUSPECT, no stop, and the failures around it
    are counted as if it had not happened (neither a success nor a failure)."""
    no_fd = ProbeOutcome(False, "generate: the daemon is out of descriptors", kind=DAEMON_LIMIT)
    fsm, clock, seen = running(probe=ProbePolicy(failure_threshold=2))
    assert [fsm.probe_result(no_fd) for _ in range(50)] == [False] * 50
    assert fsm.state is S.RUNNING and fsm.consecutive_failures == 0 and not seen
    assert fsm.probe_result(TIMEOUT) is False and fsm.state is S.SUSPECT
    assert fsm.probe_result(no_fd) is False and fsm.consecutive_failures == 1
    assert fsm.probe_result(TIMEOUT) is True and fsm.state is S.UNHEALTHY


def test_an_engine_the_daemon_cannot_probe_leaves_routing_after_a_hangs_worth_unblamed():
    """Probes the daemon could not make (EMFILE) keep a serving engine routable only as long as
    a hang takes to confirm (ProbePolicy.hang_bound: 10 + 3 x (5 + 0.5) = 26.5 s here). Then it
    is UNHEALTHY with cause daemon_limit: out of routing, no stop asked (no restart, no hang
    detection); the next probe made decides: an answer brings it back, failures are a hang."""
    no_fd = ProbeOutcome(False, "generate: the daemon is out of descriptors", kind=DAEMON_LIMIT)
    fsm, clock, seen = running()
    assert fsm.limit_bound() == fsm.probe.hang_bound() == 26.5
    for t in (11.0, 21.0, 31.0, 37.4):  # 26.4 s since the first: still routable
        clock.now = t
        assert fsm.probe_result(no_fd) is False
    assert fsm.state is S.RUNNING and fsm.routable and not seen
    clock.now = 38.0
    assert fsm.probe_result(no_fd) is False  # never a stop
    assert edges(seen) == [(S.RUNNING, S.UNHEALTHY)] and seen[0].cause is Cause.DAEMON_LIMIT
    assert detection_kind(seen[0]) is None  # not in vime_detections_total: not the engine's
    assert not fsm.routable and fsm.unobserved and fsm.consecutive_failures == 0
    assert fsm.reason.startswith("unobserved: the daemon could not probe it for 27s")
    clock.now = 100.0
    assert fsm.probe_result(no_fd) is False and len(seen) == 1  # still out, still not blamed
    # A probe made and answered: back (the runner calls recovered, as for an attached engine).
    fsm.recovered(None, None)
    assert fsm.state is S.RUNNING and fsm.limit_since is None
    # A probe made in between ends the run: the bound counts from the next one the daemon lacks.
    for t, outcome in ((110.0, no_fd), (130.0, OK), (131.0, no_fd), (150.0, no_fd)):
        clock.now = t
        assert fsm.probe_result(outcome) is False
    assert fsm.state is S.RUNNING
    # Unobserved, then probes made again that fail: the engine's hang, with its own cause.
    clock.now = 160.0
    fsm.probe_result(no_fd)
    assert fsm.unobserved
    assert [fsm.probe_result(TIMEOUT) for _ in range(3)] == [False, False, True]
    assert fsm.cause is Cause.HANG and fsm.reason.startswith("hung: 3 consecutive probe failures")
    assert fsm.stopping("stopping").cause is Cause.HANG


def test_an_engine_out_for_the_daemons_limit_then_busy_too_long_is_the_engines_hang():
    """Out of routing for daemon_limit, then answered but busy past max_busy: the verdict is the
    engine's (stop asked, cause busy), without a second UNHEALTHY transition (not a legal edge:
    raising here would end the heartbeat and stop the engine for the daemon's shortage)."""
    no_fd = ProbeOutcome(False, "generate: the daemon is out of descriptors", kind=DAEMON_LIMIT)
    busy = ProbeOutcome(True, "busy: probe late (>2s), no tokens", excuse="busy")
    fsm, clock, seen = running(probe=ProbePolicy(interval=1, timeout=2, failure_threshold=2, max_busy=5))
    for t in (11.0, 13.0, 17.0):  # the bound: 1 + 2 x (2 + 0.5) = 6 s
        clock.now = t
        assert fsm.probe_result(no_fd) is False
    assert fsm.state is S.UNHEALTHY and fsm.cause is Cause.DAEMON_LIMIT
    clock.now = 18.0
    assert fsm.probe_result(busy) is False  # busy: no answer yet on its weights, still out
    clock.now = 24.0
    assert fsm.probe_result(busy) is True
    assert fsm.cause is Cause.BUSY and fsm.reason.startswith("hung: busy for 6s")
    assert edges(seen) == [(S.RUNNING, S.UNHEALTHY)]


def test_a_spare_or_a_stale_engine_is_not_taken_out_for_the_daemons_limit():
    no_fd = ProbeOutcome(False, "generate: the daemon is out of descriptors", kind=DAEMON_LIMIT)
    fsm, clock, seen = make()
    fsm.begin_start("start")
    fsm.became_ready(1, 2)
    seen.clear()
    for t in range(0, 200, 10):
        clock.now = float(t)
        assert fsm.probe_result(no_fd) is False
    assert fsm.state is S.STALE and not seen  # never routed: nothing to take out


def test_failure_threshold_1_goes_straight_to_unhealthy():
    fsm, clock, seen = running(probe=ProbePolicy(failure_threshold=1))
    assert fsm.probe_result(TIMEOUT) is True
    assert fsm.state is S.UNHEALTHY
    assert fsm.reason == "hung: 1 consecutive probe failures (last: timeout after 5.0s)"
    assert edges(seen) == [(S.RUNNING, S.UNHEALTHY)]


def test_stale_engine_is_probed_and_can_become_unhealthy():
    fsm, clock, seen = make()
    fsm.begin_start("start")
    fsm.became_ready(1, 2)
    assert fsm.probe_result(TIMEOUT) is False
    assert fsm.state is S.STALE  # no SUSPECT for an engine that takes no traffic anyway
    assert fsm.reason == "stale; 1/3 probe failures (last: timeout after 5.0s)"
    assert fsm.probe_result(TIMEOUT) is False
    assert fsm.probe_result(TIMEOUT) is True
    assert fsm.state is S.UNHEALTHY
    assert edges(seen)[-1] == (S.STALE, S.UNHEALTHY)


def test_report_failure_counts_like_a_failed_probe():
    fsm, clock, seen = running()
    assert fsm.report_failure("connection reset") is False
    assert fsm.state is S.SUSPECT
    assert fsm.consecutive_failures == 1
    assert fsm.reason == "1/3 probe failures (last: reported: connection reset)"
    assert fsm.probe_result(TIMEOUT) is False
    assert fsm.report_failure("read timeout") is True
    assert fsm.state is S.UNHEALTHY
    assert fsm.reason == "hung: 3 consecutive probe failures (last: reported: read timeout)"


def test_report_failure_is_ignored_when_not_probed():
    fsm, clock, seen = make()
    fsm.begin_start("start")
    assert fsm.report_failure("connection refused") is False
    assert fsm.state is S.STARTING
    assert fsm.consecutive_failures == 0


# -- stopping and exits ---------------------------------------------------------------------


def test_unhealthy_stopping_exited_keeps_the_hung_reason():
    fsm, clock, seen = running(probe=ProbePolicy(failure_threshold=2))
    fsm.probe_result(TIMEOUT)
    assert fsm.probe_result(TIMEOUT) is True
    hung = fsm.reason
    assert hung == "hung: 2 consecutive probe failures (last: timeout after 5.0s)"
    clock.now = 40.0
    fsm.stopping(fsm.reason)  # what the runner does
    assert fsm.state is S.STOPPING
    # A late probe answer for an engine being stopped does not ask for a second stop.
    assert fsm.probe_result(TIMEOUT) is False
    clock.now = 45.0
    t = fsm.exited("killed by SIGTERM")
    assert fsm.state is S.EXITED
    assert fsm.reason == f"{hung}; stopped (killed by SIGTERM)"
    assert t == Transition("e0", S.STOPPING, S.EXITED, fsm.reason, 45.0, 1, Cause.HANG)
    assert edges(seen) == [(S.RUNNING, S.SUSPECT), (S.SUSPECT, S.UNHEALTHY),
                           (S.UNHEALTHY, S.STOPPING), (S.STOPPING, S.EXITED)]


@pytest.mark.parametrize("fail_first", [False, True])
def test_unexpected_exit(fail_first):
    fsm, clock, seen = running()
    if fail_first:
        fsm.probe_result(TIMEOUT)
        assert fsm.state is S.SUSPECT
    fsm.exited("exit status 1")
    assert fsm.state is S.EXITED
    assert fsm.reason == "exited unexpectedly (exit status 1)"
    assert not fsm.routable


def test_operator_stop_ends_stopped():
    fsm, clock, seen = running()
    fsm.stopping("stopped by request")
    fsm.stopped("stopped by request")
    assert fsm.state is S.STOPPED
    assert edges(seen) == [(S.RUNNING, S.STOPPING), (S.STOPPING, S.STOPPED)]


def test_attached_engine_recovers_from_unhealthy():
    fsm, clock, seen = running(probe=ProbePolicy(failure_threshold=1))
    assert fsm.probe_result(TIMEOUT) is True
    fsm.recovered(1, 1)
    assert fsm.state is S.RUNNING
    assert fsm.consecutive_failures == 0
    assert fsm.reason == "recovered: answering probes again"
    fsm.exited("not answering")
    fsm.recovered(1, 2)
    assert fsm.state is S.STALE
    assert fsm.reason == "recovered; weights v1, current v2"


# -- illegal transitions --------------------------------------------------------------------


def _to_stopping(fsm, clock):
    fsm.begin_start("start")
    fsm.stopping("not ready within first_wait (300s)")


def _to_backoff(fsm, clock):
    fsm.begin_start("start")
    assert fsm.start_failed("exit status 1 while starting: config error") is not None


def _to_fatal(fsm, clock):
    for _ in range(fsm.restart.start_retries):
        if fsm.state is not S.STARTING:
            fsm.begin_start("start")
        fsm.start_failed("out of memory")
    assert fsm.state is S.FATAL


def _to_exited(fsm, clock):
    fsm.begin_start("start")
    fsm.became_ready(None, None)
    fsm.exited("exit status 1")


def _to_syncing(fsm, clock):
    fsm.begin_start("start")
    fsm.became_ready(1, 2)
    fsm.sync_started("sync")


REACH = {
    S.STOPPED: lambda fsm, clock: None,
    S.STARTING: lambda fsm, clock: fsm.begin_start("start"),
    S.STOPPING: _to_stopping,
    S.BACKOFF: _to_backoff,
    S.FATAL: _to_fatal,
    S.EXITED: _to_exited,
    S.SYNCING: _to_syncing,
}


@pytest.mark.parametrize(
    "state, call, to",
    [
        (S.STOPPED, lambda f: f.became_ready(None, None), S.RUNNING),
        (S.STOPPED, lambda f: f.sync_started("sync"), S.SYNCING),
        (S.STOPPED, lambda f: f.exited("exit status 0"), S.EXITED),
        (S.STOPPED, lambda f: f.stopping("stop"), S.STOPPING),
        (S.STOPPED, lambda f: f.stopped("stop"), S.STOPPED),
        (S.STARTING, lambda f: f.sync_started("sync"), S.SYNCING),
        (S.STARTING, lambda f: f.begin_start("again"), S.STARTING),
        (S.BACKOFF, lambda f: f.became_ready(None, None), S.RUNNING),
        (S.BACKOFF, lambda f: f.stopping("stop"), S.STOPPING),
        (S.FATAL, lambda f: f.sync_finished(1), S.RUNNING),
        (S.FATAL, lambda f: f.exited("exit status 1"), S.EXITED),
        (S.EXITED, lambda f: f.sync_started("sync"), S.SYNCING),
        (S.STOPPING, lambda f: f.became_ready(None, None), S.RUNNING),
    ],
)
def test_illegal_transitions_raise_and_change_nothing_visible(state, call, to):
    fsm, clock, seen = make()
    REACH[state](fsm, clock)
    assert fsm.state is state
    before = (fsm.state, fsm.reason, fsm.since, len(seen))
    with pytest.raises(IllegalTransition, match=f"e0: {state} -> {to} "):
        call(fsm)
    assert (fsm.state, fsm.reason, fsm.since, len(seen)) == before


def test_begin_start_from_running_is_illegal():
    fsm, clock, seen = running()
    with pytest.raises(IllegalTransition, match="RUNNING -> STARTING"):
        fsm.begin_start("again")
    assert fsm.state is S.RUNNING
    assert seen == []


def test_every_edge_outside_the_table_is_refused():
    for src in State:
        for dst in State:
            fsm, clock, seen = make()
            fsm.state = src
            if dst in TRANSITIONS[src]:
                fsm._go(dst, "x", Cause.OPERATOR)
                assert fsm.state is dst and len(seen) == 1
            else:
                with pytest.raises(IllegalTransition):
                    fsm._go(dst, "x", Cause.OPERATOR)
                assert fsm.state is src and seen == []


# -- incarnations ---------------------------------------------------------------------------


def test_each_incarnation_is_armed_afresh():
    fsm, clock, seen = make(now=1000.0)
    fsm.begin_start("start")
    first_deadline = fsm.spawned_at + fsm.probe.first_wait
    assert first_deadline == 1300.0
    clock.now = 1010.0
    fsm.became_ready(1, 1)
    fsm.probe_result(OK)
    fsm.probe_result(TIMEOUT)
    assert fsm.consecutive_failures == 1 and fsm.last_probe == TIMEOUT
    clock.now = 1050.0
    fsm.exited("exit status 1")
    clock.now = 1060.0
    assert fsm.begin_start("restart #1") is True
    assert fsm.incarnation == 2 and fsm.restarts == 1
    assert fsm.spawned_at == 1060.0
    assert fsm.spawned_at + fsm.probe.first_wait == 1360.0  # a whole new first_wait
    assert fsm.ready_at is None and fsm.uptime() is None
    assert fsm.consecutive_failures == 0 and fsm.consecutive_successes == 0
    assert fsm.weight_version is None
    assert fsm.last_probe is None
    assert fsm.backoff_until is None
    clock.now = 1075.0
    fsm.became_ready(1, 1)
    assert fsm.reason == "ready in 15.0s; weights v1, verified"
    assert fsm.ready_at == 1075.0
    clock.now = 1080.0
    assert fsm.uptime() == 5.0
    assert [(t.to_state, t.incarnation) for t in seen] == [
        (S.STARTING, 1), (S.RUNNING, 1), (S.SUSPECT, 1), (S.EXITED, 1),
        (S.STARTING, 2), (S.RUNNING, 2),
    ]


def test_became_ready_resets_failed_starts():
    fsm, clock, seen = make()
    fsm.begin_start("start")
    fsm.start_failed("port 8001 still in use by another process")
    assert fsm.failed_starts == 1
    clock.now = 5.0
    fsm.begin_start("retry after start failure 1")
    assert fsm.failed_starts == 1  # still consecutive until one is ready
    fsm.became_ready(None, None)
    assert fsm.failed_starts == 0


# -- the start budget -----------------------------------------------------------------------


def test_start_failures_back_off_then_go_fatal():
    policy = RestartPolicy(start_retries=4, backoff_initial=2.0, backoff_max=5.0, flapping_max_restarts=100)
    fsm, clock, seen = make(now=50.0, seed=7, restart=policy)
    replay = random.Random(7)
    fsm.begin_start("start")
    for n in (1, 2, 3):
        d = fsm.start_failed(f"err{n}")
        base = min(policy.backoff_max, policy.backoff_initial * 2 ** (n - 1))
        assert d is not None and base / 2 <= d <= base
        assert d == backoff_delay(n, policy, replay)  # the injected rng is the one used
        assert fsm.state is S.BACKOFF
        assert fsm.backoff_until == clock.now + d
        assert fsm.reason == f"start failed ({n}/4): err{n}; retry in {d:.1f}s"
        assert fsm.last_error == f"err{n}"
        clock.now += d
        assert fsm.begin_start(f"retry after start failure {n}") is True
    assert fsm.start_failed("err4") is None
    assert fsm.state is S.FATAL
    assert fsm.reason == "start retries exhausted (4); last error: err4"
    assert fsm.reason.startswith("start retries exhausted (4); last error: ")
    assert fsm.last_error == "err4"
    assert not fsm.routable
    assert edges(seen)[-1] == (S.STARTING, S.FATAL)


def test_default_budget_is_three_starts():
    fsm, clock, seen = make()
    fsm.begin_start("start")
    assert fsm.start_failed("a") is not None
    fsm.begin_start("retry")
    assert fsm.start_failed("b") is not None
    fsm.begin_start("retry")
    assert fsm.start_failed("c") is None
    assert fsm.state is S.FATAL
    assert fsm.reason == "start retries exhausted (3); last error: c"


def test_start_that_timed_out_and_was_stopped_counts_against_the_budget():
    fsm, clock, seen = make(restart=RestartPolicy(start_retries=2))
    fsm.begin_start("start")
    fsm.stopping("not ready within first_wait (300s)")
    assert fsm.start_failed("not ready within first_wait (300s); stopped (killed by SIGTERM)") is not None
    assert fsm.state is S.BACKOFF
    fsm.begin_start("retry")
    fsm.stopping("not ready within first_wait (300s)")
    assert fsm.start_failed("not ready within first_wait (300s); stopped (killed by SIGKILL)") is None
    assert fsm.state is S.FATAL
    assert fsm.reason == ("start retries exhausted (2); last error: "
                          "not ready within first_wait (300s); stopped (killed by SIGKILL)")
    assert edges(seen)[-2:] == [(S.STARTING, S.STOPPING), (S.STOPPING, S.FATAL)]


def test_a_successful_start_in_between_resets_the_budget():
    fsm, clock, seen = make(restart=RestartPolicy(start_retries=2, flapping_max_restarts=100))
    fsm.begin_start("start")
    assert fsm.start_failed("a") is not None  # 1/2
    fsm.begin_start("retry")
    fsm.became_ready(None, None)
    fsm.exited("exit status 1")
    fsm.begin_start("restart #2")
    assert fsm.start_failed("b") is not None  # 1/2 again, not 2/2
    assert fsm.state is S.BACKOFF
    assert fsm.reason.startswith("start failed (1/2): b;")
    fsm.begin_start("retry")
    assert fsm.start_failed("c") is None
    assert fsm.reason == "start retries exhausted (2); last error: c"


# -- the flapping window --------------------------------------------------------------------


def _crash_loop(fsm, clock, times):
    """Run-then-crash incarnations, restarting at each of `times`; returns begin_start's answers."""
    answers = []
    for t in times:
        fsm.became_ready(None, None)
        fsm.exited("exit status 1")
        clock.now = t
        answers.append(fsm.begin_start("restart"))
        if not answers[-1]:
            break
    return answers


def test_too_many_restarts_inside_the_window_is_fatal():
    fsm, clock, seen = make(restart=RestartPolicy(flapping_window=600.0, flapping_max_restarts=3))
    fsm.begin_start("start")  # the first start is not a restart
    assert _crash_loop(fsm, clock, [10.0, 20.0, 30.0, 40.0]) == [True, True, True, False]
    assert fsm.state is S.FATAL
    assert fsm.reason == "flapping: 3 restarts within 600s; last: exited unexpectedly (exit status 1)"
    assert fsm.reason.startswith("flapping: ")
    assert fsm.incarnation == 4 and fsm.restarts == 3  # no fifth incarnation
    assert seen[-1] == Transition("e0", S.EXITED, S.FATAL, fsm.reason, 40.0, 4, Cause.FLAPPING)
    assert fsm.last_error == "exited unexpectedly (exit status 1)"


def test_restarts_spaced_wider_than_the_window_never_flap():
    fsm, clock, seen = make(restart=RestartPolicy(flapping_window=600.0, flapping_max_restarts=3))
    fsm.begin_start("start")
    times = [601.0 * i for i in range(1, 11)]
    assert _crash_loop(fsm, clock, times) == [True] * 10
    assert fsm.state is S.STARTING and fsm.restarts == 10


@pytest.mark.parametrize("fourth, allowed", [(650.0, False), (701.0, True)])
def test_the_window_slides(fourth, allowed):
    # Restarts at 100, 200, 300: at 650 all three are inside the 600 s window; at 701 the
    # one at 100 has left it, so a fourth restart is allowed.
    fsm, clock, seen = make(restart=RestartPolicy(flapping_window=600.0, flapping_max_restarts=3))
    fsm.begin_start("start")
    assert _crash_loop(fsm, clock, [100.0, 200.0, 300.0]) == [True, True, True]
    assert _crash_loop(fsm, clock, [fourth]) == [allowed]
    assert fsm.state is (S.STARTING if allowed else S.FATAL)


def test_start_retries_count_towards_the_flapping_window():
    policy = RestartPolicy(start_retries=100, flapping_window=600.0, flapping_max_restarts=2)
    fsm, clock, seen = make(restart=policy)
    fsm.begin_start("start")
    for t in (1.0, 2.0):
        fsm.start_failed("boom")
        clock.now = t
        assert fsm.begin_start("retry") is True
    fsm.start_failed("boom")
    clock.now = 3.0
    assert fsm.begin_start("retry") is False
    assert fsm.state is S.FATAL
    assert fsm.reason.startswith("flapping: 2 restarts within 600s; last: start failed (3/100): boom")
    assert edges(seen)[-1] == (S.BACKOFF, S.FATAL)


# -- probes in states that are not probed ---------------------------------------------------


@pytest.mark.parametrize("state", [S.STOPPED, S.STARTING, S.SYNCING, S.STOPPING, S.EXITED, S.BACKOFF, S.FATAL])
@pytest.mark.parametrize("outcome", [TIMEOUT, OK], ids=["fail", "ok"])
def test_probe_results_in_unprobed_states_are_ignored(state, outcome):
    fsm, clock, seen = make(probe=ProbePolicy(failure_threshold=1, success_threshold=1))
    REACH[state](fsm, clock)
    assert fsm.state is state
    before = (fsm.reason, fsm.since, fsm.consecutive_failures, fsm.consecutive_successes,
              fsm.last_probe, len(seen))
    clock.now += 1.0
    assert fsm.probe_result(outcome) is False
    assert fsm.report_failure("connection refused") is False
    assert fsm.state is state
    assert (fsm.reason, fsm.since, fsm.consecutive_failures, fsm.consecutive_successes,
            fsm.last_probe, len(seen)) == before


@pytest.mark.parametrize("state", list(State))
def test_probed_only_when_stale_running_suspect_or_standby(state):
    fsm, clock, seen = make()
    fsm.state = state
    assert fsm.probed is (state in {S.STALE, S.RUNNING, S.SUSPECT, S.STANDBY})


# -- the transition callback ----------------------------------------------------------------


def test_on_transition_gets_one_record_per_change_with_clock_time():
    fsm, clock, seen = make(now=3.0)
    fsm.begin_start("start")
    clock.now = 4.25
    fsm.became_ready(None, None)
    clock.now = 9.0
    fsm.probe_result(OK)  # no change: no record
    fsm.annotate("restart after round 412")  # no change: no record
    assert fsm.reason == "restart after round 412"
    clock.now = 11.5
    fsm.probe_result(TIMEOUT)
    clock.now = 12.0
    fsm.exited("killed by SIGKILL")
    assert seen == [
        Transition("e0", S.STOPPED, S.STARTING, "start", 3.0, 1, Cause.START),
        Transition("e0", S.STARTING, S.RUNNING, "ready in 1.2s; base weights", 4.25, 1, Cause.READY),
        Transition("e0", S.RUNNING, S.SUSPECT, "1/3 probe failures (last: timeout after 5.0s)", 11.5, 1,
                   Cause.PROBE),
        Transition("e0", S.SUSPECT, S.EXITED, "exited unexpectedly (killed by SIGKILL)", 12.0, 1, Cause.EXIT),
    ]
    assert fsm.since == 12.0


def test_callback_sees_the_new_state_already_applied():
    clock = FakeClock(1.0)
    states = []
    fsm = EngineFSM("e1", ProbePolicy(), RestartPolicy(), clock)
    fsm.on_transition = lambda t: states.append((t.to_state, fsm.state, fsm.reason == t.reason))
    fsm.begin_start("start")
    assert states == [(S.STARTING, S.STARTING, True)]


def test_no_callback_is_fine():
    fsm = EngineFSM("e2", ProbePolicy(), RestartPolicy(), FakeClock(0.0))
    assert fsm.begin_start("start")
    assert fsm.became_ready(None, None).to_state is S.RUNNING


# -- backoff_delay and routable -------------------------------------------------------------


class EdgeRng:
    """uniform() answers one end of its range."""

    def __init__(self, end: str):
        self.end = end
        self.calls: list[tuple[float, float]] = []

    def uniform(self, a: float, b: float) -> float:
        self.calls.append((a, b))
        return a if self.end == "low" else b


@pytest.mark.parametrize(
    "failures, base",
    [(0, 1.0), (1, 1.0), (2, 2.0), (3, 4.0), (6, 32.0), (7, 60.0), (50, 60.0)],
)
def test_backoff_delay_doubles_from_initial_and_is_capped(failures, base):
    policy = RestartPolicy(backoff_initial=1.0, backoff_max=60.0)
    hi, lo = EdgeRng("high"), EdgeRng("low")
    assert backoff_delay(failures, policy, hi) == base
    assert backoff_delay(failures, policy, lo) == base / 2
    assert hi.calls == [(0.5, 1.0)]


def test_backoff_delay_jitters_inside_half_to_full():
    policy = RestartPolicy(backoff_initial=0.5, backoff_max=10.0)
    rng = random.Random(0)
    for n in range(1, 12):
        d = min(policy.backoff_max, policy.backoff_initial * 2 ** (n - 1))
        samples = [backoff_delay(n, policy, rng) for _ in range(50)]
        assert all(d / 2 <= x <= d for x in samples)
        assert len(set(samples)) > 1  # jittered, not constant
    # Same seed, same delays.
    assert [backoff_delay(3, policy, random.Random(5)) for _ in range(3)] == \
        [backoff_delay(3, policy, random.Random(5))] * 3


@pytest.mark.parametrize("state", list(State))
def test_routable_only_when_running_or_suspect(state):
    fsm, clock, seen = make()
    fsm.state = state
    assert fsm.routable is (state in {S.RUNNING, S.SUSPECT})


def test_detection_kinds_name_how_an_engine_was_found_unusable():
    from vime.supervisor.metrics import detection_kind

    def t(from_state, to_state, cause, reason="whatever the words"):
        return Transition("e0", from_state, to_state, reason, 0.0, 1, cause)

    assert detection_kind(t(S.SUSPECT, S.UNHEALTHY, Cause.HANG)) == "hang"
    assert detection_kind(t(S.RUNNING, S.UNHEALTHY, Cause.BUSY)) == "hang"
    assert detection_kind(t(S.RUNNING, S.UNHEALTHY, Cause.PAUSED)) == "hang"
    assert detection_kind(t(S.SUSPECT, S.UNHEALTHY, Cause.REPORTED)) == "reported"
    assert detection_kind(t(S.RUNNING, S.UNHEALTHY, Cause.POISONED)) == "poisoned"
    assert detection_kind(t(S.SYNCING, S.UNHEALTHY, Cause.SYNC_FAILED)) == "poisoned"
    assert detection_kind(t(S.RUNNING, S.EXITED, Cause.EXIT)) == "exit"
    # Not detections: our own stop ending, a state change that finds nothing wrong.
    assert detection_kind(t(S.STOPPING, S.EXITED, Cause.HANG)) is None
    assert detection_kind(t(S.RUNNING, S.SUSPECT, Cause.PROBE)) is None
    # The reason's words play no part.
    assert detection_kind(t(S.SUSPECT, S.UNHEALTHY, Cause.HANG, "poisoned: (last: reported: x)")) == "hang"


# -- late probes excused as busy or paused, within their bounds --------------------------------

BUSY_LATE = ProbeOutcome(True, "busy: probe late (>2s), no tokens, processes at 97% of a core", excuse="busy")
PAUSED_LATE = ProbeOutcome(True, "paused: probe late (>2s), generation held by /pause", excuse="paused")


def test_busy_probes_are_not_failures_until_max_busy():
    fsm, clock, seen = running(probe=ProbePolicy(interval=1, timeout=2, failure_threshold=2, max_busy=30))
    for t in range(11, 40, 3):  # 29 s of busy probes: under max_busy
        clock.now = float(t)
        assert fsm.probe_result(BUSY_LATE) is False
    assert fsm.state is S.RUNNING and fsm.consecutive_failures == 0 and seen == []
    clock.now = 41.0  # 30 s after the first busy probe
    assert fsm.probe_result(BUSY_LATE) is True
    assert fsm.state is S.UNHEALTHY
    assert fsm.reason.startswith("hung: busy for 30s without progress (last: busy: probe late")


def test_progress_or_an_answer_ends_a_busy_run():
    fsm, clock, _ = running(probe=ProbePolicy(interval=1, timeout=2, failure_threshold=2, max_busy=30))
    clock.now = 11.0
    fsm.probe_result(BUSY_LATE)
    clock.now = 35.0
    fsm.probe_result(ProbeOutcome(True, "busy: probe late (>2s), 12 tokens processed meanwhile"))
    assert fsm.excused_since is None
    clock.now = 40.0
    assert fsm.probe_result(BUSY_LATE) is False  # a new run starts here
    clock.now = 69.0
    assert fsm.probe_result(BUSY_LATE) is False and fsm.state is S.RUNNING
    clock.now = 70.0
    assert fsm.probe_result(BUSY_LATE) is True


def test_a_failure_inside_a_busy_run_counts_and_does_not_restart_the_clock():
    fsm, clock, _ = running(probe=ProbePolicy(interval=1, timeout=2, failure_threshold=2, max_busy=30))
    clock.now = 11.0
    fsm.probe_result(BUSY_LATE)
    clock.now = 14.0
    assert fsm.probe_result(TIMEOUT) is False and fsm.state is S.SUSPECT
    clock.now = 17.0
    assert fsm.probe_result(BUSY_LATE) is False and fsm.consecutive_failures == 0
    assert fsm.excused_since == 11.0  # still the run that began at 11
    clock.now = 41.0
    assert fsm.probe_result(BUSY_LATE) is True and fsm.reason.startswith("hung: busy for 30s")


def test_alternating_excuses_cannot_escape_the_bound():
    """Review: /is_paused flipping on each call while the group burns CPU kept an engine that
    never answered RUNNING for 54 s with max_busy 6 s; the run is bounded whatever the excuse."""
    fsm, clock, _ = running(probe=ProbePolicy(interval=1, timeout=2, failure_threshold=2, max_busy=6,
                                               max_paused=8))
    for i, t in enumerate(range(11, 17)):
        clock.now = float(t)
        assert fsm.probe_result(PAUSED_LATE if i % 2 else BUSY_LATE) is False
    clock.now = 17.0
    assert fsm.probe_result(BUSY_LATE) is True and fsm.reason.startswith("hung: busy for 6s")


def test_paused_is_bounded_by_max_paused_not_max_busy():
    fsm, clock, _ = running(probe=ProbePolicy(interval=1, timeout=2, failure_threshold=2, max_busy=5,
                                               max_paused=60))
    clock.now = 11.0
    fsm.probe_result(PAUSED_LATE)
    clock.now = 70.0
    assert fsm.probe_result(PAUSED_LATE) is False and fsm.state is S.RUNNING
    clock.now = 71.0
    assert fsm.probe_result(PAUSED_LATE) is True
    assert fsm.reason.startswith("hung: paused for 60s (longer than sync_timeout, 60s)")


def test_a_new_incarnation_starts_with_no_busy_run():
    fsm, clock, _ = running(probe=ProbePolicy(interval=1, timeout=2, failure_threshold=2, max_busy=30))
    clock.now = 11.0
    fsm.probe_result(BUSY_LATE)
    fsm.exited("killed by SIGKILL")
    fsm.begin_start("restart")
    assert fsm.excused_since is None and fsm.excuse is None


def test_recovered_attached_engine_is_held_during_a_round():
    """Fault 11: membership grows only in gaps, also for an attached engine that recovers."""
    fsm, clock, seen = running()
    fsm.probe_result(TIMEOUT), fsm.probe_result(TIMEOUT), fsm.probe_result(TIMEOUT)
    assert fsm.state is S.UNHEALTHY
    fsm.recovered(None, None, hold="held out of routing until round 3 ends")
    assert fsm.state is S.STALE and fsm.held and "until round 3 ends" in fsm.reason
    fsm.release("round 3 ended", None)
    assert fsm.state is S.RUNNING


# -- causes: what machines read instead of the reason ----------------------------------------


def causes(seen: list[Transition]) -> list[tuple[State, Cause]]:
    return [(t.to_state, t.cause) for t in seen]


def test_every_transition_carries_a_lower_case_cause():
    fsm, clock, seen = make()
    fsm.begin_start("start")
    fsm.became_ready(None, None)
    fsm.probe_result(TIMEOUT)
    fsm.probe_result(OK)
    assert causes(seen) == [(S.STARTING, Cause.START), (S.RUNNING, Cause.READY),
                            (S.SUSPECT, Cause.PROBE), (S.RUNNING, Cause.RECOVERED)]
    assert all(t.cause.value == t.cause.value.lower() for t in seen)
    assert fsm.cause is Cause.RECOVERED


def test_a_hang_keeps_its_cause_through_the_stop_and_the_restart_says_restart():
    fsm, clock, seen = running(probe=ProbePolicy(failure_threshold=2))
    fsm.probe_result(TIMEOUT)
    assert fsm.probe_result(TIMEOUT)
    fsm.stopping(fsm.reason)
    fsm.exited("killed by SIGTERM")
    clock.now = 100.0
    fsm.begin_start("restart #1")
    assert causes(seen) == [(S.SUSPECT, Cause.PROBE), (S.UNHEALTHY, Cause.HANG), (S.STOPPING, Cause.HANG),
                            (S.EXITED, Cause.HANG), (S.STARTING, Cause.RESTART)]


def test_reported_failures_are_reported_not_hang():
    fsm, clock, seen = running(probe=ProbePolicy(failure_threshold=2))
    fsm.report_failure("connection reset")
    assert fsm.report_failure("connection reset")
    assert causes(seen) == [(S.SUSPECT, Cause.REPORTED), (S.UNHEALTHY, Cause.REPORTED)]


def test_a_busy_run_past_its_bound_is_busy_and_a_paused_one_paused():
    for late, cause in ((BUSY_LATE, Cause.BUSY), (PAUSED_LATE, Cause.PAUSED)):
        fsm, clock, seen = running(probe=ProbePolicy(max_busy=30, max_paused=30))
        clock.now = 11.0
        fsm.probe_result(late)
        clock.now = 50.0
        assert fsm.probe_result(late)
        assert causes(seen) == [(S.UNHEALTHY, cause)]


def test_an_unexpected_exit_is_exit_and_an_operator_stop_operator():
    fsm, clock, seen = running()
    fsm.exited("killed by SIGKILL")
    fsm.stopped("stopped by request")
    assert causes(seen) == [(S.EXITED, Cause.EXIT), (S.STOPPED, Cause.OPERATOR)]


def test_sync_causes_and_a_poisoned_engine():
    fsm, clock, seen = make()
    fsm.begin_start("start")
    fsm.became_ready(None, 3)
    fsm.sync_started("trainer agent pushing v3")
    fsm.sync_finished(3)
    fsm.version_behind(4)
    fsm.sync_started("trainer agent pushing v4")
    fsm.mark_unusable("poisoned: push of v4 failed", Cause.SYNC_FAILED)
    assert causes(seen)[1:] == [(S.STALE, Cause.READY), (S.SYNCING, Cause.SYNC), (S.RUNNING, Cause.VERIFIED),
                                (S.STALE, Cause.OUTDATED), (S.SYNCING, Cause.SYNC),
                                (S.UNHEALTHY, Cause.SYNC_FAILED)]


def test_flapping_is_its_own_cause():
    fsm, clock, seen = make(restart=RestartPolicy(flapping_max_restarts=1))
    fsm.begin_start("start")
    fsm.became_ready(None, None)
    fsm.exited("exit status 1")
    assert fsm.begin_start("restart #1")
    fsm.became_ready(None, None)
    fsm.exited("exit status 1")
    assert not fsm.begin_start("restart #2")
    assert causes(seen)[-1] == (S.FATAL, Cause.FLAPPING)


# -- permanent start failures: FATAL at once -------------------------------------------------


def test_a_permanent_start_failure_is_fatal_at_once_with_budget_left():
    fsm, clock, seen = make(restart=RestartPolicy(start_retries=5))
    fsm.begin_start("start")
    assert fsm.start_failed("exit status 1 while starting: bad model path: No such file", permanent=True) is None
    assert fsm.state is S.FATAL
    assert fsm.failed_starts == 1
    assert fsm.reason == ("start failed, not retried (permanent): "
                          "exit status 1 while starting: bad model path: No such file")
    assert fsm.last_error.startswith("exit status 1 while starting")
    assert causes(seen)[-1] == (S.FATAL, Cause.START_FAILED)
    assert fsm.backoff_until is None


def test_a_transient_start_failure_backs_off_as_before():
    fsm, clock, seen = make(restart=RestartPolicy(start_retries=2))
    fsm.begin_start("start")
    assert fsm.start_failed("port 8001 still in use by another process", permanent=False) is not None
    assert fsm.state is S.BACKOFF
    assert causes(seen)[-1] == (S.BACKOFF, Cause.START_FAILED)
    clock.now = fsm.backoff_until
    fsm.begin_start("retry after start failure 1", cause=Cause.RETRY)
    assert causes(seen)[-1] == (S.STARTING, Cause.RETRY)
    assert fsm.start_failed("port 8001 still in use by another process") is None
    assert fsm.reason.startswith("start retries exhausted (2)")


def test_an_operator_start_after_a_permanent_failure_gets_a_fresh_budget():
    fsm, clock, seen = make()
    fsm.begin_start("start")
    fsm.start_failed("bad model path", permanent=True)
    fsm.reset_budget()
    assert fsm.begin_start("started by request", cause=Cause.OPERATOR)
    assert fsm.failed_starts == 0
    assert causes(seen)[-1] == (S.STARTING, Cause.OPERATOR)


def test_a_slow_start_backs_off_with_its_cause():
    fsm, clock, seen = make()
    fsm.begin_start("start")
    fsm.stopping("not ready within first_wait (300s)", Cause.SLOW_START)
    fsm.start_failed("not ready within first_wait (300s); stopped (killed by SIGTERM)", cause=Cause.SLOW_START)
    assert causes(seen)[-2:] == [(S.STOPPING, Cause.SLOW_START), (S.BACKOFF, Cause.SLOW_START)]


@pytest.mark.parametrize("tail, permanent, what", [
    ("Traceback ...\nOSError: /models/polcy does not appear to have a file named config.json", True,
     "bad model path"),
    ("huggingface_hub.errors.HFValidationError: Repo id must be in the form 'repo_name'", True, "bad model path"),
    ("api_server.py: error: unrecognized arguments: --no-such-flag", True, "config error"),
    ("OSError: [Errno 98] Address already in use", False, "port still in use"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", False, "out of memory"),
    ("RuntimeError: something nobody classified", False, "RuntimeError"),
    ("", False, "no output"),
    # vLLM's pydantic config check (a model type it does not know).
    ("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
     "  Value error, The checkpoint you are trying to load has model type `no-such-architecture`", True,
     "config error"),
    # A missing file is the model's only when the line names the configured model.
    ("FileNotFoundError: [Errno 2] No such file or directory: '/models/polcy/config.json'", True,
     "bad model path"),
    ("zmq.error.ZMQError: No such file or directory (addr='ipc:///tmp/abc')", False, "zmq.error"),
    # Noise after the root cause: multiprocessing's resource_tracker follows an out-of-memory.
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
     "RuntimeError: Engine core initialization failed. See root cause above.\n"
     "resource_tracker.py:267: UserWarning: resource_tracker: '/psm_1234': [Errno 2] No such file or "
     "directory: '/psm_1234'", False, "out of memory"),
    # An unrelated early warning, and an engine core killed by a signal (the OOM killer).
    ("WARNING Could not read /sys/class/infiniband: [Errno 2] No such file or directory\n"
     "RuntimeError: Engine core initialization failed. See root cause above. "
     "Failed core proc(s): {'EngineCore_DP0': -9}", False, "engine core killed by a signal"),
    # "TypeError: argument ..." is not argparse's "prog: error: argument ...".
    ("TypeError: argument of type 'NoneType' is not iterable", False, "TypeError"),
])
def test_classify_failure_calls_only_what_it_recognises_permanent(tail, permanent, what):
    from vime.supervisor.engine.process import classify_failure

    got, summary = classify_failure(tail, "/models/polcy")
    assert got is permanent
    assert summary.startswith(what)


# -- warm spares (STANDBY) ------------------------------------------------------------------


def test_a_ready_engine_the_fleet_does_not_need_is_a_spare_even_in_a_round():
    fsm, clock, seen = make()
    fsm.begin_start("start")
    clock.now = 5.0
    fsm.became_ready(3, 3, hold="held out of routing until round 7 ends", spare="a spare: 2/2 engines active")
    assert fsm.state is S.STANDBY and fsm.cause is Cause.SPARE and not fsm.routable and fsm.probed
    assert "a spare: 2/2" in fsm.reason and "weights v3, verified" in fsm.reason


def test_a_ready_engine_behind_is_stale_even_when_a_spare():
    fsm, clock, seen = make()
    fsm.begin_start("start")
    fsm.became_ready(None, 3, spare="a spare: 2/2 engines active")
    assert fsm.state is S.STALE  # its version is checked (and it may be parked) by the sync


def test_a_spare_never_goes_suspect_and_is_stopped_at_the_threshold():
    fsm, clock, seen = make(probe=ProbePolicy(failure_threshold=2))
    fsm.begin_start("start")
    fsm.became_ready(None, None, spare="a spare")
    seen.clear()
    assert fsm.probe_result(TIMEOUT) is False
    assert fsm.state is S.STANDBY and "1/2 probe failures" in fsm.reason and not fsm.routable
    assert fsm.probe_result(TIMEOUT) is True
    assert edges(seen) == [(S.STANDBY, S.UNHEALTHY)] and fsm.cause is Cause.HANG


@pytest.mark.parametrize("have,current,to", [(3, 3, S.RUNNING), (None, None, S.RUNNING), (2, 3, S.STALE)])
def test_a_promoted_spare_serves_at_once_only_at_the_current_version(have, current, to):
    fsm, clock, seen = make()
    fsm.begin_start("start")
    fsm.became_ready(have, have, spare="a spare")
    fsm.promote("1/2 engines active, round 7 ended", current)
    assert fsm.state is to and fsm.cause is Cause.PROMOTED and fsm.reason.startswith("promoted: 1/2")


def test_release_and_a_verified_sync_park_an_engine_not_needed():
    fsm, clock, seen = make()
    fsm.begin_start("start")
    fsm.became_ready(3, 3, hold="held out of routing until round 7 ends")
    assert fsm.state is S.STALE and fsm.held
    fsm.release("round 7 ended", 3, spare="a spare: 2/2 engines active")
    assert fsm.state is S.STANDBY and not fsm.held
    fsm.promote("1/2 engines active", 4)
    fsm.sync_started("pushing v4")
    fsm.sync_finished(4, spare="a spare: 2/2 engines active")  # kept current, still not needed
    assert fsm.state is S.STANDBY and fsm.weight_version == 4


def test_standby_edges():
    assert TRANSITIONS[S.STANDBY] == {S.RUNNING, S.STALE, S.UNHEALTHY, S.STOPPING, S.EXITED}
    assert S.STANDBY in TRANSITIONS[S.STARTING] and S.STANDBY in TRANSITIONS[S.STALE]
    assert S.STANDBY not in TRANSITIONS[S.RUNNING]  # a serving engine is never demoted to a spare
