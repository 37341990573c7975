"""One routing rule for both weight modes (states.VersionRule): routable = serving and verified
at a version the mode allows, the current one in sync mode, up to max_staleness behind it in
async mode. The rule itself, then each of its callers: the fleet policy, the state machine,
the daemon's publish (emulated engines, tests/support/standin_inproc.py, their /weight_info read
for real),
status and metrics, the router feed, and the cluster view."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from vime.cluster.view import ClusterView
from vime.harness.emulated_engine import EmulatedEngine
from vime.supervisor.config import Config, EngineSpec, ProbePolicy, RestartPolicy, RouterConfig, WeightsPolicy
from vime.supervisor.daemon import Supervisor
from vime.supervisor.engine.fsm import EngineFSM
from vime.supervisor.engine.runner import EngineRunner
from vime.supervisor.metrics import FleetCollector
from vime.supervisor.policy import FleetPolicy
from vime.supervisor.router import make_router
from vime.supervisor.router.feed import RouterFeed
from vime.supervisor.states import SYNC_RULE, Cause, State, VersionRule, WeightsMode
from vime.supervisor.status import fleet_status, routable_view

from support.standin_inproc import InProcessEngines
from support.standin_router import StandinRouter

ASYNC1 = VersionRule(WeightsMode.ASYNC, 1)


# -- the rule --------------------------------------------------------------------------------


@pytest.mark.parametrize("rule, version, current, allowed", [
    (SYNC_RULE, 5, 5, True),
    (SYNC_RULE, 4, 5, False),
    (SYNC_RULE, 6, 5, False),  # pushed, not yet published
    (VersionRule(WeightsMode.SYNC, 3), 4, 5, False),  # the bound is read in async mode only
    (ASYNC1, 5, 5, True),
    (ASYNC1, 4, 5, True),
    (ASYNC1, 3, 5, False),
    (ASYNC1, 6, 5, False),
    (VersionRule(WeightsMode.ASYNC, 0), 4, 5, False),
    (VersionRule(WeightsMode.ASYNC, 3), 2, 5, True),
    (VersionRule(WeightsMode.ASYNC, 3), 1, 5, False),
    (ASYNC1, None, 5, False),  # base weights once a version is published
    (ASYNC1, "lie-4", 5, False),  # a label that is not a published version
    (ASYNC1, True, 1, False),  # a bool is not a version
    (SYNC_RULE, None, None, True),  # nothing published: the base weights serve
    (ASYNC1, "x", None, True),
])
def test_the_rule_allows_the_current_version_or_up_to_the_bound_behind_it(rule, version, current, allowed):
    assert rule.allows(version, current) is allowed


def test_lag_counts_publications_and_is_none_when_not_comparable():
    assert VersionRule.lag(3, 5) == 2 and VersionRule.lag(5, 5) == 0 and VersionRule.lag(6, 5) == -1
    assert VersionRule.lag(None, 5) is None and VersionRule.lag("v", 5) is None and VersionRule.lag(3, None) is None
    assert SYNC_RULE.bound == 0 and VersionRule(WeightsMode.SYNC, 4).bound == 0 and ASYNC1.bound == 1


@pytest.mark.parametrize("mode, bound, message", [
    ("fast", 1, "weights mode must be one of sync, async, got 'fast'"),
    ("async", -1, "max_staleness must be an integer >= 0"),
    ("async", 1.5, "max_staleness must be an integer >= 0"),
    ("async", True, "max_staleness must be an integer >= 0"),
])
def test_a_bad_rule_is_refused_with_what_to_give(mode, bound, message):
    with pytest.raises(ValueError, match=message):
        VersionRule(mode, bound)  # type: ignore[arg-type]


def test_the_rule_travels_in_answers_and_the_strictest_wins():
    assert VersionRule.from_answer({"weights": {"mode": "async", "max_staleness": 2}}) == VersionRule(WeightsMode.ASYNC, 2)
    assert VersionRule.from_answer({"epoch": 1}) is SYNC_RULE  # a daemon before modes
    assert VersionRule.from_answer({"weights": {"mode": "?"}}) is SYNC_RULE
    assert VersionRule.strictest([]) is SYNC_RULE
    assert VersionRule.strictest([ASYNC1, VersionRule(WeightsMode.ASYNC, 3)]) == ASYNC1
    assert VersionRule.strictest([VersionRule(WeightsMode.ASYNC, 3), SYNC_RULE]) is SYNC_RULE
    assert ASYNC1.as_dict() == {"mode": "async", "max_staleness": 1}
    # The bound in force, not the knob read in async mode only (its default is 1).
    assert VersionRule(WeightsMode.SYNC, 3).as_dict() == {"mode": "sync", "max_staleness": 0}
    assert VersionRule.from_answer({"weights": VersionRule(WeightsMode.SYNC, 3).as_dict()}) == SYNC_RULE


def test_the_config_builds_the_rule_it_reads():
    assert WeightsPolicy().rule == VersionRule(WeightsMode.SYNC, 1) and not WeightsPolicy().rule.bound
    assert WeightsPolicy("async", 2).rule == VersionRule(WeightsMode.ASYNC, 2)


# -- the fleet policy and the state machine ---------------------------------------------------


def test_the_policy_routes_by_the_rule():
    for rule, lagging in ((SYNC_RULE, False), (ASYNC1, True)):
        p = FleetPolicy(rule=rule)
        p.publish(5, None)
        assert p.is_routable(serving=True, retired=False, weight_version=5)
        assert p.is_routable(serving=True, retired=False, weight_version=4) is lagging
        assert not p.is_routable(serving=True, retired=False, weight_version=3)
        assert not p.is_routable(serving=False, retired=False, weight_version=5)
        assert not p.is_routable(serving=True, retired=True, weight_version=5)
        assert p.lag(4) == 1


def ready_fsm(version, current, rule, **kw) -> EngineFSM:
    fsm = EngineFSM("e0", ProbePolicy(), RestartPolicy(), lambda: 100.0)
    fsm.begin_start("start", restart=False)
    fsm.became_ready(version, current, rule=rule, **kw)
    return fsm


def test_a_ready_engine_within_the_bound_serves_in_async_mode_and_waits_in_sync_mode():
    fsm = ready_fsm(4, 5, ASYNC1)
    assert fsm.state is State.RUNNING and "weights v4, verified, 1 behind v5 (within max_staleness)" in fsm.reason
    assert ready_fsm(4, 5, SYNC_RULE).state is State.STALE
    assert ready_fsm(3, 5, ASYNC1).state is State.STALE  # past the bound: synced first
    assert ready_fsm(4, 5, ASYNC1, spare="a spare").state is State.STANDBY


def test_release_promote_and_recovery_follow_the_rule():
    fsm = ready_fsm(4, 5, ASYNC1, hold="held")
    assert fsm.state is State.STALE and fsm.held
    assert fsm.release("gap", 5, rule=SYNC_RULE) is None and fsm.state is State.STALE
    assert fsm.release("gap", 5, rule=ASYNC1) is not None and fsm.state is State.RUNNING

    spare = ready_fsm(4, 5, ASYNC1, spare="a spare")
    spare.promote("a place", 5, rule=ASYNC1)
    assert spare.state is State.RUNNING
    behind = ready_fsm(3, 5, ASYNC1, spare="a spare", behind_ok=True)
    behind.promote("a place", 5, rule=ASYNC1)
    assert behind.state is State.STALE  # synced first

    down = ready_fsm(4, 5, ASYNC1)
    down.exited("gone")
    down.recovered(4, 5, rule=ASYNC1)
    assert down.state is State.RUNNING and down.cause is Cause.RECOVERED
    down.exited("gone")
    down.recovered(4, 5, rule=SYNC_RULE)
    assert down.state is State.STALE


# -- the daemon: publish, status, metrics, the router feed ------------------------------------


@contextlib.asynccontextmanager
async def fleets(tmp_path):
    """make([4, 3, 2], mode, max_staleness): a daemon's fleet wired as its start-up wires it,
    one attached engine per version, each ready (RUNNING) before anything is published. A
    context on the test's own loop (the engines and sessions live and end there)."""
    engines: InProcessEngines | None = None
    sessions: list[aiohttp.ClientSession] = []
    made: list[Supervisor] = []

    async def make(versions: list[int], mode: str = "sync", max_staleness: int = 1,
                   router: RouterConfig | None = None, engine: type[EmulatedEngine] = EmulatedEngine,
                   **settings: Any) -> Supervisor:
        nonlocal engines
        session = aiohttp.ClientSession()  # on the test's loop
        sessions.append(session)
        engines = await InProcessEngines(versions, engine=engine).__aenter__()
        specs = tuple(EngineSpec(f"e{i}", url=u) for i, u in enumerate(engines.urls))
        cfg = Config(engines=specs, state_dir=str(tmp_path), log_dir=str(tmp_path), runtime_dir=str(tmp_path),
                     min_healthy=0, weights=WeightsPolicy(mode, max_staleness), router=router, **settings)
        sup = Supervisor(cfg)
        for spec, v in zip(specs, versions):
            r = sup.fleet.runners[spec.name] = EngineRunner(spec, cfg, sup.policy, sup.bus, session)
            r.fsm.begin_start("attach", restart=False)
            r.fsm.became_ready(v, sup.policy.current_version, rule=sup.policy.rule)
        made.append(sup)
        return sup

    try:
        yield make
    finally:
        for sup in made:
            for r in sup.fleet.runners.values():
                r.prober.close()
        for session in sessions:
            await session.close()
        if engines is not None:
            await engines.__aexit__(None, None, None)


