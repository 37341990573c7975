"""Faults with no round (`[weights] mode = "async"`): a real daemon over PROTOCOL STAND-IN engines
(tests/support/standin_group.py; not vLLM: their /weight_info answers what each one's mode
file says, `version=X`, across restarts, as a checkpoint on disk would) and a PROTOCOL STAND-IN
router (tests/support/standin_router.py). The trainer keeps opening rounds: in async mode they
gate nothing.

The same races driven one step at a time (a publish between a sync's push and its end, a
publish's read of an unverified engine, a wave's push end) are in tests/unit/test_async_fault_rules.py.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime
from pathlib import Path

from vime.harness.local_daemon import (
    Daemon, EventStream, free_port, kill_all, standin_config, standin_model, standin_python)
from vime.supervisor.client import SupervisorClient
from vime.supervisor.states import VersionRule, WeightsMode

from support.polling import wait_until
from support.standin_router import StandinRouter
from support.standins import STANDIN_GROUP

RULE = VersionRule(WeightsMode.ASYNC, 1)
ROUTER = {"period": 30.0, "watch": 0.3, "remove_timeout": 0.5, "timeout": 0.5}


class Node:
    """A daemon in async mode (max_staleness 1) over stand-in engines, each with its mode file."""

    def __init__(self, tmp: Path, names: tuple[str, ...], router: StandinRouter, **supervisor):
        python = standin_python(tmp, STANDIN_GROUP)
        model = standin_model(tmp / "model")
        ports = {n: free_port() for n in names}
        self.modes = {n: tmp / f"{n}.mode" for n in names}
        for m in self.modes.values():
            m.write_text("version=1")
        engines = [{"name": n, "model": str(model), "served_model_name": "tiny", "port": ports[n],
                    "env": {"STANDIN_MODE_FILE": str(self.modes[n])}} for n in names]
        self.urls = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
        self.d = Daemon(standin_config(tmp, python, engines, supervisor={"min_healthy": 1, **supervisor},
                                       weights={"mode": "async", "max_staleness": 1},
                                       router={"url": router.url, **ROUTER}))
        self.sock = str(tmp / "run" / "supervisor.sock")
        self.d.wait_for(lambda e: e.get("event") == "supervisor.ready", 60)
        self.c = SupervisorClient(self.sock)
        self.stream = EventStream(self.sock)

    def hold(self, name: str, version: int) -> None:
        self.modes[name].write_text(f"version={version}")

    def states(self) -> dict[str, str]:
        return {e["name"]: e["state"] for e in self.c.status()["engines"]}

    def routable(self) -> dict[str, int | str | None]:
        return {e["name"]: e["weight_version"] for e in self.c.routable_engines()["engines"]}


def at(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def listed_only_while_serving(node: Node) -> int:
    """Replayed in order from the socket stream: every membership lists only engines serving
    (RUNNING or SUSPECT) at that point; a publish's `stale` engines are out of it. Returns the
    memberships checked."""
    serving: dict[str, bool] = {}
    checked = 0
    for ev in list(node.stream.events):
        kind = ev["event"]
        if kind == "hello":
            serving = {e["name"]: True for e in ev["engines"]}
        elif kind == "weights_published":
            for name in ev["stale"]:
                serving[name] = False
        elif kind == "transition":
            serving[ev["engine"]] = ev["to_state"] in ("RUNNING", "SUSPECT")
        elif kind == "membership":
            assert all(serving.get(n) for n in ev["routable"]), (ev, serving)
            checked += 1
    return checked


def test_a_kill_in_async_mode_a_spare_within_the_bound_takes_the_place_at_once_and_the_router_follows(tmp_path):
    """Two serving engines and one spare, spares_sync unset (async mode's default: "publish").
    v1 then v2 are published; the spare, left at v1, is within max_staleness (1): no sync. A
    round is open (the trainer still counts them). kill -9 of a serving engine: the spare is
    promoted at its v1 in the same turn as the death is seen (no sync, no wait for the round),
    the router lists it and drops the dead one; the dead one restarts at once and, its place
    taken, is the spare."""
    router = StandinRouter()
    node = None
    try:
        node = Node(tmp_path, ("e0", "e1", "e2"), router, spares=1)
        d, c = node.d, node.c
        wait_until(lambda: sorted(node.states().values()) == ["RUNNING", "RUNNING", "STANDBY"], 30,
                   "two serving, one spare")
        st = node.states()
        spare = next(n for n, s in st.items() if s == "STANDBY")
        serving = sorted(n for n in st if n != spare)
        c.publish_weights(1)
        for n in serving:
            node.hold(n, 2)
        said = c.publish_weights(2)["message"]
        assert "stale" not in said, said  # every engine within the bound, the spare too: nothing to sync
        assert node.states()[spare] == "STANDBY"
        wait_until(lambda: sorted(router.workers()) == sorted(node.urls[n] for n in serving), 10, "router: serving")
        c.start_round(5)
        victim = serving[0]
        mark = d.mark()
        os.kill(d.last_pid(victim), signal.SIGKILL)
        died = d.transition(victim, "EXITED", 10, after=mark)
        promoted = d.transition(spare, "RUNNING", 10, after=mark)
        assert promoted["cause"] == "promoted", promoted
        assert "async mode: no round gap to wait for" in promoted["reason"], promoted
        moves = [(e["engine"], e["to_state"]) for e in d.events[mark:] if e.get("event") == "engine.transition"]
        # A state change, not a sync: the spare went from STANDBY to RUNNING with nothing between.
        assert [m for m in moves if m[0] == spare][:1] == [(spare, "RUNNING")], moves
        print(f"\npromoted {at(promoted) - at(died):.3f}s after the death was seen (round 5 open)")
        assert c.status()["round_open"] is True
        assert node.routable() == {spare: 1, serving[1]: 2}  # v1 is one behind v2: within the bound
        assert all(RULE.allows(v, 2) for v in node.routable().values())
        wait_until(lambda: sorted(router.workers()) == sorted([node.urls[spare], node.urls[serving[1]]]), 10,
                   "the router follows: the spare in, the dead engine out")
        back = d.transition(victim, "STANDBY", 30, after=mark)
        assert back["cause"] == "spare", back
        assert node.urls[victim] not in router.workers()
        assert listed_only_while_serving(node) >= 2
    finally:
        kill_all([node.d] if node else [])
        router.close()


def test_a_restarted_engine_at_v_is_never_routable_after_v_plus_2_and_is_once_verified(tmp_path):
    """No spare. e1 is killed and restarts at once (a round is open); its boot cannot finish
    (its /health is silent) until v2 and v3 are published; then it answers at v1, two behind:
    STALE, never routable, never listed by the router. Verified at v3 (the trainer agent's
    push: sync/begin, the push, sync/end) it is routable at once, the round still open."""
    router = StandinRouter()
    node = None
    try:
        node = Node(tmp_path, ("e0", "e1"), router)
        d, c = node.d, node.c
        wait_until(lambda: set(node.states().values()) == {"RUNNING"}, 30, "both serving")
        c.publish_weights(1)
        wait_until(lambda: sorted(router.workers()) == sorted(node.urls.values()), 10, "router: both")
        c.start_round(1)
        mark = d.mark()
        at_kill = len(node.stream.of("membership"))
        node.modes["e1"].write_text("silent")  # the restart's boot does not finish until told
        os.kill(d.last_pid("e1"), signal.SIGKILL)
        d.transition("e1", "EXITED", 10, after=mark)
        d.transition("e1", "STARTING", 10, after=mark)  # at once: async mode waits for no gap
        gone = time.monotonic()
        wait_until(lambda: node.urls["e1"] not in router.workers(), 10, "router: e1 out")
        for v in (2, 3):
            node.hold("e0", v)
            c.publish_weights(v)
        node.hold("e1", 1)  # boots now, at v1: two behind v3
        ready = d.transition("e1", "STALE", 20, after=mark)
        assert ready["cause"] == "ready" and "weights v1, current v3" in ready["reason"], ready
        time.sleep(1.0)  # the router's watch (0.3 s) and the probes have had their turns
        assert node.routable() == {"e0": 3}
        assert not [u for t, u in router.posts if u == node.urls["e1"] and t > gone], router.posts
        seen = node.stream.of("membership")
        assert seen and not [m for m in seen[at_kill:] if "e1" in m["routable"]], seen
        # Verified at v3 by the agent's push: routable at once, inside round 1.
        c.sync_begin("e1", 3)
        node.hold("e1", 3)
        ended = c.sync_end("e1", 3, True)
        assert ended["state"] == "RUNNING", ended
        assert c.status()["round_open"] is True and node.routable() == {"e0": 3, "e1": 3}
        wait_until(lambda: node.urls["e1"] in router.workers(), 10, "router: e1 back")
        wait_until(lambda: "e1" in node.stream.of("membership")[-1]["routable"], 10, "the stream: e1 back")
        assert listed_only_while_serving(node) >= 2  # e1 out at the kill, in once verified
    finally:
        kill_all([node.d] if node else [])
        router.close()


def test_a_publish_during_a_spare_promotion_never_leaves_the_spare_routable_outside_the_rule(tmp_path):
    """spares_sync = "promotion" (given: the spare stays at v1 while v3 is published). kill -9
    of a serving engine: the spare is promoted behind the bound (STALE, to be synced first). The
    trainer's agent pushes v3 into it (sync/begin, the push, sync/end), and while it pushes v4
    and v5 are published: the sync ends with v3 two behind, so the spare goes STALE (cause
    outdated), never serving, never listed by the router; synced to v5 it serves at once."""
    router = StandinRouter()
    node = None
    try:
        node = Node(tmp_path, ("e0", "e1", "e2"), router, spares=1, spares_sync="promotion")
        d, c = node.d, node.c
        wait_until(lambda: sorted(node.states().values()) == ["RUNNING", "RUNNING", "STANDBY"], 30,
                   "two serving, one spare")
        st = node.states()
        spare = next(n for n, s in st.items() if s == "STANDBY")
        victim, other = sorted(n for n in st if n != spare)
        c.publish_weights(1)
        for v in (2, 3):
            node.hold(victim, v)
            node.hold(other, v)
            c.publish_weights(v)
        assert node.states()[spare] == "STANDBY"  # kept behind: synced only if promoted
        c.start_round(1)
        mark = d.mark()
        os.kill(d.last_pid(victim), signal.SIGKILL)
        promoted = d.transition(spare, "STALE", 10, after=mark)
        assert promoted["cause"] == "promoted" and "synced first" in promoted["reason"], promoted
        at_promotion = len(node.stream.of("membership"))
        c.sync_begin(spare, 3)  # the trainer's agent takes it
        node.hold(spare, 3)  # its push lands...
        for v in (4, 5):  # ...while the trainer publishes twice
            node.hold(other, v)
            c.publish_weights(v)
        ended = c.sync_end(spare, 3, True)
        assert ended["state"] == "STALE", ended
        again = d.wait_for(lambda e: e.get("event") == "engine.transition" and e.get("engine") == spare
                           and e.get("cause") == "outdated", 10, after=mark)
        assert "v5 was published meanwhile: synced again" in again["reason"], again
        overtaken = d.wait_for(lambda e: e.get("event") == "sync.overtaken" and e.get("engine") == spare, 10,
                               after=mark)
        assert (overtaken["version"], overtaken["current"]) == (3, 5), overtaken
        assert spare not in node.routable()
        c.sync_begin(spare, 5)
        node.hold(spare, 5)
        assert c.sync_end(spare, 5, True)["state"] == "RUNNING"
        served = time.monotonic()
        assert node.routable()[spare] == 5 and c.status()["round_open"] is True
        moves = [(e["to_state"], e["cause"]) for e in d.events[mark:]
                 if e.get("event") == "engine.transition" and e.get("engine") == spare]
        assert moves == [("STALE", "promoted"), ("SYNCING", "sync"), ("STALE", "outdated"), ("SYNCING", "sync"),
                         ("RUNNING", "verified")], moves
        wait_until(lambda: node.urls[spare] in router.workers(), 10, "router: the spare in")
        assert not [t for t, u in router.posts if u == node.urls[spare] and t < served], router.posts
        wait_until(lambda: spare in node.stream.of("membership")[-1]["routable"], 10, "the stream: the spare in")
        assert [m["routable"] for m in node.stream.of("membership")[at_promotion:] if spare in m["routable"]] == [
            sorted([other, spare])]
        assert listed_only_while_serving(node) >= 2
    finally:
        kill_all([node.d] if node else [])
        router.close()


def test_an_unreadable_weight_info_at_a_publish_leaves_an_engine_within_the_bound_routable(tmp_path):
    """A publish's re-read of /weight_info that cannot be read (a 503) keeps the engine's label:
    e0, one version behind within max_staleness 1, stays routable (not relabelled base weights)."""
    router = StandinRouter()
    node = None
    try:
        node = Node(tmp_path, ("e0", "e1"), router)  # both report version=1
        c = node.c
        wait_until(lambda: sorted(node.states().values()) == ["RUNNING", "RUNNING"], 30, "both serving")
        c.publish_weights(1)
        node.modes["e0"].write_text("weights_down")  # /weight_info answers 503; probes still pass
        c.publish_weights(2)  # e0 holds v1: one behind, within max_staleness 1
        assert node.routable() == {"e0": 1, "e1": 1}, c.status()["engines"]
    finally:
        kill_all([node.d] if node else [])
        router.close()
