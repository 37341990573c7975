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
import stat
import struct
import tempfile
import time
from pathlib import Path
from collections.abc import Generator
from typing import Any, NamedTuple

from vime.weight_sync.engine_http import HttpFailure, decode_body, http_json
from vime.weight_sync.errors import CheckpointError, PoisonedEngine, WeightSyncError

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


# Bounds on what the validator reads: a checkpoint path comes from the trainer and is untrusted.
MAX_JSON_BYTES = 64 << 20  # config.json, model.safetensors.index.json
MAX_HEADER_BYTES = 100 << 20  # a safetensors header


def _open_regular(path: Path) -> tuple[int, os.stat_result]:
    """Open a file the checkpoint names, refusing anything but a regular file: opening a FIFO
    blocks until a writer comes, a device may never answer. O_NONBLOCK makes even the open of
    a FIFO swapped in after the check return at once; fstat then refuses it."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: not a regular file ({_kind(st.st_mode)}); a checkpoint holds "
                              "regular files only", path=str(path))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: not a regular file ({_kind(st.st_mode)}); a checkpoint holds "
                                  "regular files only", path=str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a plain file"


def _read_exact(fd: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, min(n - len(out), 1 << 20))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _read_json(path: Path, what: str, d: Path) -> Any:
    fd, st = _open_regular(path)
    try:
        if st.st_size > MAX_JSON_BYTES:
            raise CheckpointError(f"checkpoint {d}: {what} is {st.st_size} bytes (at most {MAX_JSON_BYTES})",
                                  path=str(d))
        raw = _read_exact(fd, MAX_JSON_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"checkpoint {d}: {what} is not valid JSON: {e}", path=str(d)) from None


def _read_safetensors_header(path: Path) -> dict:
    """Parse a .safetensors header and check the file is as long as it says (no torch)."""
    fd, st = _open_regular(path)
    size = st.st_size
    try:
        head = _read_exact(fd, 8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file ({size} bytes)", path=str(path))
        (n,) = struct.unpack("<Q", head)
        if n <= 0 or 8 + n > size or n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: corrupt safetensors header (length {n}, file {size} "
                                  f"bytes)", path=str(path))
        try:
            header = json.loads(_read_exact(fd, n))
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header: {e}", path=str(path)) from e
    finally:
        os.close(fd)
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: a JSON {type(header).__name__}, not an "
                              "object of tensors", path=str(path))
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{path}: corrupt safetensors header: tensor {name[:200]!r} has no valid "
                                  "data_offsets [begin, end]", path=str(path))
        end = max(end, offsets[1])
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
    try:
        if p.is_dir():
            p = p / "config.json"
        cfg = _read_json(p, "config.json", p.parent)
    except (OSError, CheckpointError) as e:
        raise CheckpointError(f"reference config {p} unreadable: {e}", path=str(p)) from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"reference config {p} is not a JSON object", path=str(p))
    return cfg


def validate_checkpoint(ckpt_dir: str | os.PathLike, expect_config: Any = None) -> dict:
    """Check that ckpt_dir is a complete checkpoint vLLM can load; return its config.json.

    Raises CheckpointError naming the problem: missing directory, no config.json (or not JSON),
    no *.safetensors, a shard named in model.safetensors.index.json missing, a truncated or
    corrupt safetensors file, or (with expect_config: a dict, a config object, a config.json or
    a model directory) a mismatch in architectures / hidden size / layer count / heads / vocab.
    The path is untrusted: only regular files are opened (never a FIFO or a device), reads are
    bounded, and an OSError (a name too long, no permission) is a CheckpointError too.
    """
    d = Path(ckpt_dir)
    try:
        return _validate(d, expect_config)
    except OSError as e:
        what = e.strerror or type(e).__name__
        raise CheckpointError(f"checkpoint {str(d)[:300]}: {what}"
                              + (f" ({str(e.filename)[:300]})" if e.filename and str(e.filename) != str(d) else ""),
                              path=str(d)) from None


def _validate(d: Path, expect_config: Any) -> dict:
    try:
        st = os.stat(d)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint directory {d} does not exist", path=str(d)) from None
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"checkpoint path {d} is not a directory", path=str(d))
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"checkpoint {d} has no config.json", path=str(d))
    if cfg_path.is_dir():
        raise CheckpointError(f"checkpoint {d} has no config.json (it is a directory)", path=str(d))
    cfg = _read_json(cfg_path, "config.json", d)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"checkpoint {d}: config.json is a JSON {type(cfg).__name__}, not an object",
                              path=str(d))
    shards = sorted(d.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"checkpoint {d} has no *.safetensors weight files "
                              f"(found: {sorted(p.name for p in d.iterdir())[:10]})", path=str(d))
    index = d / "model.safetensors.index.json"
    if index.exists():
        doc = _read_json(index, index.name, d)
        wmap = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wmap, dict) or not all(
                isinstance(w, str) and w and "/" not in w and w not in (".", "..") for w in wmap.values()):
            raise CheckpointError(f"checkpoint {d}: bad {index.name}: needs a \"weight_map\" object of "
                                  "tensor name -> shard file name in this directory", path=str(d))
        wanted = set(wmap.values())
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
            sub_cfg = cfg.get(sub)
            _compare_configs(sub_cfg if isinstance(sub_cfg, dict) else {}, ref[sub], d, f"{where}{sub}.")


class _Request(NamedTuple):
    step: str
    method: str
    route: str
    timeout: float
    body: Any = None
    params: dict | None = None


def _reload_plan(url: str, path: Path, version: str, pause_mode: str | None, http_timeout: float,
                 reload_timeout: float) -> Generator[_Request, Any, None]:
    """A reload's calls, in order, and what each failure means: yields each request, is sent its
    answer or thrown its HttpFailure. The one implementation of the reload; the sync and the
    async function below only carry its calls (urllib in a thread, aiohttp on a loop)."""
    if pause_mode is not None:
        try:
            yield _Request("pause", "POST", "/pause", reload_timeout if pause_mode == "wait" else http_timeout,
                           params={"mode": pause_mode})
        except HttpFailure as e:
            raise WeightSyncError(f"{url}: /pause failed: {e}", url=url, step="pause") from e
    try:
        yield _Request("reload_weights", "POST", "/collective_rpc", reload_timeout + 10, body={
            "method": "reload_weights", "kwargs": {"weights_path": str(path)}, "timeout": reload_timeout})
    except HttpFailure as e:
        raise _reload_failed(url, e) from e
    try:
        yield _Request("update_weight_version", "POST", "/update_weight_version", http_timeout,
                       body={"new_version": version})
        if pause_mode is not None:
            yield _Request("resume", "POST", "/resume", http_timeout)
        got = yield _Request("weight_info", "GET", "/weight_info", http_timeout)
    except HttpFailure as e:
        raise WeightSyncError(f"{url}: checkpoint loaded but {e}", url=url, step=e.path) from e
    _check_reloaded(url, got, version)


def _next(plan: Generator[_Request, Any, None], answer: Any, error: HttpFailure | None) -> _Request | None:
    """The plan's next request after `answer` (or `error`); None when it is done."""
    try:
        return plan.throw(error) if error is not None else plan.send(answer)
    except StopIteration:
        return None


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
    path = Path(ckpt_dir).resolve()  # the engine resolves relative paths against its own cwd
    t0 = time.monotonic()
    validate_checkpoint(path, expect_config)
    steps: dict[str, float] = {"validate": time.monotonic() - t0}
    plan = _reload_plan(url, path, str(version), pause_mode, http_timeout, reload_timeout)
    answer: Any = None
    error: HttpFailure | None = None
    while (req := _next(plan, answer, error)) is not None:
        answer, error, t0 = None, None, time.monotonic()
        try:
            answer = http_json(url, req.method, req.route, body=req.body, params=req.params, timeout=req.timeout)
        except HttpFailure as e:
            error = e
        steps[req.step] = time.monotonic() - t0
    return steps


