"""The cluster's decisions (vime.cluster.view), pure: names, the union, one epoch, nodes that
leave at once and join only in a round gap, at the current version, and the floor."""

from __future__ import annotations

import pytest

from vime.cluster.view import (ClusterPush, ClusterView, NodeState, by_node, merge_push_end, merge_pushes, push_id,
                               push_ids, qualify, qualify_answer, split, split_failed)
from vime.supervisor.client import VERBS
from vime.supervisor.client.errors import ConnectionLost


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def answer(*names: str, version: int | None = None, epoch: int = 1) -> dict:
    return {"epoch": epoch, "weight_version": version,
            "engines": [{"name": n, "url": f"http://h:{i}", "model": "m", "weight_version": version,
                         "incarnation": 1} for i, n in enumerate(names)]}


def test_names_split_on_the_last_slash_and_refuse_bare_names():
    assert qualify("10.0.0.7", "e0") == "10.0.0.7/e0"
    assert split("10.0.0.7/e0") == ("10.0.0.7", "e0")
    for bad in ("e0", "/e0", "10.0.0.7/", ""):
        with pytest.raises(ValueError, match="NODE/ENGINE"):
            split(bad)


def test_answers_and_events_get_cluster_names():
    ev = {"event": "membership", "engine": "e0", "routable": ["e0", "e1"],
          "engines": [{"name": "e1", "url": "u"}]}
    out = qualify_answer("n1", ev)
    assert out["engine"] == "n1/e0" and out["routable"] == ["n1/e0", "n1/e1"]
    assert out["engines"] == [{"name": "n1/e1", "url": "u", "node": "n1"}]
    assert ev["engine"] == "e0"  # the node's answer itself is not changed


def test_union_and_one_epoch_that_moves_with_any_nodes_change():
    v = ClusterView(min_healthy=1, clock=Clock())
    c1 = v.node_answered("a", answer("e0", "e1"))
    c2 = v.node_answered("b", answer("e0"))
    assert c1.entered is NodeState.UP and c2.epoch_moved
    assert v.names() == ["a/e0", "a/e1", "b/e0"]
    e = v.epoch
    assert not v.node_answered("a", answer("e0", "e1", epoch=1)).epoch_moved  # same set
    assert v.epoch == e
    assert v.node_answered("b", answer("e0", "e1", epoch=2)).epoch_moved
    assert v.epoch == e + 1


def test_a_lost_node_leaves_at_once_and_returns_only_in_a_gap():
    clock = Clock()
    v = ClusterView(min_healthy=1, clock=clock)
    v.node_answered("a", answer("e0"))
    v.node_answered("b", answer("e0"))
    v.round_started(5)
    lost = v.node_lost("a", "agent died")
    assert lost.entered is NodeState.LOST and lost.epoch_moved and v.names() == ["b/e0"]
    back = v.node_answered("a", answer("e0"))
    assert back.entered is NodeState.JOINING and not back.epoch_moved
    assert v.names() == ["b/e0"]  # mid-round: not yet
    assert v.round_ended(5) == ["a"]
    assert v.recompute().epoch_moved and v.names() == ["a/e0", "b/e0"]
    assert v.nodes["a"].lost_count == 1


def test_with_mid_round_admission_a_returning_node_serves_at_once_at_the_version_only():
    v = ClusterView(min_healthy=1, admit_mid_round=True, clock=Clock())
    v.published(3, None)
    v.node_answered("a", answer("e0", version=3))
    v.node_answered("b", answer("e0", version=3))
    v.round_started(5)
    v.node_lost("a", "agent died")
    back = v.node_answered("a", answer("e0", "e1", version=2))  # its daemon missed the publish
    assert back.entered is NodeState.UP and v.nodes["a"].reason == "admitted inside round 5"
    assert v.names() == ["b/e0"]  # up, but nothing of it at another version is routable
    caught_up = v.node_answered("a", answer("e0", "e1", version=3, epoch=2))
    assert caught_up.epoch_moved and v.names() == ["a/e0", "a/e1", "b/e0"]


