"""The fleet's pure decisions, driven by a fake clock: rounds, versions, restarts, holds,
routing membership and its epoch, the min_healthy floor. No engines, no sockets."""

from __future__ import annotations

import pytest

from vime.supervisor.errors import Conflict
from vime.supervisor.policy import FleetPolicy, Membership


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(**kw) -> tuple[FleetPolicy, FakeClock]:
    clock = FakeClock(kw.pop("now", 0.0))
    return FleetPolicy(clock=clock, **kw), clock


# -- rounds ---------------------------------------------------------------------------------


def test_a_new_fleet_has_no_round_and_holds_nothing():
    policy, _ = make()
    assert policy.round is None and not policy.round_open
    assert policy.hold_reason() is None
    assert policy.may_restart() == (True, None)


def test_round_open_then_end_with_clock_times():
    policy, clock = make(now=5.0)
    assert policy.start_round(1) == (True, "round 1 open")
    assert policy.round == 1 and policy.round_open and policy.round_since == 5.0
    clock.now = 9.0
    assert policy.end_round(1) == (True, "round 1 ended; restarts and syncs may run until the next round starts")
    assert not policy.round_open and policy.round_since == 9.0


def test_repeating_a_round_call_changes_nothing():
    policy, _ = make()
    policy.start_round(3)
    assert policy.start_round(3) == (False, "round 3 is already open")
    policy.end_round(3)
    assert policy.end_round(3) == (False, "round 3 already ended")
    assert policy.round == 3 and not policy.round_open


@pytest.mark.parametrize("calls, bad, words", [
    ([("start", 1)], ("start", 2), "round 1 is still open: end it (POST /v1/rounds/1/end) before starting round 2"),
    ([("start", 5), ("end", 5)], ("start", 5), "round 5 is stale: round 5 already ran; start a round greater than 5"),
    ([("start", 5), ("end", 5)], ("start", 4), "round 4 is stale"),
    ([], ("end", 1), "round 1 is not open (no round has started); start it first"),
    ([("start", 2), ("end", 2)], ("end", 3), "round 3 is not open (the last round was 2); start it first"),
    ([("start", 2)], ("end", 1), "round 2 is open, not round 1: end round 2"),
])
def test_rounds_out_of_order_are_conflicts_and_change_nothing(calls, bad, words):
    policy, _ = make()
    for verb, n in calls:
        getattr(policy, f"{verb}_round")(n)
    before = (policy.round, policy.round_open)
    verb, n = bad
    with pytest.raises(Conflict, match=words.replace("(", r"\(").replace(")", r"\)")):
        getattr(policy, f"{verb}_round")(n)
    assert (policy.round, policy.round_open) == before


# -- restarts and holds ---------------------------------------------------------------------


def test_a_dead_engine_waits_for_the_gap_and_a_ready_one_is_held():
    policy, _ = make()
    policy.start_round(7)
    assert policy.may_restart() == (False, "restart after round 7")
    assert policy.hold_reason() == "held out of routing until round 7 ends"
    policy.end_round(7)
    assert policy.may_restart() == (True, None)
    assert policy.hold_reason() is None


def test_a_spare_lost_during_a_round_restarts_at_once():
    policy, _ = make()
    policy.start_round(3)
    assert policy.may_restart(spare=True) == (True, None)
    assert policy.may_restart() == (False, "restart after round 3")
    off, _ = make(use_fault_tolerance=False)
    assert off.may_restart(spare=True) == (False, "fault tolerance off: not restarted")


def test_restart_immediately_restarts_during_a_round_but_still_holds():
    policy, _ = make(restart_immediately=True)
    policy.start_round(1)
    assert policy.may_restart() == (True, None)
    assert policy.hold_reason() == "held out of routing until round 1 ends"


def test_without_fault_tolerance_nothing_restarts():
    policy, _ = make(use_fault_tolerance=False)
    assert policy.may_restart() == (False, "fault tolerance off: not restarted")


# -- weights --------------------------------------------------------------------------------


def test_versions_only_grow_and_keep_one_checkpoint():
    policy, _ = make()
    assert policy.check_publish(3, None) is None
    policy.publish(3, "/ckpt/3")
    assert policy.current_version == 3 and policy.checkpoint == "/ckpt/3"
    assert policy.check_publish(3, None) == "version 3 is already current"
    assert policy.check_publish(3, "/ckpt/3") == "version 3 is already current"
    with pytest.raises(Conflict, match="version 3 was already published with checkpoint /ckpt/3"):
        policy.check_publish(3, "/ckpt/other")
    with pytest.raises(Conflict, match="weight version 2 is stale: the current version is 3"):
        policy.check_publish(2, None)
    assert policy.check_publish(4, None) is None


def test_restore_takes_the_journal_as_it_is():
    policy, _ = make()
    policy.restore(round_number=12, round_open=True, version=5, checkpoint=None)
    assert (policy.round, policy.round_open, policy.current_version) == (12, True, 5)
    with pytest.raises(Conflict):
        policy.start_round(13)  # 12 is still open
    assert policy.end_round(12)[0]


# -- routing, epoch, floor ------------------------------------------------------------------


def test_routable_needs_a_serving_state_no_retirement_and_the_current_version():
    policy, _ = make()
    assert policy.is_routable(serving=True, retired=False, weight_version=None)  # nothing published
    assert policy.is_routable(serving=True, retired=False, weight_version=7)
    policy.publish(8, None)
    assert not policy.is_routable(serving=True, retired=False, weight_version=7)
    assert policy.is_routable(serving=True, retired=False, weight_version=8)
    assert not policy.is_routable(serving=False, retired=False, weight_version=8)
    assert not policy.is_routable(serving=True, retired=True, weight_version=8)


