"""The membership epoch in the journal (pure): an older daemon's journal without one is valid, a
bad one makes the journal untrusted (moved aside, as any bad field), and the policy of a daemon
started from a journal counts on past the epoch it names. The daemon-level check, a restart
read through the socket, is tests/daemon/test_restart_faults.py's membership epoch test."""

from __future__ import annotations

import json

import pytest

from vime.supervisor import journal
from vime.supervisor.policy import FleetPolicy

OLDER = {"format": 1, "boot_id": None, "round": 2, "round_open": False, "weight_version": 3,
         "checkpoint": None, "engines": {}}


def test_a_journal_without_an_epoch_loads(tmp_path):
    path = tmp_path / "journal.json"
    path.write_text(json.dumps(OLDER))
    assert journal.load(path) == OLDER
    assert journal.validate({**OLDER, "epoch": 0}) == journal.validate({**OLDER, "epoch": None}) == []


@pytest.mark.parametrize("bad", ["4", -1, True, 1.5, 2**63])
def test_a_bad_epoch_is_a_bad_journal(bad):
    problems = journal.validate({**OLDER, "epoch": bad})
    assert len(problems) == 1 and problems[0].startswith("epoch: must be null or an integer"), problems


def test_the_epoch_counts_on_past_the_journaled_one():
    policy = FleetPolicy()
    policy.resume_epoch(41)
    assert policy.epoch == 42  # its routable set starts empty: a change from the journaled one
    assert policy.set_routable({"e0"}).changed and policy.epoch == 43
    policy.resume_epoch(7)  # never backwards
    assert policy.epoch == 43
