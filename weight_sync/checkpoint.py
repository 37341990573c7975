"""Disk path: write a checkpoint vLLM can start on or reload, check it, and reload it into a
running engine through ``/collective_rpc reload_weights``.

`validate_checkpoint` and `reload_from_checkpoint` need neither torch nor vLLM (a supervisor can
call them); `save_checkpoint` needs torch (and transformers for a HF model).

Why validate first: vLLM 0.32 treats a path that does not exist locally as a hub repo id, and a
failed ``reload_weights`` returns 500 with ``/health`` still 200, after which the next generation
kills the engine (the layerwise reload was initialised and never finalised). So everything that
can be checked without touching the engine is checked before it is touched, and any failure of
``reload_weights`` itself raises `PoisonedEngine`.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

from weight_sync._http import HttpFailure, http_json
from weight_sync.errors import CheckpointError, PoisonedEngine, WeightSyncError

# Files a tokenizer may consist of (copied when the tokenizer is given as a directory).
TOKENIZER_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab*",
                      "merges.txt", "spiece.model", "*.tiktoken", "chat_template*",
                      "preprocessor_config.json", "generation_config.json")

# config.json keys that decide the shapes vLLM builds; a mismatch makes a reload fail midway.
SHAPE_KEYS = ("architectures", "model_type", "hidden_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
              "head_dim", "num_experts", "num_local_experts")


def save_checkpoint(model, tokenizer_or_dir, out_dir: str | os.PathLike, *,
                    config: Any = None) -> Path:
    """Write model (safetensors) + config.json + tokenizer files into out_dir, atomically.

    model: a transformers PreTrainedModel (save_pretrained), or any torch.nn.Module together
    with ``config`` (a dict, a config object with to_dict(), or a path to a config.json).
    tokenizer_or_dir: a tokenizer with save_pretrained, a directory to copy tokenizer files
    from (e.g. the base model's), or None. The checkpoint is assembled in a temporary sibling
    directory and renamed into place, so a crash never leaves a half-written out_dir behind;
    an existing out_dir is replaced.
    """
    out = Path(out_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(tmp, safe_serialization=True)
        else:
            if config is None:
                raise ValueError("save_checkpoint: a plain nn.Module needs config=")
            from safetensors.torch import save_model

            save_model(model, str(tmp / "model.safetensors"))
        if config is not None:
            if isinstance(config, (str, os.PathLike)):
                cfg = json.loads(Path(config).read_text())
            elif hasattr(config, "to_dict"):
                cfg = config.to_dict()
            else:
                cfg = dict(config)
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        if tokenizer_or_dir is not None:
            if hasattr(tokenizer_or_dir, "save_pretrained"):
                tokenizer_or_dir.save_pretrained(tmp)
            else:
                src = Path(tokenizer_or_dir)
                if not src.is_dir():
                    raise CheckpointError(f"tokenizer directory {src} does not exist", path=str(src))
                for pattern in TOKENIZER_PATTERNS:
                    for f in src.glob(pattern):
                        if f.is_file() and not (tmp / f.name).exists():
                            shutil.copy2(f, tmp / f.name)
        validate_checkpoint(tmp)
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / out.name)
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _read_safetensors_header(path: Path) -> dict:
    """Parse a .safetensors header and check the file is as long as it says (no torch)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file ({size} bytes)", path=str(path))
        (n,) = struct.unpack("<Q", head)
        if n <= 0 or 8 + n > size or n > 100 << 20:
            raise CheckpointError(f"{path}: corrupt safetensors header (length {n}, file {size} "
                                  f"bytes)", path=str(path))
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{path}: corrupt safetensors header: {e}", path=str(path)) from e
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise CheckpointError(f"{path}: truncated or padded safetensors file: header describes "
                              f"{8 + n + end} bytes, file has {size}", path=str(path))
    return header


def _load_config(ref: Any) -> dict:
    if isinstance(ref, dict):
        return ref
    if hasattr(ref, "to_dict"):
        return ref.to_dict()
    p = Path(ref)
    if p.is_dir():
        p = p / "config.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"reference config {p} unreadable: {e}", path=str(p)) from e


def validate_checkpoint(ckpt_dir: str | os.PathLike, expect_config: Any = None) -> dict:
    """Check that ckpt_dir is a complete checkpoint vLLM can load; return its config.json.

    Raises CheckpointError naming the problem: missing directory, no config.json (or not JSON),
    no *.safetensors, a shard named in model.safetensors.index.json missing, a truncated or
    corrupt safetensors file, or (with expect_config: a dict, a config object, a config.json or
    a model directory) a mismatch in architectures / hidden size / layer count / heads / vocab.
    """
    d = Path(ckpt_dir)
    if not d.exists():
        raise CheckpointError(f"checkpoint directory {d} does not exist", path=str(d))
    if not d.is_dir():
        raise CheckpointError(f"checkpoint path {d} is not a directory", path=str(d))
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"checkpoint {d} has no config.json", path=str(d))
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise CheckpointError(f"checkpoint {d}: config.json is not valid JSON: {e}", path=str(d)) from e
    shards = sorted(d.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"checkpoint {d} has no *.safetensors weight files "
                              f"(found: {sorted(p.name for p in d.iterdir())[:10]})", path=str(d))
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            wanted = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {d}: bad {index.name}: {e}", path=str(d)) from e
        missing = sorted(w for w in wanted if not (d / w).is_file())
        if missing:
            raise CheckpointError(f"checkpoint {d}: shards missing: {missing[:5]}", path=str(d))
    for shard in shards:
        _read_safetensors_header(shard)
    if expect_config is not None:
        _compare_configs(cfg, _load_config(expect_config), d)
    return cfg