def states(sup: Supervisor) -> dict[str, str]:
    return {n: r.state.value for n, r in sup.fleet.runners.items()}


async def test_a_sync_publish_takes_every_engine_not_at_it_out_of_routing(tmp_path):
    async with fleets(tmp_path) as fleet_at:
        await a_sync_publish(await fleet_at([5, 4, 3]))


async def a_sync_publish(sup: Supervisor) -> None:
    changed, message = await sup.fleet.publish_weights(5, None)
    assert changed and message == "version 5 is current; stale (not routable until synced): e1, e2"
    assert states(sup) == {"e0": "RUNNING", "e1": "STALE", "e2": "STALE"}
    assert [r.name for r in sup.fleet.routable()] == ["e0"]


async def push_unannounced(url: str, version: int) -> None:
    """The emulated engine's weight-transfer routes, as a trainer pushing without telling the
    daemon would call them: the daemon learns the version at the publish's /weight_info read."""
    async with aiohttp.ClientSession() as s:
        for route, body in (("/init_weight_transfer_engine", {"init_info": {"emulated": True}}),
                            ("/start_weight_update", {}),
                            ("/update_weights", {"update_info": {"emulated_bytes": 0}}),
                            ("/finish_weight_update", {"weight_version": str(version)})):
            async with s.post(url + route, json=body) as r:
                assert r.status < 400, (route, r.status, await r.text())