def test_the_epoch_moves_only_when_the_set_changes():
    policy, _ = make(min_healthy=0)
    m = policy.set_routable(["e0", "e1"])
    assert m == Membership(frozenset({"e0", "e1"}), frozenset({"e0", "e1"}), True)
    assert policy.epoch == 1
    m = policy.set_routable(["e1", "e0"])
    assert not m.changed and m.joined == frozenset() and policy.epoch == 1
    m = policy.set_routable(["e1"])
    assert m.changed and m.joined == frozenset() and policy.epoch == 2
    m = policy.set_routable(["e1", "e0"])
    assert m.joined == frozenset({"e0"}) and policy.epoch == 3


def test_the_floor_counts_only_once_the_fleet_first_reached_it():
    policy, clock = make(min_healthy=2)
    assert not policy.set_routable(["e0"]).breached  # still booting: not armed
    assert not policy.below_floor and policy.floor_breaches == 0
    policy.set_routable(["e0", "e1"])
    clock.now = 30.0
    m = policy.set_routable(["e0"])
    assert m.breached and not m.restored
    assert policy.below_floor and policy.below_floor_since == 30.0 and policy.floor_breaches == 1
    assert not policy.set_routable([]).breached  # still below: one breach, not two
    assert policy.floor_breaches == 1
    m = policy.set_routable(["e0", "e1"])
    assert m.restored and not policy.below_floor and policy.below_floor_since is None
    policy.set_routable(["e1"])
    assert policy.floor_breaches == 2


def test_a_floor_of_zero_is_never_breached():
    policy, _ = make(min_healthy=0)
    policy.set_routable(["e0"])
    assert not policy.set_routable([]).breached
    assert policy.floor_breaches == 0


# -- warm spares ----------------------------------------------------------------------------


def test_without_spares_every_ready_engine_serves():
    policy, _ = make()
    policy.active = policy.serving = 10
    assert policy.spare_reason() is None and policy.park_reason() is None and policy.spares_wanted() == 0


def test_a_ready_engine_is_a_spare_once_the_serving_ones_make_the_target():
    policy, _ = make(target=2)
    policy.serving, policy.active = 1, 3  # one serving, two being synced
    assert policy.spare_reason() is None  # the first whose sync ends serves: places fill early
    policy.serving = 2
    assert policy.spare_reason() == "a spare: 2/2 engines serving"


def test_a_ready_engine_behind_is_parked_when_the_other_active_ones_make_the_target():
    policy, _ = make(target=2)
    policy.active = 2  # itself and one other
    assert policy.park_reason() is None  # it is needed: synced
    policy.active = 3
    assert policy.park_reason() == "a spare: 2/2 engines active"


def test_spares_are_promoted_only_in_a_gap_and_only_for_missing_places():
    policy, _ = make(target=3)
    policy.active = 1
    assert policy.spares_wanted() == 2
    policy.start_round(1)
    assert policy.spares_wanted() == 0  # membership changes in the gap
    policy.end_round(1)
    policy.active = 3
    assert policy.spares_wanted() == 0


def test_a_current_spare_is_promoted_in_place_of_an_engine_that_needs_a_sync():
    policy, _ = make(target=2)
    policy.active = 2  # one serving, one restarted during the round and behind the version
    assert policy.spares_wanted(current_spares=1, behind=1) == 1
    assert policy.spares_wanted(current_spares=0, behind=1) == 0  # no faster way: it is synced
    policy.active = 1  # a place empty too: the current spares go first, as many as there are
    assert policy.spares_wanted(current_spares=1, behind=1) == 1
    assert policy.spares_wanted(current_spares=3, behind=1) == 2
    policy.start_round(2)
    assert policy.spares_wanted(current_spares=3, behind=1) == 0


# -- mid-round admission ----------------------------------------------------------------------


def test_with_mid_round_admission_a_ready_engine_is_not_held():
    policy, _ = make(admit_mid_round=True)
    policy.start_round(1)
    assert policy.hold_reason() is None
    plain, _ = make()
    plain.start_round(1)
    assert plain.hold_reason() == "held out of routing until round 1 ends"


def test_mid_round_only_current_spares_fill_missing_places():
    policy, _ = make(target=3, admit_mid_round=True)
    policy.start_round(1)
    policy.active = 1  # two places empty
    assert policy.spares_wanted(current_spares=0) == 0  # one behind needs a sync: the gap
    assert policy.spares_wanted(current_spares=1) == 1
    assert policy.spares_wanted(current_spares=5, behind=1) == 2  # the places, no more
    policy.active = 3
    assert policy.spares_wanted(current_spares=2, behind=1) == 0  # `behind` is the gap's rule
    policy.end_round(1)
    assert policy.spares_wanted(current_spares=2, behind=1) == 1


def test_time_below_strength_counts_once_first_reached_and_includes_the_open_stretch():
    policy, clock = make(strength=2)
    policy.set_routable({"a"})
    clock.now = 10.0
    assert policy.seconds_below_strength() == 0.0  # never at strength yet: the start-up
    policy.set_routable({"a", "b"})
    clock.now = 15.0
    policy.set_routable({"b"})
    clock.now = 18.5
    assert policy.seconds_below_strength() == pytest.approx(3.5)
    policy.set_routable({"b", "c"})
    clock.now = 30.0
    assert policy.seconds_below_strength() == pytest.approx(3.5)
    policy.set_routable(set())
    clock.now = 31.0
    assert policy.seconds_below_strength() == pytest.approx(4.5)
    assert make()[0].seconds_below_strength() == 0.0  # no strength set: nothing counted
