"""The daemon's components wired as its start-up wires them (daemon.Supervisor), in-process:
the bus tells the statistics, the fleet and the sync coordinator of each transition, in that
order; the fleet and the sync coordinator drive engines through their runners' verbs. No
engine runs: each runner's state machine is brought where a test needs it by hand."""

from __future__ import annotations

import aiohttp
import pytest

from vime.supervisor.config import Config, EngineSpec
from vime.supervisor.daemon import Supervisor
from vime.supervisor.config import RestartPolicy, RouterConfig
from vime.supervisor.engine.fsm import IllegalTransition
from vime.supervisor.engine.runner import EngineRunner
from vime.supervisor.events import EventBus
from vime.supervisor.fleet import Fleet
from vime.supervisor.policy import FleetPolicy
from vime.supervisor.router.link import RouterLink
from vime.supervisor.states import ACTIVE, Cause, ProbeOutcome, State


@pytest.fixture
async def wired(tmp_path):
    cfg = Config(engines=(EngineSpec("e0", model="/m", port=1), EngineSpec("e1", model="/m", port=2)),
                 state_dir=str(tmp_path), log_dir=str(tmp_path), runtime_dir=str(tmp_path), min_healthy=2)
    sup = Supervisor(cfg)
    async with aiohttp.ClientSession() as session:
        for spec in cfg.engines:
            sup.fleet.runners[spec.name] = EngineRunner(spec, cfg, sup.policy, sup.bus, session)
        yield sup


def serve(runner: EngineRunner) -> None:
    runner.fsm.begin_start("start", restart=False)
    runner.fsm.became_ready(None, runner.policy.current_version, hold=runner.policy.hold_reason())


def drain(sub) -> list[dict]:
    out = []
    while not sub.queue.empty():
        out.append(sub.queue.get_nowait())
    return out


async def test_a_poisoned_report_is_counted_on_the_stream_before_its_transition(wired):
    fleet = wired.fleet
    for r in fleet.runners.values():
        serve(r)
    assert fleet.epoch == 2 and [r.name for r in fleet.routable()] == ["e0", "e1"]
    sub = fleet.subscribe()
    e0 = fleet.runners["e0"]
    answer = fleet.report_failure(e0, "push of v3 failed midway", poisoned=True)
    assert answer["counted"] and answer["state"] == "UNHEALTHY"
    events = [(e["event"], e.get("cause")) for e in drain(sub)]
    assert events == [("failure_reported", None), ("detection", "poisoned"), ("transition", "poisoned"),
                      ("membership", None), ("floor_breach", None)]
    assert wired.stats.detections == {("e0", "poisoned"): 1}
    assert e0._stop_now.is_set()  # the runner's task stops it
    assert fleet.below_floor and fleet.floor_breaches == 1


async def test_reported_failures_at_the_threshold_are_reported_not_hang(wired):
    fleet = wired.fleet
    e0 = fleet.runners["e0"]
    serve(e0)
    for _ in range(wired.cfg.probe.failure_threshold):
        fleet.report_failure(e0, "connection reset")
    assert e0.state is State.UNHEALTHY and e0.fsm.cause is Cause.REPORTED
    assert wired.stats.detections == {("e0", "reported"): 1}


async def test_an_engine_ready_during_a_round_is_held_and_released_in_the_gap(wired):
    fleet = wired.fleet
    e0, e1 = fleet.runners["e0"], fleet.runners["e1"]
    serve(e1)
    fleet.start_round(1)
    serve(e0)
    assert e0.state is State.STALE and e0.reason.endswith("held out of routing until round 1 ends")
    assert [r.name for r in fleet.routable()] == ["e1"]
    sub = fleet.subscribe()
    fleet.end_round(1)  # the sync coordinator hears of it on the bus and releases e0
    assert e0.state is State.RUNNING and e0.fsm.cause is Cause.RELEASED
    assert [(e["event"], e.get("cause")) for e in drain(sub)] == [
        ("round_end", None), ("transition", "released"), ("membership", None)]


async def test_a_new_version_makes_serving_engines_outdated(wired):
    fleet = wired.fleet
    for r in fleet.runners.values():
        serve(r)
    changed, message = await fleet.publish_weights(4, None)
    assert changed and message == "version 4 is current; stale (not routable until synced): e0, e1"
    assert all(r.state is State.STALE and r.fsm.cause is Cause.OUTDATED for r in fleet.runners.values())
    assert fleet.routable() == [] and fleet.current_version == 4


