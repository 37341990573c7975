"""An announced weight push's deadline as a paused engine's excuse, and the book of pushes:
pure, driven by a fake clock (no engines, no sleeping). Through a real daemon in
tests/daemon/test_push_announce.py."""

from __future__ import annotations

import random

import pytest

from vime.supervisor.config import ProbePolicy, RestartPolicy
from vime.supervisor.engine.fsm import EngineFSM, PushWindow
from vime.supervisor.errors import BadRequest, Conflict
from vime.supervisor.states import Cause, ProbeOutcome, State, Transition
from vime.supervisor.sync import PUSH_GRACE, PushBook

S = State
OK = ProbeOutcome(True, "ok", 0.01)
PAUSED = ProbeOutcome(True, "paused: probe late (>2s), generation held by /pause", excuse="paused")
SYNC_TIMEOUT = 300.0


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def running(clock: FakeClock, name: str = "e0") -> tuple[EngineFSM, list[Transition]]:
    seen: list[Transition] = []
    fsm = EngineFSM(name, ProbePolicy(max_paused=SYNC_TIMEOUT), RestartPolicy(), clock, rng=random.Random(1),
                    on_transition=seen.append)
    assert fsm.begin_start("start")
    fsm.became_ready(None, None)
    assert fsm.state is S.RUNNING
    seen.clear()
    return fsm, seen


def paused_until(fsm: EngineFSM, clock: FakeClock, until: float, step: float = 1.0) -> float | None:
    """Paused probes every `step` s up to `until`: when the engine was condemned, or None."""
    while clock.now <= until:
        if fsm.probe_result(PAUSED):
            return clock.now
        clock.now += step
    return None


# -- the excuse ---------------------------------------------------------------------------------


def test_a_receiver_is_excused_up_to_the_push_deadline_and_condemned_after():
    clock = FakeClock(100.0)
    fsm, seen = running(clock)
    fsm.push_announced(PushWindow("p-1", clock.now + 20.0, 20.0))
    assert paused_until(fsm, clock, 119.0) is None  # every paused probe before the deadline: excused
    assert fsm.state is S.RUNNING and seen == []
    clock.now = 120.0
    assert fsm.probe_result(PAUSED) is True  # at the deadline, still paused: condemned
    assert fsm.state is S.UNHEALTHY and fsm.cause is Cause.PAUSED
    assert "past the deadline of push p-1 (20s after it was announced)" in fsm.reason, fsm.reason
    assert [(t.from_state, t.to_state, t.cause) for t in seen] == [(S.RUNNING, S.UNHEALTHY, Cause.PAUSED)]


def test_a_push_deadline_longer_than_sync_timeout_excuses_longer():
    """A big push (a 790B apply) announced with 900 s is not cut at sync_timeout (300 s)."""
    clock = FakeClock()
    fsm, _ = running(clock)
    fsm.push_announced(PushWindow("big", clock.now + 900.0, 900.0))
    assert paused_until(fsm, clock, 899.0, step=10.0) is None
    assert fsm.state is S.RUNNING
    clock.now = 901.0
    assert fsm.probe_result(PAUSED) and fsm.cause is Cause.PAUSED


def test_an_engine_outside_the_push_keeps_sync_timeout():
    clock = FakeClock()
    inside, _ = running(clock, "inside")
    outside, _ = running(clock, "outside")
    inside.push_announced(PushWindow("p-2", clock.now + 10.0, 10.0))
    condemned: dict[str, float] = {}
    while clock.now <= SYNC_TIMEOUT + 5:
        for fsm in (inside, outside):
            if fsm.name not in condemned and fsm.probe_result(PAUSED):
                condemned[fsm.name] = clock.now
        clock.now += 1.0
    assert condemned["inside"] == 10.0  # the push's deadline
    assert condemned["outside"] == SYNC_TIMEOUT  # sync_timeout, from its first paused probe at 0
    assert "longer than sync_timeout" in outside.reason


def test_a_pause_before_the_announcement_still_ends_at_the_push_deadline():
    """The excuse is the deadline, whenever the pause began: a push does not reset the run."""
    clock = FakeClock()
    fsm, _ = running(clock)
    assert paused_until(fsm, clock, 50.0) is None
    fsm.push_announced(PushWindow("p-3", clock.now + 5.0, 5.0))
    assert paused_until(fsm, clock, 60.0) == 56.0
    assert "paused for 56s past the deadline of push p-3" in fsm.reason, fsm.reason


def test_a_push_ended_gives_the_pause_sync_timeout_again():
    clock = FakeClock()
    fsm, _ = running(clock)
    fsm.push_announced(PushWindow("p-4", 10.0, 10.0))
    assert paused_until(fsm, clock, 5.0) is None
    fsm.push_ended("other")  # not its push: nothing changes
    assert fsm.push is not None
    fsm.push_ended("p-4")
    assert fsm.push is None
    assert paused_until(fsm, clock, SYNC_TIMEOUT - 1) is None  # paused since 0: sync_timeout's bound
    assert paused_until(fsm, clock, SYNC_TIMEOUT + 1) == SYNC_TIMEOUT