def _reload_failed(url: str, e: HttpFailure) -> WeightSyncError:
    """reload_weights failed: poisoned if the request reached the engine (it may have loaded
    half), else only unreachable."""
    if not e.delivered:
        return WeightSyncError(f"{url}: engine unreachable: {e}", url=url, step="reload_weights")
    return PoisonedEngine(url, "reload_weights", e)


def _check_reloaded(url: str, got: Any, version: str) -> None:
    if not isinstance(got, dict) or got.get("weight_version") != version:
        raise WeightSyncError(f"{url}: /weight_info reads {got!r} after reloading version {version!r}",
                              url=url, step="weight_info")


async def reload_from_checkpoint_async(session, url: str, ckpt_dir: str | os.PathLike, version: int | str, *,
                                       pause_mode: str | None = "abort", http_timeout: float = 30.0,
                                       reload_timeout: float = 600.0) -> dict:
    """reload_from_checkpoint over an aiohttp session, for callers on an event loop (the
    daemon): no thread per engine, so a caller's timeout covers only the engine's work, never
    a wait for a free thread. The checkpoint is not validated here: validate it first (off the
    loop; see vime.supervisor.fleet). Same steps, same errors: PoisonedEngine for reload_weights."""
    import asyncio

    import aiohttp

    url = url.rstrip("/")
    steps: dict[str, float] = {}

    async def call(req: _Request) -> Any:
        try:
            async with session.request(req.method, url + req.route, json=req.body, params=req.params,
                                       timeout=aiohttp.ClientTimeout(total=req.timeout)) as resp:
                raw = await resp.read()
        except aiohttp.ClientConnectorError as e:  # never reached the engine
            raise HttpFailure(req.method, req.route, cause=e, delivered=False) from None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise HttpFailure(req.method, req.route,
                              cause=e if str(e) else TimeoutError(f"no answer within {req.timeout:g}s")) from None
        if resp.status >= 400:
            raise HttpFailure(req.method, req.route, status=resp.status, body=raw.decode("utf-8", "replace"))
        return decode_body(raw)

    plan = _reload_plan(url, Path(ckpt_dir).resolve(), str(version), pause_mode, http_timeout, reload_timeout)
    answer: Any = None
    error: HttpFailure | None = None
    while (req := _next(plan, answer, error)) is not None:
        answer, error, t0 = None, None, time.monotonic()
        try:
            answer = await call(req)
        except HttpFailure as e:
            error = e
        steps[req.step] = time.monotonic() - t0
    return steps