async def test_journal_restore_goes_through_the_fleet_and_the_runners(wired):
    fleet = wired.fleet
    fleet.restore(round_number=9, round_open=True, version=3, checkpoint=None)
    fleet.runners["e0"].restore(incarnation=4, restarts=2, retired=True, operator_stopped=False)
    assert (fleet.round, fleet.round_open, fleet.current_version) == (9, True, 3)
    e0 = fleet.runners["e0"]
    assert (e0.incarnation, e0.fsm.restarts, e0.retired, e0.start_stopped) == (4, 2, True, False)


@pytest.fixture
async def wired_spare(tmp_path):
    """Three engines, one a spare, members admitted inside a round."""
    cfg = Config(engines=tuple(EngineSpec(f"e{i}", model="/m", port=i + 1) for i in range(3)), spares=1,
                 admit_mid_round=True, state_dir=str(tmp_path), log_dir=str(tmp_path), runtime_dir=str(tmp_path))
    sup = Supervisor(cfg)
    async with aiohttp.ClientSession() as session:
        for spec in cfg.engines:
            sup.fleet.runners[spec.name] = EngineRunner(spec, cfg, sup.policy, sup.bus, session)
        yield sup


async def test_mid_round_a_current_spare_takes_a_dead_engines_place_at_once(wired_spare):
    import asyncio

    fleet = wired_spare.fleet
    e0, e1, e2 = (fleet.runners[n] for n in ("e0", "e1", "e2"))
    for r in (e0, e1, e2):
        r.fsm.begin_start("start", restart=False)
        r.fsm.became_ready(None, None, hold=r.policy.hold_reason(), spare=r._spare())
    assert e2.state is State.STANDBY and [r.name for r in fleet.routable()] == ["e0", "e1"]
    fleet.start_round(1)
    e0.fsm.exited("killed", Cause.EXIT)
    await asyncio.sleep(0)  # the coordinator promotes on the loop's next turn
    assert e2.state is State.RUNNING and e2.fsm.cause is Cause.PROMOTED
    assert "admitted inside round 1" in e2.reason
    assert [r.name for r in fleet.routable()] == ["e1", "e2"] and fleet.round_open
    assert wired_spare.policy.short_since is None  # back at full strength: no open stretch


def recount(fleet) -> tuple[int, int, frozenset[str]]:
    """The membership counted from scratch, over every engine: what the fleet keeps."""
    live = [r for r in fleet.runners.values() if not r.retired]
    return (sum(r.state in ACTIVE for r in live), sum(r.serving for r in live),
            frozenset(r.name for r in fleet.runners.values() if fleet.is_routable(r)))


