"""How far a GPU engine's fingerprint is from the trainer's, and how far one training step moves it.

A version's fingerprint (trainer/fingerprint.py) is the logprob the trainer's fp32 CPU weights
give every token of 4 fixed 48-token prompts, teacher-forced; the daemon compares an engine's
with it within the fingerprint's tolerance (supervisor/engine/fingerprint.py). The check proves
something only while (a) equal weights stay within the tolerance on the engine's hardware and
dtype, and (b) consecutive versions differ by at least 10x the tolerance
(docs/weights.md#fingerprints). This script measures both, with torch + transformers:

(a) drift: the fingerprint computed as the trainer does (fp32, CPU) against the same weights in
    bf16 and in fp32 on `--device`, and in fp32 on CPU with the weights rounded to bf16 (what
    every bf16 engine holds, whatever its kernels) (max, p99 and mean |difference| over the
    compared tokens; whether the top-k token sets at each position agree, and the largest
    difference over the reference's top-k entries);
(b) gap: consecutive versions, one training step apart, the step as trainer/rl.py's
    Policy.train_step takes it (REINFORCE with a group baseline, Adam, its row shape); and
    `stale`: a bf16 engine still at version v against version v+1's fingerprint (what a missed
    push looks like to the check).

Models: the project's tiny Llama (trainer/tiny_model.py; the example loop's lr 3e-3), and a
random-init model of Qwen2-0.5B's shape (made here, no download) at RL-like learning rates and
at the tiny model's relative update, as initialized and with its logits sharpened (final norm
x4) towards a trained model's spread.

    python bench/fingerprint_gpu.py --device cuda --out fp.json
    python bench/fingerprint_gpu.py --device cpu --models tiny --tiny-model DIR   # bf16 on CPU

Caveat: these are Hugging Face transformers' bf16 numerics, not vLLM's kernels. Both are bf16
matmuls with fp32 accumulation, so the figures bound the order of magnitude of a bf16 engine's
drift, not vLLM's exact figure.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from vime.supervisor.protocol import BF16_GPU_TOLERANCE, FP32_CPU_TOLERANCE

TOPK = 5
TINY_LR = 3e-3  # trainer/rl.py's Policy default
# Qwen2-0.5B's shape (config.json of Qwen/Qwen2-0.5B), random weights.
QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
SHARPEN = 4.0
# fp32 compute on weights rounded to bf16, on CPU: the part of a bf16 engine's drift that no
# kernel choice removes (every bf16 engine holds these weights), measurable without a GPU.
ROUNDED = "bf16w-fp32-cpu"
MODELS = ("tiny", "qwen2-0.5b-random", "qwen2-0.5b-random-sharp")
NICE = (1.0, 2.0, 5.0)


def prompts_for(vocab_size: int) -> list[list[int]]:
    from vime.trainer.fingerprint import fixed_prompts

    return fixed_prompts(vocab_size)


@torch.no_grad()
def full_logprobs(model: Any, prompts: Sequence[Sequence[int]], device: str) -> torch.Tensor:
    """[prompt, position, vocab] log_softmax of the model's logits in fp32, on CPU: the same
    computation as trainer/fingerprint.py's prompt_logprobs (one prompt at a time, logits
    upcast before the softmax), on `device` in the model's dtype."""
    model.eval()
    out = []
    for p in prompts:
        ids = torch.tensor([list(p)], device=device)
        logits = model(input_ids=ids).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, dim=-1).cpu())
    return torch.stack(out)


