"""bench/fingerprint_gpu.py, its CPU form on the tiny model: it computes the fingerprint and the
training step exactly as the trainer does, and measures bf16 drift and the version gap (on CPU
here; the GPU figures in docs/weights.md#fingerprints come from its --device cuda form)."""

from __future__ import annotations

import json
import math

import pytest

from support.bench_scripts import load_bench



@pytest.fixture(scope="module")
def bench():
    return load_bench("fingerprint_gpu")


def test_it_computes_the_fingerprint_and_the_step_as_the_trainer_does(bench, tiny_model):
    import torch
    from transformers import LlamaForCausalLM

    from vime.trainer.fingerprint import fixed_prompts, prompt_logprobs
    from vime.trainer.rl import Policy

    policy = Policy(tiny_model)
    prompts = fixed_prompts(policy.model.config.vocab_size)
    ours = bench.token_logprobs(bench.full_logprobs(policy.model, prompts, "cpu"), prompts)
    assert ours.tolist() == prompt_logprobs(policy.model, prompts)

    model = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rows = bench.example_rows(model.config.vocab_size, seed=1)
    bench.rl_step(model, torch.optim.Adam(model.parameters(), lr=bench.TINY_LR), rows, "cpu")
    before = dict(Policy(tiny_model).model.named_parameters())
    policy.train_step(rows)
    theirs, mine = dict(policy.model.named_parameters()), dict(model.named_parameters())
    moved = max(float((theirs[k] - before[k]).detach().abs().max()) for k in theirs)
    differ = max(float((theirs[k] - mine[k]).detach().abs().max()) for k in theirs)
    assert moved > 1e-3 and differ < 1e-6, (moved, differ)


def test_cpu_run_reports_bf16_drift_and_the_version_gap(bench, tiny_model, tmp_path, capsys):
    out = tmp_path / "fp.json"
    doc = bench.main(["--device", "cpu", "--models", "tiny", "--tiny-model", str(tiny_model), "--steps", "1",
                      "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    (r,) = doc["results"]
    assert set(r["drift_worst"]) == {"bf16-cpu", bench.ROUNDED}  # fp32 on CPU is the reference itself
    w = r["drift_worst"]["bf16-cpu"]
    assert 0 < r["drift_worst"][bench.ROUNDED]["max"] < 0.1  # rounding the weights alone moves it
    # bf16 rounds the weights: the fingerprint moves, by far less than a step moves it
    assert 1e-4 < w["mean"] <= w["p99"] <= w["max"] < 0.1 and 0 < w["topk_sets_agree_min"] <= 1
    (step,) = r["steps"]
    assert step["lr"] == bench.TINY_LR and step["gap"] > 10 * w["max"]
    assert step["gap_over_bf16_drift"] == pytest.approx(step["gap"] / w["max"])
    assert r["bf16_tolerance_recommended"] >= 3 * w["max"] and step["verifiable_at_recommended"] is True
    assert r["within"]["bf16-cpu"] == {"FP32_CPU_TOLERANCE": False, "BF16_GPU_TOLERANCE": True}
    assert "not vLLM's kernels" in doc["caveat"]
    printed = capsys.readouterr().out
    assert "bf16-cpu" in printed and "gap/drift" in printed


@pytest.mark.parametrize("x, want", [(0.0012, 0.002), (0.002, 0.002), (0.021, 0.05), (0.3, 0.5), (0.6, 1.0)])
def test_recommended_tolerance_rounds_up_to_1_2_5(bench, x, want):
    assert math.isclose(bench.nice_ceil(x), want)


def test_unknown_model_is_refused_before_any_work(bench):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--models", "tiny,llama-70b"])
