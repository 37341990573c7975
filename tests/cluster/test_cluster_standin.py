"""The cluster client over a real Ray cluster of simulated nodes (ray.cluster_utils: one raylet
per node, each at its own loopback address) with a real vime-supervisor daemon per node. The
engines are PROTOCOL STAND-INS (tests/support/standin_group.py) that the daemons spawn, bound
to their node's address: what these tests check is the cluster client's behaviour; the same
path with real vLLM engines is tests/cluster/test_cluster_real.py.
"""

from __future__ import annotations

import inspect
import os
import signal
import threading
import time

import pytest
import ray

from vime.cluster import AsyncClusterClient, ClusterBelowFloor, ClusterClient, NodeUnavailable
from vime.cluster.client import CLUSTER_VERBS, NOT_CLUSTERED
from vime.harness.ray_nodes import cleanup, node_address, standin_config
from vime.supervisor.client import VERBS, BadRequest, ConflictError, SupervisorClient, SupervisorError, UnknownEngine
from vime.supervisor.client.calls import Verbs

from support.polling import wait_until
from support.standin_router import StandinRouter

pytestmark = pytest.mark.cluster

A, B = node_address(0), node_address(1)  # 127.0.0.2, 127.0.0.3
ENGINES = ["e0", "e1"]


def test_the_cluster_offers_each_verb_of_the_table_with_its_arguments():
    """The verb list is the local client's table: each verb is a coroutine of the cluster client
    with the same parameters, or named in NOT_CLUSTERED; the blocking facade offers the same."""
    assert set(CLUSTER_VERBS) | set(NOT_CLUSTERED) == set(VERBS) and set(NOT_CLUSTERED) <= set(VERBS)
    for verb in CLUSTER_VERBS:
        method = getattr(AsyncClusterClient, verb, None)
        assert method is not None and inspect.iscoroutinefunction(method), f"AsyncClusterClient lacks {verb}"
        assert (list(inspect.signature(method).parameters)[1:]
                == list(getattr(Verbs, verb).signature.parameters)), verb
    for verb in NOT_CLUSTERED:
        assert not hasattr(AsyncClusterClient, verb)
    facade = object.__new__(ClusterClient)
    facade._client = object.__new__(AsyncClusterClient)
    with pytest.raises(AttributeError):
        facade.daemon_log
    assert callable(facade.push_end)


class Recorder:
    """The merged event stream, read on a thread as a trainer would."""

    def __init__(self, sup: ClusterClient, **kw):
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._t = threading.Thread(target=self._run, args=(sup, kw), daemon=True)
        self._t.start()

    def _run(self, sup, kw):
        for ev in sup.events(**kw):
            with self._lock:
                self.events.append(ev)

    def since(self, i: int = 0) -> list[dict]:
        with self._lock:
            return list(self.events[i:])

    def mark(self) -> int:
        with self._lock:
            return len(self.events)

    def wait(self, pred, timeout: float, after: int = 0) -> dict:
        return wait_until(lambda: next((e for e in self.since(after) if pred(e)), None), timeout, "event")