def token_logprobs(full: torch.Tensor, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """[prompt, position]: each prompt token's logprob (after the first), what the fingerprint holds."""
    nxt = torch.tensor([list(p)[1:] for p in prompts])
    return full.gather(-1, nxt[..., None]).squeeze(-1)


def drift(ref: torch.Tensor, got: torch.Tensor, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    d = (token_logprobs(ref, prompts) - token_logprobs(got, prompts)).abs().flatten().double()
    top_ref = ref.topk(TOPK, dim=-1).indices
    top_got = got.topk(TOPK, dim=-1).indices
    same_set = (top_ref.sort(-1).values == top_got.sort(-1).values).all(-1)
    dk = (ref.gather(-1, top_ref) - got.gather(-1, top_ref)).abs()
    return {"max": float(d.max()), "p99": float(d.quantile(0.99)), "mean": float(d.mean()),
            "topk_sets_agree": float(same_set.float().mean()), "topk_max": float(dk.max())}


def gap(a: torch.Tensor, b: torch.Tensor, prompts: Sequence[Sequence[int]]) -> float:
    """What compare() sees between two fingerprints: the largest |difference| over prompt tokens."""
    return float((token_logprobs(a, prompts) - token_logprobs(b, prompts)).abs().max())


def example_rows(vocab_size: int, seed: int) -> list[Any]:
    """One step's scored samples, shaped as the example loop's (tests/unit/test_fingerprint.py):
    two groups of four, 6 sampled tokens each, rewards differing inside each group."""
    from vime.trainer.dumps import Sample

    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(8):
        out = torch.randint(0, vocab_size, (6,), generator=g).tolist()
        rows.append(Sample(prompt=f"p{i // 4}", response="r", prompt_token_ids=[1, 2, 3 + i // 4],
                           output_token_ids=out, logprobs=[-6.0] * 6, reward=float(i % 2), group=f"g{i // 4}"))
    return rows


def rl_step(model: Any, optimizer: Any, rows: Sequence[Any], device: str, pad_id: int = 0) -> float:
    """trainer/rl.py's Policy.train_step, on `device`: the same loss, the same optimizer step."""
    from vime.trainer.dumps import build_training_batch

    batch = build_training_batch(rows, pad_id=pad_id)
    ids, attn = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    mask = batch["loss_mask"][:, 1:].float().to(device)
    model.train()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    per_sample = (logp * mask).sum(1) / mask.sum(1).clamp(min=1)
    loss = -(batch["advantages"].to(device) * per_sample).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def params(model: Any) -> dict[str, torch.Tensor]:
    """A copy of the model's parameters where they are (tied weights once)."""
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def update_stats(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(||after - before|| / ||before||, the share of weights whose bf16 value changed): how big
    the step was, and how much of it a bf16 engine's weights can show."""
    num = den = 0.0
    changed = total = 0
    for k, b in before.items():
        a = after[k]
        num += float((a - b).double().pow(2).sum())
        den += float(b.double().pow(2).sum())
        changed += int((a.bfloat16() != b.bfloat16()).sum())
        total += b.numel()
    return math.sqrt(num / den), changed / total


def nice_ceil(x: float) -> float:
    """The smallest 1, 2 or 5 x 10^k at or above x."""
    if x <= 0:
        return 0.0
    e = math.floor(math.log10(x))
    for m in NICE + (10.0,):
        if m * 10.0 ** e >= x * (1 - 1e-9):
            return float(f"{m * 10.0 ** e:.3g}")
    raise AssertionError(x)


# -- the models ----------------------------------------------------------------------------------


def tiny_model(model_dir: str | None) -> tuple[Callable[[str], Any], str]:
    from transformers import LlamaForCausalLM

    from vime.trainer.tiny_model import build_tiny_model

    d = Path(model_dir or os.environ.get("VIME_TINY_MODEL_CACHE") or Path.cwd() / "tiny-model")
    d = build_tiny_model(d)  # returns at once when d already holds a build
    return (lambda device: LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).to(device)), str(d)


def qwen2_random(layers: int, vocab: int, sharpen: float) -> Callable[[str], Any]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**{**QWEN2_05B, "num_hidden_layers": layers, "vocab_size": vocab})

    def make(device: str) -> Any:
        torch.manual_seed(0)
        with torch.device(device):  # initialized where it trains: a 0.5B init is slow on CPU
            m = Qwen2ForCausalLM(cfg).to(torch.float32)
        if sharpen != 1.0:
            with torch.no_grad():
                m.model.norm.weight.mul_(sharpen)
        return m
    return make


# -- one model's measurement --------------------------------------------------------------------


def measure(name: str, make: Callable[[str], Any], device: str, lrs: Sequence[float], steps: int,
            log: Callable[[str], None]) -> dict[str, Any]:
    t0 = time.monotonic()
    train_model = make(device)  # fp32 on the device: trains, and is the fp32 target there
    ref_model = copy.deepcopy(train_model).to("cpu")  # the trainer's side: fp32 on CPU
    bf16_model = copy.deepcopy(train_model).to(torch.bfloat16)
    vocab = ref_model.config.vocab_size
    prompts = prompts_for(vocab)
    base = params(train_model)
    n_params = sum(v.numel() for v in base.values())
    rounded_model = copy.deepcopy(ref_model)  # fp32 on CPU, its weights rounded to bf16
    bf16 = f"bf16-{device}"
    targets: dict[str, tuple[Any, str]] = {bf16: (bf16_model, device)}
    if device != "cpu":
        targets[f"fp32-{device}"] = (train_model, device)
    targets[ROUNDED] = (rounded_model, "cpu")

    def fingerprints() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Each side's logprobs for the weights train_model holds now."""
        state = train_model.state_dict()
        ref_model.load_state_dict(state)
        bf16_model.load_state_dict(state)  # cast on copy, as an engine casts what it is sent
        rounded_model.load_state_dict(state)
        with torch.no_grad():
            for p in rounded_model.parameters():
                p.copy_(p.bfloat16().float())
        ref = full_logprobs(ref_model, prompts, "cpu")
        return ref, {t: full_logprobs(m, prompts, dev) for t, (m, dev) in targets.items()}

    ref0, got0 = fingerprints()
    entropy = float(ref0.exp().mul(ref0).sum(-1).neg().mean())  # mean entropy, nats
    drifts: list[dict[str, Any]] = [{"version": "v0", "target": t, **drift(ref0, g, prompts)} for t, g in got0.items()]
    log(f"{name}: {n_params / 1e6:.1f}M parameters, fingerprint entropy {entropy:.2f} nats "
        f"(uniform {math.log(vocab):.2f}), v0 drift " +
        ", ".join(f"{d['target']} {d['max']:.3g}" for d in drifts) + f" [{time.monotonic() - t0:.0f} s]")
    runs = []
    for lr in lrs:
        with torch.no_grad():
            for k, p in train_model.named_parameters():
                p.copy_(base[k])
        opt = torch.optim.Adam(train_model.parameters(), lr=lr)
        prev_ref, prev_got, prev = ref0, got0, base
        for step in range(1, steps + 1):
            loss = rl_step(train_model, opt, example_rows(vocab, seed=step), device)
            now = params(train_model)
            rel, bf16_changed = update_stats(prev, now)
            ref, got = fingerprints()
            row = {"lr": lr, "step": step, "loss": loss, "relative_update": rel, "bf16_weights_changed": bf16_changed,
                   "gap": gap(prev_ref, ref, prompts),
                   # a bf16 engine that missed this step's push, against this step's fingerprint
                   "stale_bf16": gap(ref, prev_got[bf16], prompts),
                   # how far a bf16 engine's own fingerprint moves with the step
                   "bf16_self_gap": gap(prev_got[bf16], got[bf16], prompts)}
            new = [{"version": f"lr={lr:g} step {step}", "target": t, **drift(ref, g, prompts)} for t, g in got.items()]
            drifts += new
            runs.append(row)
            log(f"  lr {lr:g} step {step}: relative update {rel:.2e}, bf16 weights changed {bf16_changed:.1%}, "
                f"gap {row['gap']:.3g}, stale bf16 {row['stale_bf16']:.3g}, bf16 self gap {row['bf16_self_gap']:.3g}, "
                f"drift " + ", ".join(f"{d['target']} {d['max']:.3g}" for d in new) + f" [{time.monotonic() - t0:.0f} s]")
            prev_ref, prev_got, prev = ref, got, now
    worst = {t: {k: max(d[k] for d in drifts if d["target"] == t) for k in ("max", "p99", "mean", "topk_max")}
             | {"topk_sets_agree_min": min(d["topk_sets_agree"] for d in drifts if d["target"] == t)}
             for t in targets}
    bf16_worst = worst[bf16]["max"]
    recommended = nice_ceil(3 * bf16_worst)
    for row in runs:
        row["gap_over_bf16_drift"] = row["gap"] / bf16_worst if bf16_worst else math.inf
        row["verifiable_at_recommended"] = row["gap"] >= 10 * recommended and row["stale_bf16"] > recommended
    attn = getattr(ref_model.config, "_attn_implementation", None)
    return {"model": name, "parameters": n_params, "vocab_size": vocab, "mean_entropy_nats": entropy,
            "compared_tokens": len(prompts) * (len(prompts[0]) - 1), "drift_worst": worst, "drift": drifts,
            "steps": runs, "bf16_tolerance_recommended": recommended,
            "within": {t: {"FP32_CPU_TOLERANCE": w["max"] <= FP32_CPU_TOLERANCE,
                           "BF16_GPU_TOLERANCE": w["max"] <= BF16_GPU_TOLERANCE} for t, w in worst.items()},
            "attn_implementation": attn, "seconds": time.monotonic() - t0}


def table(results: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'model':<24} {'target':<14} {'max':>9} {'p99':>9} {'mean':>9} {'top-k max':>9} {'sets agree':>10}"]
    for r in results:
        for t, w in r["drift_worst"].items():
            lines.append(f"{r['model']:<24} {t:<14} {w['max']:>9.3g} {w['p99']:>9.3g} {w['mean']:>9.3g} "
                         f"{w['topk_max']:>9.3g} {w['topk_sets_agree_min']:>10.1%}")
    lines += ["", f"{'model':<24} {'lr':>7} {'step':>4} {'rel.upd':>8} {'bf16 chg':>8} {'gap':>9} {'stale bf16':>10} "
              f"{'bf16 self':>9} {'gap/drift':>9} {'tol':>6} {'10x ok':>6}"]
    for r in results:
        for s in r["steps"]:
            lines.append(f"{r['model']:<24} {s['lr']:>7.0e} {s['step']:>4} {s['relative_update']:>8.1e} "
                         f"{s['bf16_weights_changed']:>8.1%} {s['gap']:>9.3g} {s['stale_bf16']:>10.3g} "
                         f"{s['bf16_self_gap']:>9.3g} {s['gap_over_bf16_drift']:>9.3g} {r['bf16_tolerance_recommended']:>6g} "
                         f"{'yes' if s['verifiable_at_recommended'] else 'NO':>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="where the engine-side runs: cuda or cpu (default cuda)")
    ap.add_argument("--models", default="tiny,qwen2-0.5b-random,qwen2-0.5b-random-sharp",
                    help="comma list of tiny, qwen2-0.5b-random, qwen2-0.5b-random-sharp")
    ap.add_argument("--tiny-model", default=None, help="the tiny model's folder (default $VIME_TINY_MODEL_CACHE, "
                    "else built into ./tiny-model)")
    ap.add_argument("--lrs", default="1e-6,1e-5,1e-4,3e-3", help="learning rates for the random model (default "
                    "1e-6,1e-5,1e-4,3e-3: RL-like, and the tiny model's relative update); the tiny model uses 3e-3")
    ap.add_argument("--steps", type=int, default=2, help="training steps per learning rate (default 2)")
    ap.add_argument("--large-layers", type=int, default=QWEN2_05B["num_hidden_layers"],
                    help="layers of the random model (default 24: Qwen2-0.5B; fewer for a smoke run)")
    ap.add_argument("--large-vocab", type=int, default=QWEN2_05B["vocab_size"],
                    help="vocabulary of the random model (default 151936; smaller for a smoke run)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        ap.error(f"--models: unknown model(s) {unknown} (choose from {', '.join(MODELS)})")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no GPU; use --device cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (torch's default, said)
    torch.backends.cudnn.allow_tf32 = False

    def log(s: str) -> None:
        print(s, flush=True)

    import transformers

    transformers.utils.logging.disable_progress_bar()
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu",
           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    log(f"fingerprint drift: {env}")
    lrs = [float(x) for x in args.lrs.split(",")]
    results: list[dict[str, Any]] = []
    doc = {"env": env, "argv": sys.argv[1:] if argv is None else argv, "topk": TOPK, "results": results,
           "tolerances": {"FP32_CPU_TOLERANCE": FP32_CPU_TOLERANCE, "BF16_GPU_TOLERANCE": BF16_GPU_TOLERANCE},
           "caveat": "Hugging Face transformers bf16 numerics, not vLLM's kernels: both are bf16 matmuls with "
                     "fp32 accumulation, so this bounds the order of magnitude, not vLLM's exact figure"}
    for name in names:
        if name == "tiny":
            make, where = tiny_model(args.tiny_model)
            results.append(measure(name, make, args.device, [TINY_LR], args.steps, log) | {"source": where})
        else:
            sharpen = SHARPEN if name.endswith("sharp") else 1.0
            make = qwen2_random(args.large_layers, args.large_vocab, sharpen)
            results.append(measure(name, make, args.device, lrs, args.steps, log)
                           | {"source": f"random init, {args.large_layers} layers, vocab {args.large_vocab}, "
                                        f"final norm x{sharpen:g}"})
        if args.device == "cuda":
            torch.cuda.empty_cache()
        if args.out:  # after each model: a run cut short still leaves what it measured
            Path(args.out).write_text(json.dumps(doc, indent=1))
    log("")
    log(table(results))
    return doc


if __name__ == "__main__":
    main()
