"""The trainer's side of a version's fingerprint: the logprobs its own weights give for a few
fixed prompts, published with the version so that the daemon checks every engine computes the
same before routing it (supervisor/engine/fingerprint.py; docs/weights.md#fingerprints).

    fp = make_fingerprint(model)                       # a dict, JSON as it is
    client.publish_weights(version, fingerprint=fp)

The same computation as Policy.train_step's logprobs (trainer/rl.py): log_softmax of the
model's logits, gathered at the next token, in fp32.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from vime.supervisor.protocol import FP32_CPU_TOLERANCE

# 4 prompts of 48 token ids drawn once from a fixed seed: 188 teacher-forced logprobs, one
# request. Random ids rather than text: no tokenizer (or its BOS handling) between the trainer
# and the engine, and tokens the training data rarely touches respond to every weight change.
PROMPTS = 4
PROMPT_TOKENS = 48
SEED = 20261206


def fixed_prompts(vocab_size: int, n: int = PROMPTS, length: int = PROMPT_TOKENS,
                  seed: int = SEED) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n, length), generator=g).tolist()


@torch.no_grad()
def prompt_logprobs(model: Any, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
    """logprob of prompts[i][j + 1] given prompts[i][: j + 1], by `model` (a causal LM) in fp32."""
    was_training = model.training
    model.eval()  # no dropout
    try:
        out = []
        for p in prompts:
            ids = torch.tensor([list(p)])
            logits = model(input_ids=ids).logits[0, :-1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            out.append(lp.tolist())
        return out
    finally:
        model.train(was_training)


def make_fingerprint(model: Any, *, tolerance: float = FP32_CPU_TOLERANCE,
                     prompts: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
    """The fingerprint of `model`'s weights now, as publish_weights takes it. `tolerance`:
    measured for fp32 on CPU (the default); for bf16 on GPU see
    docs/weights.md#fingerprints (bf16 drift measured by bench/fingerprint_gpu.py)."""
    ps = [list(p) for p in (prompts if prompts is not None else fixed_prompts(model.config.vocab_size))]
    return {"prompts": ps, "logprobs": prompt_logprobs(model, ps), "tolerance": tolerance}