async def test_a_reader_during_a_publish_sees_the_routable_set_before_it_or_after_it(tmp_path):
    # A status or /routable answered while the publish's /weight_info reads are on the way must
    # not find every engine out of routing (v5 current, none yet read at it): it finds the set
    # before the publish or the one after it.
    async with fleets(tmp_path) as fleet_at:
        sup = await fleet_at([4, 4, 4])
        await sup.fleet.publish_weights(4, None)
        everyone = frozenset(sup.fleet.runners)
        for r in sup.fleet.runners.values():
            await push_unannounced(r.spec.base_url, 5)
        seen: list[tuple[frozenset[str], int]] = []
        publish = asyncio.ensure_future(sup.fleet.publish_weights(5, None))
        while not publish.done():
            view = routable_view(sup.fleet)
            seen.append((frozenset(e["name"] for e in view["engines"]), fleet_status(sup.fleet)["routable"]))
            await asyncio.sleep(0)
        changed, _ = await publish
        assert changed and sup.fleet.current_version == 5 and len(seen) > 3  # the reads took several turns
        assert {s for s, _ in seen} == {everyone} and {n for _, n in seen} == {3}, seen
        assert states(sup) == {"e0": "RUNNING", "e1": "RUNNING", "e2": "RUNNING"}
        assert {r.fsm.weight_version for r in sup.fleet.runners.values()} == {5}


async def test_two_publishes_side_by_side_leave_the_newer_current(tmp_path):
    # Each awaits its engines' reads between finding it may become current and becoming so: the
    # older one, let in beside the newer, would end current. One at a time, it is refused.
    async with fleets(tmp_path) as fleet_at:
        sup = await fleet_at([4, 4, 4])
        await sup.fleet.publish_weights(4, None)
        newer = asyncio.ensure_future(sup.fleet.publish_weights(6, None))
        older = asyncio.ensure_future(sup.fleet.publish_weights(5, None))
        results = await asyncio.gather(newer, older, return_exceptions=True)
        assert results[0] == (True, "version 6 is current; stale (not routable until synced): e0, e1, e2")
        assert "weight version 5 is stale: the current version is 6" in str(results[1])
        assert sup.fleet.current_version == 6


class PushEndsAfterTheRead(EmulatedEngine):
    """PROTOCOL STAND-IN: once `then` is set, /weight_info answers what the engine holds and
    then it holds `then` (a push into it that ends just after the publish read it)."""

    made: list["PushEndsAfterTheRead"] = []

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.then: str | None = None
        type(self).made.append(self)

    async def h_weight_info(self, request: web.Request) -> web.Response:
        answer = await super().h_weight_info(request)
        if self.then is not None:
            self.set_version(self.then)
            self.then = None
        return answer


