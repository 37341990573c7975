"""The learning half of the example loop: the tiny Llama as a policy, a verifiable reward and
a GRPO-style update (docs/getting-started.md). Nothing here talks to an engine or the daemon, so
a replayed rollout dump trains exactly as the live run did.

    policy = Policy(model_dir)
    stats = policy.train_step(samples)    # scored Samples: reward, group, the engine's logprobs
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from vime.trainer.dumps import Sample, build_training_batch

TARGET = " fox"
PROMPTS = ["the quick brown", "hello world,", "one two three", "red green blue",
           "a rollout engine", "the supervisor restarts", "good morning", "engines die,"]


def reward(text: str, target: str = TARGET) -> float:
    """The verifiable reward: 1.0 if the sampled text contains the target, else 0.0 (a random
    policy finds " fox" in about 3% of 12-token samples; a few dozen steps make it near certain)."""
    return 1.0 if target in text else 0.0


@dataclass
class StepStats:
    version: int           # the policy version this step produced
    loss: float
    reward_mean: float
    samples: int
    tokens: int
    logprob_gap_max: float   # max |engine logprob - trainer logprob| over the sampled tokens
    logprob_gap_mean: float


class Policy:
    """The tiny Llama being trained, its optimizer, and the version it is at.

    `lock` is held around every change of the weights and by the ResyncAgent around every push,
    so a push never reads tensors that are being updated. `version` is the number of steps
    taken; the loop publishes it to the daemon once the engines hold it."""

    def __init__(self, model_dir: str | Path, *, lr: float = 3e-3, seed: int = 0):
        from transformers import AutoTokenizer, LlamaForCausalLM

        torch.manual_seed(seed)
        self.model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        self.model.train()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.version = 0
        self.lock = threading.RLock()

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def digest(self) -> str:
        """sha256 of every parameter's bytes, in name order: equal digests, equal weights."""
        h = hashlib.sha256()
        for name, t in sorted(self.named_tensors()):
            h.update(name.encode())
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def train_step(self, samples: Iterable[Sample]) -> StepStats:
        """One policy-gradient step on scored samples (each with a reward, a group and one
        logprob per output token). Advances `version` by one.

        REINFORCE with a per-prompt group baseline (GRPO without the std division):
        loss = -mean_i(A_i * mean_t log pi(y_it)), A_i = r_i - mean of r over i's group. It is
        on-policy: the engines' logprobs are not in the gradient, they are compared with the
        trainer's own (`logprob_gap_*`), where an engine on other weights shows at once."""
        rows = list(samples)
        batch = build_training_batch(rows, pad_id=self.pad_id)
        ids, attn = batch["input_ids"], batch["attention_mask"]
        mask = batch["loss_mask"][:, 1:].float()
        with self.lock:
            logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            per_sample = (logp * mask).sum(1) / mask.sum(1).clamp(min=1)
            loss = -(batch["advantages"] * per_sample).mean()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.version += 1
        gap = ((logp.detach() - batch["old_logprobs"][:, 1:]).abs() * mask)
        return StepStats(version=self.version, loss=loss.item(), reward_mean=float(batch["rewards"].mean()),
                         samples=len(rows), tokens=int(mask.sum()),
                         logprob_gap_max=float(gap.max()),
                         logprob_gap_mean=float(gap.sum() / mask.sum().clamp(min=1)))