@pytest.fixture(scope="module")
def fleet(ray_head, tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    nodes = [standin_config(root / f"n{i}", node_address(i), ENGINES, mode="version=1") for i in range(2)]
    try:
        for n in nodes:
            n.start_daemon()
            n.ray_node = ray_head.add(n.address)
        sup = ClusterClient([A, B], socket_path={n.address: n.sock for n in nodes}, min_healthy=2,
                            unavailable_grace=4.0, discover_interval=0.5)
        wait_until(lambda: len(sup.routable_engines()["engines"]) == 4, 30, "four stand-ins routable")
        rec = Recorder(sup)
        hello = rec.wait(lambda e: e["event"] == "hello", 10)
        assert "node" in hello and hello["scope"] == "cluster"
        yield sup, nodes, rec, ray_head
        sup.shutdown()
    finally:
        for n in nodes:
            if n.ray_node is not None:
                try:
                    ray_head.remove(n.ray_node)
                except Exception:
                    pass
        cleanup(nodes)


def names(view: dict) -> list[str]:
    return sorted(e["name"] for e in view["engines"])


def test_routable_is_the_union_named_node_slash_engine(fleet):
    sup, nodes, rec, _ = fleet
    view = sup.routable_engines()
    assert names(view) == [f"{A}/e0", f"{A}/e1", f"{B}/e0", f"{B}/e1"]
    for e in view["engines"]:
        node = e["name"].split("/")[0]
        assert e["node"] == node and e["url"].startswith(f"http://{node}:"), e  # the node's own address
    assert sup.routable_engines()["epoch"] == view["epoch"]  # nothing changed: same epoch
    assert {n: r["state"] for n, r in sup.nodes().items()} == {A: "UP", B: "UP"}
    st = sup.status()
    assert sorted(e["name"] for e in st["engines"]) == names(view)
    assert st["routable"] == 4 and not st["below_min_healthy"]


def test_actions_by_node_slash_engine_move_the_cluster_epoch(fleet):
    sup, nodes, rec, _ = fleet
    before = sup.routable_engines()
    mark = rec.mark()
    answer = sup.stop(f"{B}/e1")
    assert answer["engine"] == f"{B}/e1"
    ev = rec.wait(lambda e: e["event"] == "membership" and f"{B}/e1" not in e["routable"], 10, mark)
    assert ev["epoch"] > before["epoch"] and ev["node"] == B
    tr = rec.wait(lambda e: e["event"] == "transition" and e.get("engine") == f"{B}/e1", 10, mark)
    assert tr["node"] == B  # a node's own event, named for the cluster
    assert f"{B}/e1" not in names(sup.routable_engines())
    sup.start(f"{B}/e1")
    wait_until(lambda: f"{B}/e1" in names(sup.routable_engines()), 20, "e1 back on B")
    with pytest.raises(UnknownEngine):
        sup.stop(f"{B}/nosuch")
    with pytest.raises(UnknownEngine):
        sup.stop("127.0.0.99/e0")
    with pytest.raises(BadRequest):
        sup.stop("e0")  # not a cluster name
    epoch = sup.routable_engines()["epoch"]
    for bad in (lambda: sup.engine_log(f"{A}/e0", "abc"), lambda: sup.sync_begin(f"{A}/e0", "x"),
                lambda: sup.start_round("x"), lambda: sup.start_round(None), lambda: sup.publish_weights(-1)):
        with pytest.raises(BadRequest):
            bad()
    assert {n: r["state"] for n, r in sup.nodes().items()} == {A: "UP", B: "UP"}  # nothing lost
    assert sup.routable_engines()["epoch"] == epoch and not sup.status()["round_open"]
    assert "x" in sup.engine_log(f"{A}/e0") or sup.engine_log(f"{A}/e0") is not None


def test_rounds_and_weights_go_to_every_node(fleet):
    sup, nodes, rec, _ = fleet
    mark = rec.mark()
    with sup.round(1) as r:
        assert set(r["nodes"]) == {A, B} and all(a.get("open") for a in r["nodes"].values())
        st = sup.status()
        assert all(row["daemon"]["round_open"] for row in st["nodes"].values())
        # A second client (a trainer restarted mid-round, an operator's script) takes the
        # open round on; connecting changes nothing on any node.
        other = ClusterClient([A, B], socket_path={n.address: n.sock for n in nodes})
        try:
            assert other.status()["round"] == 1 and other.status()["round_open"]
        finally:
            other.shutdown()
        assert all(row["daemon"]["round_open"] for row in sup.status()["nodes"].values())
        with pytest.raises(RuntimeError, match="shut down"):
            other.routable_engines()
    ends = [e for e in rec.since(mark) if e["event"] == "round_end"]
    wait_until(lambda: {e["node"] for e in rec.since(mark) if e["event"] == "round_end"} == {A, B}, 5, "round_end from both")
    assert all(e["round"] == 1 for e in ends)
    sup.publish_weights(1)
    view = sup.routable_engines()
    assert view["weight_version"] == 1 and len(view["engines"]) == 4  # the stand-ins report version 1
    assert {row["daemon"]["weight_version"] for row in sup.status()["nodes"].values()} == {1}


def test_a_cluster_push_is_announced_to_each_node_with_its_own_engines(fleet):
    """push_begin splits the receivers by node: each daemon lists the push with its own engines
    (same version, bytes, deadline); a node that does not take it leaves the push going on the
    others and says so; push_end ends it on each node with that node's failed names."""
    sup, nodes, rec, _ = fleet
    version = sup.routable_engines()["weight_version"]
    mark = rec.mark()
    away = "127.0.0.99/e0"  # a node not in the cluster: it does not take the announcement
    push = sup.push_begin(version, [f"{A}/e0", f"{B}/e0", f"{A}/e1", away], 4096, 30.0)
    assert set(push.nodes) == {A, B} and list(push.unannounced) == [away], push.unannounced
    own = {}
    for n in nodes:
        with SupervisorClient(n.sock) as local:
            [listed] = local.pushes()
        own[n.address] = listed
        assert listed["push"] == push.nodes[n.address]
        assert (listed["version"], listed["bytes"], listed["deadline_s"]) == (version, 4096, 30.0)
    assert own[A]["engines"] == ["e0", "e1"] and own[B]["engines"] == ["e0"]
    merged = sup.pushes()
    assert sorted(e for p in merged for e in p["engines"]) == [f"{A}/e0", f"{A}/e1", f"{B}/e0"]
    assert {p["node"] for p in merged} == {A, B}
    begun = rec.wait(lambda e: e["event"] == "push_begin" and e["node"] == B, 10, mark)
    assert begun["engines"] == [f"{B}/e0"]
    with pytest.raises(ConflictError):  # an engine holds one push at a time, as on one node
        sup.push_begin(version, [f"{A}/e1"], 1, 30.0)
    summary = sup.push_end(push, False, {f"{B}/e0": "collective timed out", away: "never announced"})
    assert summary["outcome"] == "failed" and summary["not_ended"] == {}
    assert summary["failed"] == {f"{B}/e0": "collective timed out"}
    assert summary["unannounced"] == {away: "never announced"}
    assert sorted(summary["engines"]) == [f"{A}/e0", f"{A}/e1", f"{B}/e0"]
    assert sup.pushes() == []
    for n in nodes:
        with SupervisorClient(n.sock) as local:
            assert local.pushes() == []
    with pytest.raises(SupervisorError) as ended:  # ended already, on every node
        sup.push_end(push, True)
    assert ended.value.code == "unknown_push"
    with pytest.raises(UnknownEngine):  # no node took it: raised as on one node
        sup.push_begin(version, [away], 1, 30.0)
    with pytest.raises(BadRequest):
        sup.push_begin(version, ["e0"], 1, 30.0)  # not a cluster name, refused before any node is asked
    assert {n: r["state"] for n, r in sup.nodes().items()} == {A: "UP", B: "UP"}


def test_a_briefly_unavailable_agent_is_retried(fleet):
    """The agent's process dies; Ray restarts it on its node: calls made meanwhile are retried
    (jittered, bounded) and answer; the node is UP again."""
    sup, nodes, rec, _ = fleet
    agent = sup._client._nodes[A].agent
    pid = ray.get(agent.where.remote())["pid"]
    mark = rec.mark()
    os.kill(pid, signal.SIGKILL)
    st = sup.status()  # retried while the agent restarts
    assert st["nodes"][A]["daemon"] is not None
    wait_until(lambda: ray.get(agent.where.remote())["pid"] != pid, 20, "a new agent process")
    wait_until(lambda: sup.nodes()[A]["state"] == "UP", 20, "A up again")
    assert not [e for e in rec.since(mark) if e["event"] == "node_lost"]
    wait_until(lambda: len(sup.routable_engines()["engines"]) == 4, 20, "all four back")


def test_a_dead_agent_loses_its_node_at_once_and_is_replaced(fleet):
    sup, nodes, rec, _ = fleet
    agent = sup._client._nodes[B].agent
    mark = rec.mark()
    ray.kill(agent, no_restart=True)
    ev = rec.wait(lambda e: e["event"] == "node_lost" and e["node"] == B, 10, mark)
    assert "agent gone (ActorDiedError)" in ev["reason"]
    t0 = time.monotonic()
    with pytest.raises(NodeUnavailable):
        sup.stop(f"{B}/e0")  # not retried forever: it is dead
    assert time.monotonic() - t0 < 5
    # The node itself is alive: a new agent is placed, and the node comes back (no round open).
    rec.wait(lambda e: e["event"] == "node_admitted" and e["node"] == B, 30, mark)
    wait_until(lambda: len(sup.routable_engines()["engines"]) == 4, 20, "B's engines back")


def test_a_node_lost_mid_round_leaves_at_once_and_rejoins_in_a_gap(fleet):
    sup, nodes, rec, ray_head = fleet
    a = nodes[0]
    epoch0 = sup.routable_engines()["epoch"]
    sup.start_round(2)
    mark = rec.mark()
    ray_head.remove(a.ray_node)
    a.ray_node = None
    a.kill_daemon_and_engines()  # a node's loss takes its processes with it
    ev = rec.wait(lambda e: e["event"] == "membership" and not any(n.startswith(A + "/") for n in e["routable"]),
                  10, mark)
    assert ev["epoch"] > epoch0 and sorted(ev["routable"]) == [f"{B}/e0", f"{B}/e1"]
    view = sup.routable_engines()
    assert names(view) == [f"{B}/e0", f"{B}/e1"]
    rec.wait(lambda e: e["event"] == "node_lost" and e["node"] == A, 15, mark)
    # The round ends on the node that is left, and the next starts: the floor (2) holds.
    ended = sup.end_round(2)
    assert ended["nodes"][B]["open"] is False
    sup.start_round(3)
    for m in [*a.modes.values(), *nodes[1].modes.values()]:
        m.write_text("version=2")  # the stand-ins report what a sync would have made them
    sup.publish_weights(2)  # while A is away: it must get this version when it returns
    # A comes back mid-round: its daemon re-spawns its engines; it joins, but not before the gap.
    a.start_daemon()
    a.ray_node = ray_head.add(a.address)
    rec.wait(lambda e: e["event"] == "node_joined" and e["node"] == A, 60, mark)
    time.sleep(1.0)
    assert all(not n.startswith(A + "/") for n in names(sup.routable_engines())), "joined mid-round"
    assert sup.nodes()[A]["state"] != "UP", sup.nodes()[A]  # JOINING (or LOST again while Ray still lists the old node)
    sup.end_round(3)
    view = wait_until(lambda: (v := sup.routable_engines()) and len(v["engines"]) == 4 and v, 30, "A admitted")
    assert {e["weight_version"] for e in view["engines"]} == {2}
    assert sup.status()["nodes"][A]["daemon"]["weight_version"] == 2  # published to it on its return


def test_below_the_cluster_floor_a_round_does_not_start(fleet):
    sup, nodes, rec, _ = fleet
    wait_until(lambda: len(sup.routable_engines()["engines"]) == 4, 30, "four routable")
    sup.stop(f"{A}/e0")
    sup.stop(f"{A}/e1")
    sup.stop(f"{B}/e0")
    wait_until(lambda: len(sup.routable_engines()["engines"]) == 1, 10, "one left")
    assert sup.status()["below_min_healthy"]
    with pytest.raises(ClusterBelowFloor):
        sup.start_round(10)
    for n in (f"{A}/e0", f"{A}/e1", f"{B}/e0"):
        sup.start(n)
    wait_until(lambda: len(sup.routable_engines()["engines"]) == 4, 30, "four again")
    assert sup.start_round(10)["open"]
    sup.end_round(10)


def test_a_node_that_misses_a_publish_has_its_engines_taken_out_of_a_shared_router(fleet):
    """B's daemon is stopped (SIGSTOP: alive, answering nothing) while the next version is
    published: it goes on judging by the version before, so a router the nodes share must not
    route to its engines. The publisher takes them out before the publish returns; A's, which
    took the version, stay. (The router is a PROTOCOL STAND-IN, tests/support/standin_router.py,
    listing the four engines as the nodes' daemons would have added them.)"""
    sup, nodes, rec, _ = fleet
    view = wait_until(lambda: (v := sup.routable_engines()) and len(v["engines"]) == 4 and v, 30, "four routable")
    version = max([view["weight_version"] or 0] + [e["weight_version"] or 0 for e in view["engines"]]) + 1
    urls = {n: {e["url"] for e in view["engines"] if e["node"] == n} for n in (A, B)}
    router = StandinRouter()
    for url in urls[A] | urls[B]:
        router.add(url)
    a, b = nodes
    for m in [*a.modes.values(), *b.modes.values()]:
        m.write_text(f"version={version}")  # what a sync would have made them
    publisher = ClusterClient([A, B], socket_path={n.address: n.sock for n in nodes}, router_url=router.url,
                              call_timeout=2.0)
    try:
        publisher.routable_engines()  # each node's routable list, as a trainer's client has it
        os.kill(b.daemon.proc.pid, signal.SIGSTOP)
        try:
            out = publisher.publish_weights(version)
        finally:
            os.kill(b.daemon.proc.pid, signal.SIGCONT)
        assert "error" in out["nodes"][B] and "error" not in out["nodes"][A], out
        assert set(router.workers()) == urls[A], router.workers()
    finally:
        publisher.shutdown()
        router.close()
    # B takes the version from the fleet's client; its engines are routable again.
    sup.publish_weights(version)
    wait_until(lambda: len(sup.routable_engines()["engines"]) == 4, 30, "four again")