def test_an_unavailable_node_is_out_at_once_and_rejoins_in_a_gap():
    v = ClusterView(clock=Clock())
    v.node_answered("a", answer("e0"))
    v.round_started(1)
    c = v.node_unavailable("a", "agent restarting")
    assert c.entered is NodeState.UNAVAILABLE and c.epoch_moved and v.names() == []
    assert "a" in v.live()  # still called (once), unlike a LOST node
    assert v.node_answered("a", answer("e0")).entered is NodeState.JOINING
    v.round_ended(1)
    v.recompute()
    assert v.names() == ["a/e0"]


def test_never_an_engine_at_another_version_than_the_clusters():
    v = ClusterView(clock=Clock())
    v.published(3, None)
    v.node_answered("a", {"epoch": 1, "weight_version": 3, "engines": [
        {"name": "e0", "url": "u0", "weight_version": 3}, {"name": "e1", "url": "u1", "weight_version": 2}]})
    assert v.names() == ["a/e0"]


def test_the_floor_is_armed_once_reached_then_breached_and_restored():
    v = ClusterView(min_healthy=2, clock=Clock())
    assert not v.node_answered("a", answer("e0")).breached  # never reached yet: not armed
    v.node_answered("b", answer("e0"))
    c = v.node_lost("b", "gone")
    assert c.breached and v.below_floor and v.floor_breaches == 1
    v.node_answered("b", answer("e0"))  # no round open: admitted now
    assert not v.below_floor


def test_a_watching_client_learns_the_version_a_node_has_from_the_publisher():
    v = ClusterView(clock=Clock())
    v.published(3, "/ckpt/3")
    v.node_answered("a", answer("e0", version=4))
    assert v.weight_version == 4 and v.version_learned and v.checkpoint is None
    assert v.names() == ["a/e0"]
    v.node_answered("b", answer("e0", version=3))  # behind: not routable, the version stays 4
    assert v.weight_version == 4 and v.names() == ["a/e0"]
    v.published(5, "/ckpt/5")
    assert not v.version_learned


# -- announced pushes across nodes ---------------------------------------------------------


def test_a_push_is_split_by_node_and_its_id_names_each_nodes_own():
    assert by_node(["10.0.0.7/e0", "10.0.0.8/e0", "10.0.0.7/e1"]) == {"10.0.0.7": ["e0", "e1"], "10.0.0.8": ["e0"]}
    for bad in (["e0"], ["10.0.0.7/e0", "10.0.0.7/e0"]):
        with pytest.raises(ValueError):
            by_node(bad)
    push = ClusterPush({"10.0.0.8": "beef01-3", "10.0.0.7": "a1b2c3-1"}, {"10.0.0.9/e0": "node lost"})
    assert push == "10.0.0.7=a1b2c3-1,10.0.0.8=beef01-3" and isinstance(push, str)
    assert push_ids(push) == push.nodes == {"10.0.0.7": "a1b2c3-1", "10.0.0.8": "beef01-3"}
    assert push.unannounced == {"10.0.0.9/e0": "node lost"}
    assert push_ids(push_id({"h": "x-1"})) == {"h": "x-1"}
    for bad in ("a1b2c3-1", "", "10.0.0.7=", "=x-1", "h=x-1,h=y-2"):
        with pytest.raises(ValueError, match="not a cluster push id"):
            push_ids(bad)


def test_failed_names_go_each_to_its_node_unqualified():
    mine, elsewhere = split_failed(["A", "B"], {"A/e1": "timed out", "C/e0": "never announced"})
    assert mine == {"A": {"e1": "timed out"}, "B": {}}
    assert elsewhere == {"C/e0": "never announced"}
    with pytest.raises(ValueError):
        split_failed(["A"], {"e1": "bare"})