async def test_a_push_that_ends_during_the_publishs_reads_is_read_again(tmp_path):
    # The publish reads each engine before the version is current; a push that ends after that
    # read (its end leaves the label, the version not yet published) would leave the engine
    # STALE on an old read. Those the version leaves behind are read once more.
    async with fleets(tmp_path) as fleet_at:
        engine = type("Pushed", (PushEndsAfterTheRead,), {"made": []})
        sup = await fleet_at([4, 4], engine=engine)
        await sup.fleet.publish_weights(4, None)
        for e in engine.made:
            e.then = "5"
        changed, message = await sup.fleet.publish_weights(5, None)
        assert changed and message == "version 5 is current"
        assert states(sup) == {"e0": "RUNNING", "e1": "RUNNING"}
        assert [r.fsm.weight_version for r in sup.fleet.runners.values()] == [5, 5]


async def test_an_async_publish_leaves_the_engines_within_the_bound_serving(tmp_path):
    async with fleets(tmp_path) as fleet_at:
        await an_async_publish(await fleet_at([5, 4, 3], mode="async", max_staleness=1))


async def an_async_publish(sup: Supervisor) -> None:
    sub = sup.fleet.subscribe()
    changed, message = await sup.fleet.publish_weights(5, None)
    assert changed and message == ("version 5 is current; stale (not routable until synced): e2; serving behind it, "
                                   "within max_staleness (1): e1")
    assert states(sup) == {"e0": "RUNNING", "e1": "RUNNING", "e2": "STALE"}
    assert sup.fleet.runners["e2"].fsm.cause is Cause.OUTDATED
    assert [r.name for r in sup.fleet.routable()] == ["e0", "e1"]
    published = [e for e in iter(lambda: None if sub.queue.empty() else sub.queue.get_nowait(), None)
                 if e["event"] == "weights_published"]
    assert published and published[0]["stale"] == ["e2"] and published[0]["lagging"] == ["e1"]

    # The next publish: e1 (now 2 behind) leaves, e0 (1 behind) stays.
    changed, message = await sup.fleet.publish_weights(6, None)
    assert states(sup) == {"e0": "RUNNING", "e1": "STALE", "e2": "STALE"}
    assert [r.name for r in sup.fleet.routable()] == ["e0"]


async def test_status_routable_and_metrics_show_the_mode_and_each_engines_lag(tmp_path):
    async with fleets(tmp_path) as fleet_at:
        await shown(await fleet_at([5, 4, 3], mode="async", max_staleness=1))


async def test_sync_mode_answers_the_bound_in_force_not_the_unused_knob(tmp_path):
    # WeightsPolicy's max_staleness defaults to 1, read in async mode only: sync answers 0, as
    # vime_max_staleness does.
    async with fleets(tmp_path) as fleet_at:
        sup = await fleet_at([5, 4], mode="sync", max_staleness=1)
        await sup.fleet.publish_weights(5, None)
        assert fleet_status(sup.fleet)["weights"] == {"mode": "sync", "max_staleness": 0}
        assert routable_view(sup.fleet)["weights"] == {"mode": "sync", "max_staleness": 0}
        samples = {m.name: s.value for m in FleetCollector(sup.fleet).collect() for s in m.samples}
        assert samples["vime_max_staleness"] == 0


async def shown(sup: Supervisor) -> None:
    await sup.fleet.publish_weights(5, None)
    st = fleet_status(sup.fleet)
    assert st["weights"] == {"mode": "async", "max_staleness": 1}
    assert {e["name"]: (e["version_lag"], e["routable"]) for e in st["engines"]} == {
        "e0": (0, True), "e1": (1, True), "e2": (2, False)}
    view = routable_view(sup.fleet)
    assert view["weights"] == {"mode": "async", "max_staleness": 1}
    assert [(e["name"], e["weight_version"]) for e in view["engines"]] == [("e0", 5), ("e1", 4)]
    samples = {(m.name, tuple(sorted(s.labels.items()))): s.value
               for m in FleetCollector(sup.fleet).collect() for s in m.samples}
    assert samples[("vime_engine_version_lag", (("engine", "e1"),))] == 1
    assert samples[("vime_engine_version_lag", (("engine", "e2"),))] == 2
    assert samples[("vime_weights_mode", (("mode", "async"),))] == 1
    assert samples[("vime_weights_mode", (("mode", "sync"),))] == 0
    assert samples[("vime_max_staleness", ())] == 1


