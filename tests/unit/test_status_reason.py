"""`status`'s reason for an engine says the present: the weights clause its state's reason was
written with (engine/fsm.py, at its last transition) is said again from the version it holds
and the current one now, in the probed states; publishes and pushes read again move those
without a transition. The reasons are the real FSM's (EngineFSM), not copies of its wording."""

from __future__ import annotations

import random

import pytest

from vime.supervisor.config import ProbePolicy, RestartPolicy
from vime.supervisor.engine.fingerprint import unverified
from vime.supervisor.engine.fsm import EngineFSM
from vime.supervisor.states import SYNC_RULE, State, VersionRule, WeightsMode
from vime.supervisor.status import reason_now

ASYNC = VersionRule(WeightsMode.ASYNC, 1)


def ready(version, current, rule=SYNC_RULE, **kw) -> EngineFSM:
    """An engine started at t=0 and ready at t=1.5 holding `version` while `current` is published."""
    now = [0.0]
    fsm = EngineFSM("e0", ProbePolicy(), RestartPolicy(), lambda: now[0], rng=random.Random(1))
    assert fsm.begin_start("start")
    now[0] = 1.5
    fsm.became_ready(version, current, rule=rule, **kw)
    return fsm


def now(fsm: EngineFSM, current, rule=SYNC_RULE, held: object = "as held") -> str:
    return reason_now(fsm.reason, fsm.state, fsm.weight_version if held == "as held" else held, current, rule)


@pytest.mark.parametrize("make, current, rule", [
    (lambda: ready(3, 3), 3, SYNC_RULE),                                   # RUNNING, current
    (lambda: ready(2, 3, ASYNC), 3, ASYNC),                                # RUNNING, 1 behind within the bound
    (lambda: ready(1, 3), 3, SYNC_RULE),                                   # STALE, behind
    (lambda: ready(None, None), None, SYNC_RULE),                          # RUNNING, base weights
    (lambda: ready(2, 3, spare="spares full", behind_ok=True), 3, SYNC_RULE),  # STANDBY kept behind
    (lambda: ready(3, 3, hold="round 4 open: joins routing in the gap"), 3, SYNC_RULE),  # STALE, held
])
def test_right_after_a_transition_the_reason_reads_as_the_fsm_wrote_it(make, current, rule):
    fsm = make()
    assert now(fsm, current, rule) == fsm.reason


def test_an_engine_serving_on_within_max_staleness_says_how_far_behind_it_is_now():
    fsm = ready(3, 3, ASYNC)
    assert (fsm.state, fsm.reason) == (State.RUNNING, "ready in 1.5s; weights v3, verified")
    assert now(fsm, 4, ASYNC) == "ready in 1.5s; weights v3, verified, 1 behind v4 (within max_staleness)"


def test_an_engine_relabelled_at_the_new_version_says_it_holds_it():
    """Pushed to v4 (an announced push's read, then the publish): listed at v4, not at v3."""
    fsm = ready(3, 3, ASYNC)
    fsm.relabelled(4, 4, "/weight_info read after push p-1 (v4)", rule=ASYNC)
    assert fsm.state is State.RUNNING and fsm.reason == "ready in 1.5s; weights v3, verified"
    assert now(fsm, 4, ASYNC) == "ready in 1.5s; weights v4, verified"
    assert now(fsm, 5, ASYNC) == "ready in 1.5s; weights v4, verified, 1 behind v5 (within max_staleness)"


def test_base_weights_then_the_first_version_pushed_and_published():
    fsm = ready(None, None)
    assert fsm.reason == "ready in 1.5s; base weights"
    assert now(fsm, 1, held=1) == "ready in 1.5s; weights v1, verified"
    assert now(fsm, 1) == "ready in 1.5s; weights base, current v1"  # still on base weights: behind


def test_a_stale_engine_says_the_current_version_now():
    fsm = ready(3, 3)
    fsm.version_behind(4)
    assert (fsm.state, fsm.reason) == (State.STALE, "weights v3, current v4")
    assert now(fsm, 5) == "weights v3, current v5"
    assert now(fsm, 5, held=unverified(5)) == f"weights v{unverified(5)}, current v5"


def test_verified_then_overtaken_says_both():
    fsm = ready(3, 3, hold="round 4 open: joins routing in the gap")
    assert fsm.state is State.STALE
    assert now(fsm, 4) == "ready in 1.5s; round 4 open: joins routing in the gap"  # no weights clause: as it is
    fsm.sync_started("sync to v4")
    fsm.sync_finished(3, hold="round 4 open")
    assert now(fsm, 4) == "weights v3, verified, current v4; round 4 open"


def test_a_spare_kept_behind_says_its_version_and_once_current_that_it_is():
    fsm = ready(2, 3, spare="spares full", behind_ok=True)
    assert (fsm.state, fsm.reason) == (State.STANDBY, "ready in 1.5s; weights v2; spares full")
    assert now(fsm, 4) == "ready in 1.5s; weights v2; spares full"
    assert now(fsm, 4, held=4) == "ready in 1.5s; weights v4, verified; spares full"


def test_a_stopped_or_exited_engine_keeps_why_it_stopped():
    fsm = ready(3, 3)
    fsm.stopping("retired: weights v3, current v3")  # a reason with a clause, as it was then
    fsm.exited("exit 0")
    assert fsm.state is State.EXITED and "weights v3, current v3" in fsm.reason
    assert now(fsm, 7) == fsm.reason


def test_an_engine_reporting_a_version_before_any_publish_says_that_version_not_base_weights():
    """Attached with weights of its own: /weight_info reads v7 while nothing is published."""
    fsm = ready(7, None)
    assert (fsm.state, fsm.weight_version, fsm.reason) == (State.RUNNING, 7, "ready in 1.5s; base weights")
    assert now(fsm, None) == "ready in 1.5s; weights v7 (the engine's own label), none published yet"
    assert now(fsm, 7) == "ready in 1.5s; weights v7, verified"  # then published as v7
    assert now(ready(None, None), None) == "ready in 1.5s; base weights"  # reporting none: base weights


@pytest.mark.parametrize("reason, state, held, expected", [
    ("weights v5, current v7", State.STALE, 5, "weights v5, current base"),
    ("ready in 1.5s; weights v7, verified", State.RUNNING, 7, "ready in 1.5s; base weights"),
    ("ready in 1.5s; weights v2; spares full", State.STANDBY, 2, "ready in 1.5s; base weights; spares full"),
])
def test_only_a_base_weights_clause_is_said_as_the_engines_own_label_before_any_publish(reason, state, held, expected):
    """With nothing published, a clause naming a version reads as it did before that wording
    existed: only "base weights" on an engine that reports a version becomes its own label."""
    assert reason_now(reason, state, held, None, SYNC_RULE) == expected
