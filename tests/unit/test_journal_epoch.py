"""The membership epoch in the journal (pure): a daemon's first epoch is past the journaled one
and the wall clock at its start (policy.starting_epoch), saturating at the journal's ceiling so
its successor never refuses what it wrote; a journal without an epoch, or with a bad one, keeps
everything else (the bad epoch is dropped alone). The daemon-level checks, restarts read
through the socket, are tests/daemon/test_restart_faults.py's membership epoch tests."""

from __future__ import annotations

import json

import pytest

from vime.supervisor import journal
from vime.supervisor.policy import EPOCH_MAX, FleetPolicy, starting_epoch

OLDER = {"format": 1, "boot_id": None, "round": 2, "round_open": False, "weight_version": 3,
         "checkpoint": None, "engines": {}}
NOW_MS = 1_800_000_000_000  # a wall clock in milliseconds (2027)


def test_a_journal_without_an_epoch_loads(tmp_path):
    path = tmp_path / "journal.json"
    path.write_text(json.dumps(OLDER))
    assert journal.load(path) == OLDER
    assert journal.epoch_problem({**OLDER, "epoch": 0}) is None and journal.epoch_problem(OLDER) is None


@pytest.mark.parametrize("bad", ["4", -1, True, 1.5, EPOCH_MAX + 1, 2**63])
def test_a_bad_epoch_is_dropped_alone(tmp_path, bad):
    data = {**OLDER, "epoch": bad}
    assert journal.validate(data) == []  # not a reason to move the journal aside
    assert journal.epoch_problem(data).startswith(f"epoch: must be null or an integer 0..{EPOCH_MAX}")
    path = tmp_path / "journal.json"
    path.write_text(json.dumps(data))
    assert journal.load(path) == OLDER  # round, version, engines kept; the epoch gone


def test_the_first_epoch_is_past_the_journal_and_the_wall_clock():
    assert starting_epoch(None, NOW_MS) == NOW_MS  # no journal, an older one, or a bad epoch dropped
    assert starting_epoch(41, NOW_MS) == NOW_MS  # a journal of an older daemon counting from 0
    assert starting_epoch(NOW_MS + 5, NOW_MS) == NOW_MS + 6  # a fleet that changed faster than 1/ms
    # The clock stepped back: the journaled epoch (written) still holds.
    assert starting_epoch(NOW_MS, NOW_MS - 3_600_000) == NOW_MS + 1
    assert starting_epoch(None, -5) == 0 and starting_epoch(None, 0) == 0  # a clock before 1970


def test_an_epoch_served_then_lost_with_a_failed_write_is_not_served_again():
    """The previous daemon started at `then`, served `changes` epochs past its floor, and its
    journal kept only the first (every later write failed): one started 1 s later is past all."""
    then, changes = NOW_MS, 900
    served = starting_epoch(None, then) + changes
    journaled = starting_epoch(None, then)
    assert starting_epoch(journaled, then + 1000) > served


def test_the_epoch_saturates_at_the_journals_ceiling(tmp_path):
    assert starting_epoch(EPOCH_MAX, NOW_MS) == starting_epoch(EPOCH_MAX - 1, NOW_MS) == EPOCH_MAX
    assert starting_epoch(None, EPOCH_MAX + 10) == EPOCH_MAX
    policy = FleetPolicy()
    policy.resume_epoch(EPOCH_MAX, NOW_MS)
    assert policy.set_routable({"e0"}).changed and policy.epoch == EPOCH_MAX
    path = tmp_path / "journal.json"
    path.write_text(json.dumps({**OLDER, "epoch": policy.epoch}))
    assert journal.load(path)["epoch"] == EPOCH_MAX  # what it writes, its successor takes


def test_the_epoch_counts_on_and_never_back():
    policy = FleetPolicy()
    policy.resume_epoch(NOW_MS + 41, NOW_MS)
    assert policy.epoch == NOW_MS + 42  # its routable set starts empty: a change from the journaled one
    assert policy.set_routable({"e0"}).changed and policy.epoch == NOW_MS + 43
    policy.resume_epoch(7, 0)  # never backwards
    assert policy.epoch == NOW_MS + 43
