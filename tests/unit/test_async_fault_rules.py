"""Faults with no round (async mode): the pure decisions with an injected clock, then the
daemon's fleet wired as its start-up wires it over emulated engines in this process
(tests/support/standin_inproc.py: PROTOCOL STAND-INS, not vLLM; their /weight_info read for
real), for the races where a verdict made before a publish would be applied after it."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from vime.supervisor.config import build
from vime.supervisor.engine.fingerprint import is_unverified, parse, relabel, unverified
from vime.supervisor.policy import FleetPolicy
from vime.supervisor.states import SYNC_RULE, Cause, ProbeOutcome, State, VersionRule, WeightsMode

from test_version_rule import fleets

ASYNC1 = VersionRule(WeightsMode.ASYNC, 1)


# -- rounds gate nothing in async mode ---------------------------------------------------------


def test_an_open_round_gates_membership_in_sync_mode_only():
    for rule, gated in ((SYNC_RULE, True), (ASYNC1, False)):
        now = [10.0]
        p = FleetPolicy(rule=rule, target=2, clock=lambda: now[0])
        p.active = 1  # one of two places empty: an engine failed
        p.start_round(1)
        assert p.round_open and p.round_since == 10.0 and p.gated is gated
        assert (p.hold_reason() is not None) is gated
        assert p.may_restart() == ((False, "restart after round 1") if gated else (True, None))
        # A spare takes the empty place at once in async mode; in sync mode in the gap.
        assert p.spares_wanted(current_spares=1) == (0 if gated else 1)
        now[0] = 12.5
        p.end_round(1)
        assert not p.gated and p.spares_wanted(current_spares=1) == 1 and p.round_since == 12.5


def config(run, weights: dict, **supervisor) -> dict:
    return {"supervisor": {"runtime_dir": str(run), **supervisor}, "weights": weights,
            "engines": [{"name": "e0", "url": "http://127.0.0.1:1"}, {"name": "e1", "url": "http://127.0.0.1:2"}]}


def test_spares_are_kept_within_the_bound_by_default_in_async_mode_only(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    assert build(config(run, {"mode": "async"})).spares_sync == "publish"
    assert build(config(run, {"mode": "sync"})).spares_sync == "promotion"
    assert build(config(run, {})).spares_sync == "promotion"
    # Given, it is kept; "promotion" in async mode with spares is warned: a promotion syncs first.
    kept = build(config(run, {"mode": "async"}, spares_sync="promotion", spares=1))
    assert kept.spares_sync == "promotion"
    assert any("spares_sync = \"promotion\" in async mode" in w for w in kept.warnings)
    assert not build(config(run, {"mode": "async"}, spares_sync="promotion")).warnings  # no spares: nothing to warn of
    assert build(config(run, {"mode": "async"}), {"spares_sync": "promotion"}).spares_sync == "promotion"  # the flag


# -- a publish's re-read of /weight_info (fingerprint.relabel) ---------------------------------


@pytest.mark.parametrize("held, read, checked, fingerprinted, expected", [
    (4, 5, False, None, 5),  # pushed and published, no fingerprint: the label is what is checked
    (4, 4, False, 5, 4),  # unchanged since it was verified: kept
    (4, 5, False, 5, unverified(5)),  # says the fingerprinted version, not checked at it
    (4, 5, True, 5, 5),  # its outputs matched at this publish
    (unverified(4), 4, False, None, unverified(4)),  # a read never verifies an unverified engine
    (unverified(4), 5, False, None, unverified(5)),
    (unverified(4), None, False, None, unverified(4)),  # unreadable: still unverified
    (unverified(4), 5, True, 5, 5),  # checked at this publish: verified
    (3, 4, False, 5, unverified(4)),  # moved to an older version the bound allows: not on its label
    (5, None, False, None, None),  # base weights (or unreadable): never allowed once one is published
])
def test_a_read_at_a_publish_is_believed_only_as_far_as_a_read_goes(held, read, checked, fingerprinted, expected):
    got = relabel(held, read, checked=checked, fingerprinted=fingerprinted, rule=ASYNC1)
    assert got == expected
    assert is_unverified(got) is is_unverified(expected)


async def test_a_label_moved_at_a_fingerprinted_publish_counts_where_the_check_says(tmp_path):
    """e0 was pushed v6 before its publish (e1 was not). v6 is published with a fingerprint the
    emulated engine cannot match: with fingerprint_mismatch = "warn" e0 is routed at v6 as its
    label says (counted); with "resync" it is STALE under a label never published. Either way
    e1, at v5 and within the bound, keeps serving at v5."""
    for action, routed in (("warn", ["e0", "e1"]), ("resync", ["e1"])):
        async with fleets(tmp_path) as fleet_at:
            sup = await fleet_at([5, 5], mode="async", max_staleness=1, fingerprint_mismatch=action)
            await sup.fleet.publish_weights(5, None)
            e0, e1 = sup.fleet.runners["e0"], sup.fleet.runners["e1"]
            await set_label(e0.spec.base_url, 6)
            await sup.fleet.publish_weights(6, None, fingerprint())
            assert [r.name for r in sup.fleet.routable()] == routed, (action, e0.state, e0.weight_version)
            assert e0.weight_version == (6 if action == "warn" else unverified(6))
            assert e1.weight_version == 5 and e1.state is State.RUNNING
            assert sup.stats.fingerprint_mismatches.get("publish") == 1


def fingerprint():
    return parse({"prompts": [[5, 6, 7], [8, 9]], "logprobs": [[-1.0, -2.0], [-3.0]], "tolerance": 1e-4})


# -- races with a publish, on the daemon's fleet over emulated engines ------------------------


def drained(sub) -> list[dict]:
    out = []
    while not sub.queue.empty():
        out.append(sub.queue.get_nowait())
    return out


async def set_label(url: str, version: int) -> None:
    """What a push's end does to the engine's /weight_info (vLLM's /update_weight_version)."""
    async with aiohttp.ClientSession() as s, s.post(f"{url}/update_weight_version",
                                                    json={"new_version": str(version)}) as r:
        assert r.status == 200


async def test_a_publish_never_makes_an_unverified_engine_routable(tmp_path):
    """e1 says v4 on /weight_info but its outputs were not shown to match (unverified): the
    publish of v5 reads it again, and in async mode (v4 within the bound) it must stay out of
    routing until a sync verifies it; before, the read overwrote the label and the kick that
    follows a publish released it."""
    async with fleets(tmp_path) as fleet_at:
        sup = await fleet_at([4, 4], mode="async", max_staleness=1)
        await sup.fleet.publish_weights(4, None)
        e1 = sup.fleet.runners["e1"]
        e1.fingerprint_mismatch(4, "outputs do not match (test)")
        assert e1.state is State.STALE and e1.weight_version == unverified(4)
        await sup.fleet.publish_weights(5, None)
        sup.sync.kick()  # what the bus does after a publish: consider every STALE engine
        assert e1.weight_version == unverified(4) and e1.state is State.STALE
        assert [r.name for r in sup.fleet.routable()] == ["e0"]


async def test_a_hung_engines_place_is_taken_by_a_spare_within_the_bound_in_the_turn_it_is_condemned(tmp_path):
    """Async mode, a round open: e0 hangs (its probes fail up to the threshold); in the same turn
    as it is condemned (UNHEALTHY), the spare e2, one version behind (allowed), is RUNNING: no
    sync, no round end, no clock time between."""
    async with fleets(tmp_path) as fleet_at:
        sup = await fleet_at([2, 2, 1], mode="async", max_staleness=1)
        await sup.fleet.publish_weights(2, None)
        e0, e2 = sup.fleet.runners["e0"], sup.fleet.runners["e2"]
        sup.fleet.policy.target = 2
        e2.fsm.exited("restarted (test)")
        e2.fsm.begin_start("restart", restart=True)
        e2.fsm.became_ready(1, 2, spare=sup.policy.spare_reason(), rule=sup.policy.rule)
        await asyncio.sleep(0)  # the coordinator's look at the fleet after it: nothing to promote
        assert e2.state is State.STANDBY
        sup.fleet.start_round(3)
        while not e0.fsm.probe_result(ProbeOutcome(False, "timeout after 5.0s (test)")):
            pass
        assert e0.state is State.UNHEALTHY and e0.fsm.cause is Cause.HANG
        assert e2.state is State.STANDBY  # the promotion runs in the loop's next turn
        await asyncio.sleep(0)
        assert e2.state is State.RUNNING and e2.fsm.cause is Cause.PROMOTED, e2.reason
        assert "async mode: no round gap to wait for" in e2.reason
        assert [r.name for r in sup.fleet.routable()] == ["e1", "e2"] and sup.fleet.round_open


async def test_a_spare_being_kept_current_holds_no_place_a_ready_spare_takes_a_failed_ones(tmp_path):
    """Two serving engines, two spares kept current (spares_sync = "publish"): v3 leaves e3 (at
    v1) two behind, so it is being synced when e0 dies. The place goes at once to e2, the spare
    at v2 (within the bound), not to e3's sync; e3, verified, is a spare again."""
    async with fleets(tmp_path) as fleet_at:
        sup = await fleet_at([3, 3, 2, 1], mode="async", max_staleness=1, spares_sync="publish")
        policy = sup.fleet.policy
        policy.target = 2
        e0, e2, e3 = (sup.fleet.runners[n] for n in ("e0", "e2", "e3"))
        for r, v in ((e2, 2), (e3, 1)):  # both back as spares
            r.fsm.exited("restarted (test)")
            r.fsm.begin_start("restart", restart=True)
            r.fsm.became_ready(v, None, spare=policy.spare_reason(), rule=policy.rule)
        assert (e2.state, e3.state) == (State.STANDBY, State.STANDBY)
        await sup.fleet.publish_weights(3, None)  # e3 two behind: out of STANDBY, to be synced
        assert e3.state is State.STALE and e3.syncing_as_spare and e2.state is State.STANDBY
        assert policy.active == 2  # the two serving engines; e3 holds no place
        sup.sync.agents = 1  # the test is the trainer's agent
        sup.sync.begin(e3, 3)
        e0.fsm.exited("killed (test)")
        await asyncio.sleep(0)
        assert e2.state is State.RUNNING and e2.fsm.cause is Cause.PROMOTED, e2.reason
        assert [r.name for r in sup.fleet.routable()] == ["e1", "e2"]
        await set_label(e3.spec.base_url, 3)
        await sup.sync.end(e3, 3, True, None)
        assert e3.state is State.STANDBY and e3.weight_version == 3 and not e3.syncing_as_spare, e3.reason
        await sup.sync.close()


@pytest.mark.parametrize("published, fingerprinted", [(7, False), (6, True)])
async def test_a_publish_during_a_spare_promotion_sync_never_leaves_it_serving_outside_the_rule(
        tmp_path, published, fingerprinted):
    """A spare behind the bound is promoted (STALE, synced to v5 by the trainer's agent); while
    the agent pushes, the trainer publishes: v7 (v5 two behind, max_staleness 1), or v6 with a
    fingerprint (v5 within the bound, but only v6's outputs can be checked). The sync's end must
    not put the spare into service at v5: it goes STALE (cause outdated), is never routable,
    and is synced again."""
    async with fleets(tmp_path) as fleet_at:
        sup = await fleet_at([5, 3], mode="async", max_staleness=1)
        await sup.fleet.publish_weights(5, None)
        e1 = sup.fleet.runners["e1"]
        assert e1.state is State.STALE  # v3: two behind
        e1.park("a spare (test)")
        sup.fleet.policy.target = 1  # one place, taken by e0; e1 the spare
        e1.promote("e0's place (test)", 5)
        assert e1.state is State.STALE and e1.fsm.cause is Cause.PROMOTED
        sup.sync.agents = 1  # the test is the trainer's agent
        sup.sync.begin(e1, 5)
        assert e1.state is State.SYNCING
        sub = sup.fleet.subscribe()
        await set_label(e1.spec.base_url, 5)  # the agent's push landed
        await sup.fleet.publish_weights(published, None, fingerprint() if fingerprinted else None)
        await sup.sync.end(e1, 5, True, None)
        events = drained(sub)
        moves = [(e["engine"], e["to_state"], e["cause"]) for e in events if e["event"] == "transition"]
        assert ("e1", "STALE", "outdated") in moves, moves
        assert not [m for m in moves if m[0] == "e1" and m[1] == "RUNNING"], moves
        overtaken = next(e for e in events if e["event"] == "transition" and e["engine"] == "e1")
        assert "was published meanwhile: synced again" in overtaken["reason"]
        # Out of routing since, wherever the coordinator put it next (parked as the spare, or
        # asked to be synced again).
        assert e1.state in (State.STALE, State.STANDBY) and not sup.fleet.policy.allows(e1.weight_version)
        assert "e1" not in sup.fleet.policy.routable
        assert all("e1" not in e["routable"] for e in events if e["event"] == "membership")
        await sup.sync.close()


# -- an in-flight update's waves: the daemon reads each receiver again at its push's end ------


@pytest.mark.parametrize("held, read, push_version, current, taken", [
    (5, 5, 6, 5, False),  # the push did not move the label (failed before its end)
    (5, 6, 6, 5, False),  # pushed before its publish: the publish reads and checks it
    (5, 6, 6, 6, True),  # published first, then pushed (waves): the label follows the engine
    (5, "lie", 6, 6, True),  # something the push never set: checked, and out of routing
    (5, None, 6, 6, True),  # base weights now
    (None, 1, 1, None, True),  # nothing published yet: any version serves
])
def test_a_receivers_read_after_its_push_is_taken_up_unless_unchanged_or_not_yet_published(
        held, read, push_version, current, taken):
    from vime.supervisor.sync import taken_up_after_push
    assert taken_up_after_push(held, read, push_version, current) is taken


async def test_after_each_wave_the_daemon_reads_the_receivers_again_and_follows_the_rule(tmp_path):
    """Async mode, max_staleness 1, v6 published first and pushed in waves (the push announced
    and ended per wave): at each wave's end the daemon reads its receivers' /weight_info. e0
    took v6: listed at v6, serving. e1's push left a label no publish set: out of routing
    (STALE, cause outdated). e2, in no wave yet, is left as it was (v5, within the bound)."""
    async with fleets(tmp_path) as fleet_at:
        sup = await fleet_at([5, 5, 5], mode="async", max_staleness=1)
        await sup.fleet.publish_weights(5, None)
        await sup.fleet.publish_weights(6, None)
        e0, e1, e2 = (sup.fleet.runners[n] for n in ("e0", "e1", "e2"))
        assert [r.weight_version for r in (e0, e1, e2)] == [5, 5, 5] and len(sup.fleet.routable()) == 3
        wave = sup.pushes.begin(6, ["e0", "e1"], 0, 30.0)["push"]
        await set_label(e0.spec.base_url, 6)
        async with aiohttp.ClientSession() as s:
            await s.post(f"{e1.spec.base_url}/update_weight_version", json={"new_version": "6-half"})
        answer = await sup.pushes.end(wave, False, {"e1": "the collective timed out"})
        assert answer is not None and answer["weight_versions"] == {"e0": 6, "e1": "6-half"}
        assert e0.state is State.RUNNING and e0.weight_version == 6
        assert e1.state is State.STALE and e1.fsm.cause is Cause.OUTDATED, e1.reason
        assert e2.weight_version == 5 and e2.state is State.RUNNING
        assert [r.name for r in sup.fleet.routable()] == ["e0", "e2"]
        # Pushed before its publish (the trainer's order in sync mode, or an update that publishes
        # last): not taken up, nothing leaves routing; the publish reads it.
        ahead = sup.pushes.begin(7, ["e2"], 0, 30.0)["push"]
        await set_label(e2.spec.base_url, 7)
        assert (await sup.pushes.end(ahead, True, {}))["weight_versions"] == {"e2": 5}
        assert "e2" in [r.name for r in sup.fleet.routable()]
        await sup.fleet.publish_weights(7, None)
        assert e2.weight_version == 7 and e2.state is State.RUNNING
        await sup.sync.close()
        await sup.pushes.close()
