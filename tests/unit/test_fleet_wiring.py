"""The daemon's components wired as its start-up wires them (daemon.Supervisor), in-process:
the bus tells the statistics, the fleet and the sync coordinator of each transition, in that
order; the fleet and the sync coordinator drive engines through their runners' verbs. No
engine runs: each runner's state machine is brought where a test needs it by hand."""

from __future__ import annotations

import aiohttp
import pytest

from vime.supervisor.config import Config, EngineSpec
from vime.supervisor.daemon import Supervisor
from vime.supervisor.engine.runner import EngineRunner
from vime.supervisor.states import Cause, State


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