async def test_membership_kept_per_transition_matches_a_full_recount(tmp_path):
    """Random transitions, publishes and a retire over 8 engines (2 spares): after each, the
    counts the spares are decided on, the routable set, the epoch and the membership events
    are what a recount of the whole fleet gives."""
    import random

    cfg = Config(engines=tuple(EngineSpec(f"e{i}", model="/m", port=i + 1) for i in range(8)), spares=2,
                 state_dir=str(tmp_path), log_dir=str(tmp_path), runtime_dir=str(tmp_path), min_healthy=3,
                 restart=RestartPolicy(flapping_max_restarts=10 ** 6))
    sup = Supervisor(cfg)
    rng = random.Random(7)
    async with aiohttp.ClientSession() as session:
        fleet = sup.fleet
        for spec in cfg.engines:
            fleet.runners[spec.name] = EngineRunner(spec, cfg, sup.policy, sup.bus, session)
        sub = fleet.subscribe(100000)
        epoch, routable = 0, frozenset()
        for step in range(3000):
            r = rng.choice(list(fleet.runners.values()))
            f, cur = r.fsm, fleet.current_version
            op = rng.randrange(8)
            try:
                if op == 0 and f.state in (State.STOPPED, State.EXITED, State.BACKOFF, State.FATAL):
                    f.begin_start("start")
                elif op == 1 and f.state is State.STARTING:
                    f.became_ready(rng.choice([cur, cur, None, 1]), cur, spare=r._spare())
                elif op == 2 and f.state in (State.RUNNING, State.SUSPECT, State.STALE, State.STANDBY):
                    f.probe_result(ProbeOutcome(rng.random() < 0.5, "probe"))
                elif op == 3 and f.state not in (State.STOPPED, State.EXITED, State.BACKOFF, State.FATAL):
                    f.exited("killed")
                elif op == 4 and f.state is State.STALE:
                    f.sync_started("sync")
                elif op == 5 and f.state is State.SYNCING:
                    f.sync_finished(cur if cur is not None else 0, spare=r._spare())
                elif op == 6 and rng.random() < 0.05:
                    await fleet.publish_weights((cur or 0) + 1, None)
                elif op == 7 and step == 1500:
                    await fleet.engine_action(fleet.runners["e3"], "retire")
            except IllegalTransition:
                continue
            active, serving, names = recount(fleet)
            assert (sup.policy.active, sup.policy.serving, sup.policy.routable) == (active, serving, names), step
            for ev in drain(sub):
                if ev["event"] == "membership":
                    epoch += 1
                    assert ev["epoch"] == epoch and ev["routable"] != sorted(routable), (step, ev)
                    routable = frozenset(ev["routable"])
                    assert ev["routable"] == sorted(routable)
            assert fleet.epoch == epoch and routable == names, step
        assert epoch > 100 and sup.policy.floor_breaches > 0


async def test_engines_coming_up_cost_the_fleet_a_constant_each(tmp_path):
    """1,024 engines become ready one after another: each transition counts its own engine,
    not the whole fleet (a recount per transition was N^2: 4,096 never all became routable).
    Every membership change still has its epoch and its event, as before."""
    n = 1024
    checked = 0

    class Counting(Fleet):
        def is_routable(self, runner):
            nonlocal checked
            checked += 1
            return super().is_routable(runner)

    cfg = Config(engines=tuple(EngineSpec(f"e{i:04}", url=f"http://127.0.0.1:{20000 + i}") for i in range(n)),
                 state_dir=str(tmp_path), log_dir=str(tmp_path), runtime_dir=str(tmp_path), min_healthy=0)
    policy = FleetPolicy(min_healthy=0)
    bus = EventBus()
    fleet = Counting(cfg, policy=policy, bus=bus)
    bus.add_listener(fleet)
    async with aiohttp.ClientSession() as session:
        for spec in cfg.engines:
            fleet.runners[spec.name] = EngineRunner(spec, cfg, policy, bus, session)
        sub = fleet.subscribe(4 * n)
        for r in fleet.runners.values():
            r.fsm.begin_start("attach", restart=False)
            r.fsm.became_ready(None, None)
    assert len(fleet.routable()) == n and fleet.epoch == n
    assert checked <= 3 * n  # 2 transitions per engine, and the routable() above
    memberships = [e for e in drain(sub) if e["event"] == "membership"]
    assert [len(e["routable"]) for e in memberships] == list(range(1, n + 1))


@pytest.mark.parametrize("spawn", [False, True])
async def test_the_routers_one_owner_is_built_at_the_root_and_handed_down(tmp_path, spawn):
    """[router]: one RouterLink, handed to the fleet (its RouterGate) and the journal; before
    it starts (no feed yet) it drains nothing, settles nothing and shows nothing, as no router."""
    cfg = Config(engines=(EngineSpec("e0", url="http://127.0.0.1:1"),), state_dir=str(tmp_path),
                 log_dir=str(tmp_path), runtime_dir=str(tmp_path), min_healthy=0,
                 router=RouterConfig(url="http://127.0.0.1:9", spawn=spawn))
    sup = Supervisor(cfg)
    link = sup.router
    assert isinstance(link, RouterLink) and sup.fleet.router is link and sup.journal.router is link
    assert (link.child is not None) is spawn and sup.router_child is link.child
    assert not link.drains() and await link.settle() == [] and link.status() is None
    assert link.journal_entry() is None and list(link.families()) == []
    assert Supervisor(Config(engines=cfg.engines, state_dir=str(tmp_path), log_dir=str(tmp_path),
                             runtime_dir=str(tmp_path))).fleet.router is None