def _compare_configs(cfg: dict, ref: dict, d: Path, where: str = "") -> None:
    diffs = []
    for key in SHAPE_KEYS:
        if key in ref and cfg.get(key) != ref[key]:
            diffs.append(f"{where}{key}: checkpoint {cfg.get(key)!r} != served {ref[key]!r}")
    if diffs:
        raise CheckpointError(f"checkpoint {d} does not match the served model: " + "; ".join(diffs),
                              path=str(d))
    for sub in ("text_config", "language_config"):
        if isinstance(ref.get(sub), dict):
            _compare_configs(cfg.get(sub) or {}, ref[sub], d, f"{where}{sub}.")


def reload_from_checkpoint(url: str, ckpt_dir: str | os.PathLike, version: int | str, *,
                           expect_config: Any = None, pause_mode: str | None = "abort",
                           http_timeout: float = 30.0, reload_timeout: float = 600.0) -> dict:
    """Load a checkpoint directory into a running engine and set its weight version.

    validate_checkpoint (CheckpointError; the engine is not touched), POST /pause, POST
    /collective_rpc reload_weights {"weights_path": <absolute dir>}, POST
    /update_weight_version, POST /resume, then GET /weight_info must read str(version).
    A failure of reload_weights raises PoisonedEngine (the engine is left paused: restart it);
    other failures raise WeightSyncError. Returns seconds per step.

    Note (vLLM 0.32): reload_weights re-points the engine's model config at this directory.
    """
    url = url.rstrip("/")
    version = str(version)
    path = Path(ckpt_dir).resolve()  # the engine resolves relative paths against its own cwd
    steps: dict[str, float] = {}

    def call(step: str, method: str, route: str, timeout: float = http_timeout, **kw):
        t0 = time.monotonic()
        try:
            return http_json(url, method, route, timeout=timeout, **kw)
        finally:
            steps[step] = time.monotonic() - t0

    t0 = time.monotonic()
    validate_checkpoint(path, expect_config)
    steps["validate"] = time.monotonic() - t0
    if pause_mode is not None:
        try:
            call("pause", "POST", "/pause", params={"mode": pause_mode},
                 timeout=reload_timeout if pause_mode == "wait" else http_timeout)
        except HttpFailure as e:
            raise WeightSyncError(f"{url}: /pause failed: {e}", url=url, step="pause") from e
    try:
        call("reload_weights", "POST", "/collective_rpc", timeout=reload_timeout + 10, body={
            "method": "reload_weights", "kwargs": {"weights_path": str(path)},
            "timeout": reload_timeout})
    except HttpFailure as e:
        if not e.delivered:
            raise WeightSyncError(f"{url}: engine unreachable: {e}", url=url,
                                  step="reload_weights") from e
        raise PoisonedEngine(url, "reload_weights", e) from e
    try:
        call("update_weight_version", "POST", "/update_weight_version", body={"new_version": version})
        if pause_mode is not None:
            call("resume", "POST", "/resume")
        got = call("weight_info", "GET", "/weight_info")
    except HttpFailure as e:
        raise WeightSyncError(f"{url}: checkpoint loaded but {e}", url=url, step=e.path) from e
    if not isinstance(got, dict) or got.get("weight_version") != version:
        raise WeightSyncError(f"{url}: /weight_info reads {got!r} after reloading version {version!r}",
                              url=url, step="weight_info")
    return steps