def test_answering_past_the_deadline_drops_the_window_and_a_later_pause_is_judged_afresh():
    clock = FakeClock()
    fsm, _ = running(clock)
    fsm.push_announced(PushWindow("p-5", 10.0, 10.0))
    clock.now = 5.0
    assert not fsm.probe_result(OK)
    assert fsm.push is not None  # before the deadline: the push is still going on
    clock.now = 12.0
    assert not fsm.probe_result(OK)
    assert fsm.push is None  # past it and answering: this engine is done with it
    clock.now = 20.0
    assert paused_until(fsm, clock, 100.0) is None  # a later unannounced pause has sync_timeout


def test_a_new_incarnation_is_in_no_push():
    clock = FakeClock()
    fsm, _ = running(clock)
    fsm.push_announced(PushWindow("p-6", 10.0, 10.0))
    fsm.mark_unusable("poisoned", Cause.POISONED)
    fsm.stopping("poisoned")
    fsm.exited("signal 15")
    assert fsm.begin_start("restart")
    assert fsm.push is None


# -- the book of pushes -------------------------------------------------------------------------


def test_the_book_announces_lists_and_ends():
    clock = FakeClock(1000.0)
    book = PushBook(clock)
    p = book.announce(7, ["a", "b"], 1 << 30, 30.0, current_version=6)
    assert p.deadline == 1030.0 and p.expires == 1030.0 + PUSH_GRACE
    assert book.holding("a") is p and book.holding("c") is None
    clock.now = 1010.0
    assert p.info(clock.now)["remaining_s"] == 20.0
    assert book.wait_bound() == 20.0 + PUSH_GRACE
    assert book.end(p.id) is p
    assert book.end(p.id) is None and book.in_flight() == [] and book.wait_bound() == 0.0


def test_a_push_never_ended_expires_after_its_deadline_and_the_grace():
    clock = FakeClock()
    book = PushBook(clock)
    p = book.announce(1, ["a"], 0, 10.0, current_version=None)
    q = book.announce(1, ["b"], 0, 60.0, current_version=None)
    clock.now = 10.0 + PUSH_GRACE - 0.01
    assert book.expired() == []
    clock.now = 10.0 + PUSH_GRACE
    assert book.expired() == [p]
    assert book.in_flight() == [q] and book.holding("a") is None
    assert book.expired() == []  # taken out once


def test_the_grace_is_at_least_one_probe_cycle():
    """A receiver paused past the deadline is judged at its next probe: the push must not expire
    before it (a 10 s interval and 5 s of grace would lose the condemnation's record)."""
    clock = FakeClock()
    assert PushBook(clock, grace=12.0).announce(1, ["a"], 0, 10.0, current_version=None).expires == 22.0
    assert PushBook(clock, grace=1.0).announce(1, ["a"], 0, 10.0, current_version=None).expires == 10.0 + PUSH_GRACE


@pytest.mark.parametrize("args, error, match", [
    ((5, [], 0, 1.0), BadRequest, "at least one engine"),
    ((5, ["a", "a"], 0, 1.0), BadRequest, "more than once"),
    ((5, ["a"], -1, 1.0), BadRequest, "bytes must be >= 0"),
    ((5, ["a"], 0, 0.0), BadRequest, "deadline_s must be"),
    ((5, ["a"], 0, float("nan")), BadRequest, "deadline_s must be"),
    ((5, ["a"], 0, 1e9), BadRequest, "deadline_s must be"),
    ((4, ["a"], 0, 1.0), Conflict, "version 4 is stale: the current version is 5"),
])
def test_a_bad_announcement_is_refused_and_changes_nothing(args, error, match):
    book = PushBook(FakeClock())
    with pytest.raises(error, match=match):
        book.announce(*args, current_version=5)
    assert book.in_flight() == []


def test_the_current_version_or_a_later_one_may_be_pushed():
    book = PushBook(FakeClock())
    assert book.announce(5, ["a"], 0, 1.0, current_version=5).version == 5  # again (a re-push)
    assert book.announce(9, ["b"], 0, 1.0, current_version=5).version == 9  # about to be published


def test_an_engine_in_a_push_cannot_be_in_a_second_one():
    book = PushBook(FakeClock())
    first = book.announce(5, ["a", "b"], 0, 30.0, current_version=None)
    with pytest.raises(Conflict, match=f"b already receives push {first.id} \\(v5, 30s to its deadline\\).*end it"):
        book.announce(6, ["c", "b"], 0, 30.0, current_version=None)
    assert book.in_flight() == [first] and book.holding("c") is None
    book.clock.now += 31  # past the deadline, in the grace: no negative seconds
    with pytest.raises(Conflict, match="past its deadline, expiring"):
        book.announce(6, ["b"], 0, 30.0, current_version=None)
