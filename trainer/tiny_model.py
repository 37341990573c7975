"""A tiny Llama with a small BPE tokenizer, built locally: no hub is reachable here.

vLLM's CPU attention needs head_dim >= 64 (16 starts fine and kills the engine at the first
request), hence hidden 128 with 2 heads. Weights are random but seeded, so two builds with the
same seed are byte-identical and tests can compare engines against each other.

    python -m vime.trainer.tiny_model DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# A fixed corpus: the tokenizer must be reproducible and needs nothing from outside.
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a rollout engine serves the policy while the trainer learns",
    "reward rises when the sampled text contains the target token",
    "engines die, engines hang, engines come back with stale weights",
    "one two three four five six seven eight nine ten",
    "hello world, hi there, good morning, good night",
    "red green blue yellow black white orange purple",
    "the supervisor restarts dead engines in the round gap",
] * 8

MARKER = "vime-tiny-model.json"  # written last: a directory with it is a complete build


def build_tiny_model(out_dir: str | Path, *, seed: int = 0, vocab_size: int = 512) -> Path:
    """Write a tiny LlamaForCausalLM (safetensors) and tokenizer into out_dir; return it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out_dir)
    if (out / MARKER).exists():
        return out
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())
    (out / MARKER).write_text(json.dumps({"seed": seed, "parameters": n_params}))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(build_tiny_model(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