async def test_the_router_feed_keeps_the_engines_the_rule_allows_and_removes_the_others(tmp_path):
    fake = StandinRouter()
    url = fake.url
    try:
        async with fleets(tmp_path) as fleet_at, aiohttp.ClientSession() as session:
            sup = await fleet_at([5, 4, 3], mode="async", max_staleness=1)
            feed = RouterFeed(sup.fleet, RouterConfig(url=url), make_router("vllm-router", url, session))
            sup.bus.add_listener(feed)
            await feed.reconcile()
            e = {n: r.spec.base_url for n, r in sup.fleet.runners.items()}
            assert sorted(fake.workers()) == sorted(e.values())  # nothing published: all serve
            await sup.fleet.publish_weights(5, None)
            await asyncio.wait_for(asyncio.gather(*feed._pending), 10)
            await feed.reconcile()
            assert sorted(fake.workers()) == sorted([e["e0"], e["e1"]])
            assert [u for _, u in fake.deletes] == [e["e2"]]
            await sup.fleet.publish_weights(6, None)
            await asyncio.wait_for(asyncio.gather(*feed._pending), 10)
            await feed.reconcile()
            assert fake.workers() == [e["e0"]]
            await feed.close()
    finally:
        fake.close()


# -- the cluster view -------------------------------------------------------------------------


def node_answer(versions: dict[str, int], current: int, weights: dict | None) -> dict:
    out = {"epoch": 1, "weight_version": current,
           "engines": [{"name": n, "url": f"http://h:{i}", "model": "m", "weight_version": v, "incarnation": 1}
                       for i, (n, v) in enumerate(versions.items())]}
    if weights is not None:
        out["weights"] = weights
    return out


def test_the_cluster_view_applies_the_daemons_rule_and_the_strictest_of_several():
    v = ClusterView(min_healthy=0)
    v.node_answered("a", node_answer({"e0": 5, "e1": 4, "e2": 3}, 5, {"mode": "async", "max_staleness": 1}))
    assert v.rule == ASYNC1 and v.names() == ["a/e0", "a/e1"]
    assert v.answer()["weights"] == {"mode": "async", "max_staleness": 1}
    v.published(6, None)
    assert v.names() == ["a/e0"]
    # A node in sync mode (or one before modes) joins: the cluster is as strict as it.
    v.node_answered("b", node_answer({"e0": 6}, 6, None))
    v.node_answered("a", node_answer({"e0": 6, "e1": 5}, 6, {"mode": "async", "max_staleness": 1}))
    assert v.rule is SYNC_RULE and v.names() == ["a/e0", "b/e0"]


async def test_an_engine_ready_during_a_round_at_a_version_behind_is_held_then_stale_in_sync_mode(tmp_path):
    """The sync coordinator's release asks the rule: an engine that came up during a round one
    version behind the current one is held, and in the gap stays STALE, to be synced first."""
    async with fleets(tmp_path) as fleet_at:
        sup = await fleet_at([5, 4], mode="sync", max_staleness=1)
        await sup.fleet.publish_weights(5, None)
        e1 = sup.fleet.runners["e1"]
        sup.fleet.start_round(1)
        e1.fsm.exited("gone")
        e1.fsm.begin_start("restart", restart=True)
        e1.fsm.became_ready(4, 5, hold=sup.policy.hold_reason(), rule=sup.policy.rule)
        assert e1.state is State.STALE and e1.fsm.held
        sup.fleet.end_round(1)
        assert e1.state is State.STALE and [r.name for r in sup.fleet.routable()] == ["e0"]


async def test_in_async_mode_a_round_holds_nothing_an_engine_joins_once_ready_at_an_allowed_version(tmp_path):
    """Async mode has no round gap to wait for: rounds the trainer still opens gate nothing, so
    an engine ready one version behind (within max_staleness) joins routing at once."""
    async with fleets(tmp_path) as fleet_at:
        sup = await fleet_at([5, 4], mode="async", max_staleness=1)
        await sup.fleet.publish_weights(5, None)
        e1 = sup.fleet.runners["e1"]
        sup.fleet.start_round(1)
        assert sup.policy.hold_reason() is None and sup.policy.may_restart() == (True, None)
        e1.fsm.exited("gone")
        e1.fsm.begin_start("restart", restart=True)
        e1.fsm.became_ready(4, 5, hold=sup.policy.hold_reason(), rule=sup.policy.rule)
        assert e1.state is State.RUNNING and not e1.fsm.held
        assert [r.name for r in sup.fleet.routable()] == ["e0", "e1"]