def test_push_end_answers_merge_qualified_and_a_node_that_did_not_end_it_says_why():
    a = {"push": "x-1", "version": 3, "outcome": "failed", "seconds": 1.5, "late": False, "engines": ["e0", "e1"],
         "failed": {"e1": "timed out"}, "condemned": {}}
    b = {"push": "y-1", "version": 3, "outcome": "failed", "seconds": 2.0, "late": True, "engines": ["e0"],
         "failed": {}, "condemned": {"e0": "paused past the deadline"}}
    gone = ConnectionLost("node C: agent unavailable", code="connection_lost")
    out = merge_push_end("A=x-1,B=y-1,C=z-1", {"A": a, "B": b, "C": gone})
    assert out["push"] == "A=x-1,B=y-1,C=z-1" and out["version"] == 3 and out["outcome"] == "failed"
    assert out["seconds"] == 2.0 and out["late"] is True
    assert out["engines"] == ["A/e0", "A/e1", "B/e0"]
    assert out["failed"] == {"A/e1": "timed out"} and out["condemned"] == {"B/e0": "paused past the deadline"}
    assert out["not_ended"] == {"C": "node C: agent unavailable"}
    assert out["nodes"]["A"]["push"] == "x-1" and out["nodes"]["C"]["code"] == "connection_lost"
    ok = merge_push_end("A=x-1", {"A": {**a, "outcome": "ok", "failed": {}}})
    assert ok["outcome"] == "ok" and ok["not_ended"] == {}


def test_the_nodes_pushes_in_flight_merge_qualified():
    listing = {"A": [{"push": "x-1", "version": 3, "engines": ["e0"], "bytes": 10, "deadline_s": 30.0}],
               "B": [], "C": ConnectionLost("away")}
    assert merge_pushes(listing) == [{"push": "x-1", "version": 3, "engines": ["A/e0"], "bytes": 10,
                                      "deadline_s": 30.0, "node": "A"}]
    ev = qualify_answer("A", {"event": "push_end", "push": "x-1", "failed": {"e1": "why"}, "condemned": {"e0": "paused"}})
    assert ev["failed"] == {"A/e1": "why"} and ev["condemned"] == {"A/e0": "paused"}


def test_the_agent_relays_the_push_verbs_and_the_blocking_client_has_them():
    from vime.cluster import blocking
    from vime.cluster.client import CLUSTER_VERBS, AsyncClusterClient

    assert {"push_begin", "push_end", "pushes"} <= set(VERBS)  # the agent's table
    assert {"push_begin", "push_end", "pushes"} <= set(CLUSTER_VERBS)  # what the blocking client offers
    assert all(callable(getattr(AsyncClusterClient, v, None)) for v in CLUSTER_VERBS)


def test_a_lost_nodes_last_routable_engines_leave_the_router_once():
    """AsyncClusterClient._lost with router_url: the URLs of the node's last routable answer are
    DELETEd from the router (a PROTOCOL STAND-IN for vllm-router's admin API, recording calls;
    the real binary's removal is tested in tests/daemon/test_router_standin.py); the other
    node's never, and a second loss of the same node sends nothing."""
    import asyncio
    from urllib.parse import unquote

    from aiohttp import web

    from vime.cluster.client import AsyncClusterClient

    async def main() -> list[str]:
        deleted: list[str] = []

        async def delete(request: web.Request) -> web.Response:
            deleted.append(unquote(request.match_info["url"]))
            return web.json_response({"status": "ok"})

        app = web.Application()
        app.router.add_delete("/workers/{url:.*}", delete)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        client = AsyncClusterClient(router_url=f"http://127.0.0.1:{port}")
        events: asyncio.Queue = asyncio.Queue()
        client._subs.add(events)
        try:
            for node, ports in (("a", (8000, 8001)), ("b", (9000,))):
                client.view.node_answered(node, {"epoch": 1, "weight_version": 3, "engines": [
                    {"name": f"e{i}", "url": f"http://10.0.0.{ord(node)}:{p}/", "weight_version": 3}
                    for i, p in enumerate(ports)]})
            client._lost("a", "agent gone")
            client._lost("a", "agent gone again")
            await asyncio.gather(*client._tasks)
            got = [events.get_nowait() for _ in range(events.qsize())]
            assert [(e["event"], e.get("action"), e.get("node")) for e in got if e["event"] == "router"] == \
                [("router", "removed", "a")] * 2, got
        finally:
            await client.router.aclose()  # type: ignore[union-attr]
            await runner.cleanup()
        return deleted

    assert asyncio.run(main()) == ["http://10.0.0.97:8000/", "http://10.0.0.97:8001/"]
