"""Debug rollout dumps (slime's `--save-debug-rollout-data` convention) and the training batch
built from them: `save_rollout`, `load_rollout`, `build_training_batch`.

A replayed dump gives the same batch, tensor for tensor. The file format, what `load_rollout`
rejects, and the batch's tensors are in docs/rollout.md (Debug rollout dumps).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import string
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

__all__ = [
    "FORMAT", "FORMAT_VERSION", "READABLE_VERSIONS", "DumpFormatError", "Sample", "RolloutDump",
    "dump_path", "template_error", "save_rollout", "load_rollout", "read_header", "build_training_batch",
    "batch_differences",
]

FORMAT = "vime-rollout-dump"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 2 added the samples' splits and started_over (optional on load)
_HEADER_KEYS = ("format", "version", "rollout_id", "weight_version", "created", "num_samples")
TIMING_KEYS = ("sent", "attempt_sent", "first_token", "finished")


class DumpFormatError(ValueError):
    """The file is not a readable rollout dump of this version; the message says where and why."""


def _ints(name: str, xs: Any) -> list[int]:
    if isinstance(xs, (str, bytes)) or not isinstance(xs, Iterable):
        raise TypeError(f"{name} must be a list of ints, got {type(xs).__name__}")
    out = []
    for x in xs:
        if isinstance(x, bool) or not isinstance(x, int):
            # numpy / torch integer scalars are fine, anything else is not a token id
            if hasattr(x, "__index__") and not isinstance(x, float):
                x = x.__index__()
            else:
                raise TypeError(f"{name} must hold ints, got {x!r}")
        out.append(int(x))
    return out


def _record(name: str, x: Any, required: tuple[str, ...]) -> dict[str, Any]:
    """A split / start-over record as a plain dict (from a NamedTuple of vime.trainer.rollout or
    a mapping), with its required keys."""
    d = x._asdict() if hasattr(x, "_asdict") else x
    if not isinstance(d, Mapping):
        raise TypeError(f"{name} must hold objects, got {x!r}")
    missing = [k for k in required if k not in d]
    if missing:
        raise ValueError(f"{name} entry {dict(d)!r} lacks {missing}")
    return {str(k): v for k, v in d.items()}


def first_field(obj: Any, *names: str, default: Any = None) -> Any:
    """The first of `names` present on a mapping or an object (duck typing, so RolloutResult
    or a plain dict both work)."""
    for n in names:
        if isinstance(obj, Mapping):
            if n in obj and obj[n] is not None:
                return obj[n]
        else:
            v = getattr(obj, n, None)
            if v is not None:
                return v
    return default


@dataclass
class Sample:
    """One rollout sample: the prompt, what an engine answered, and how it scored."""

    prompt: str
    response: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    logprobs: list[float] | None = None  # one per output token
    reward: float | None = None
    engine: str | None = None
    finish_reason: str | None = None
    attempts: int = 1
    timings: dict[str, float] = field(default_factory=dict)  # sent/attempt_sent/first_token/finished (epoch s)
    weight_version: int | str | None = None
    group: str | None = None  # GRPO group key; None: the prompt
    metadata: dict[str, Any] = field(default_factory=dict)
    splits: list[dict[str, Any]] = field(default_factory=list)        # RolloutResult.splits
    started_over: list[dict[str, Any]] = field(default_factory=list)  # RolloutResult.started_over

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str) or not isinstance(self.response, str):
            raise TypeError("prompt and response must be str")
        self.prompt_token_ids = _ints("prompt_token_ids", self.prompt_token_ids)
        self.output_token_ids = _ints("output_token_ids", self.output_token_ids)
        if self.logprobs is not None:
            self.logprobs = [float(x) for x in self.logprobs]
        if self.reward is not None:
            self.reward = float(self.reward)
        self.attempts = int(self.attempts)
        self.timings = {str(k): (None if v is None else float(v)) for k, v in dict(self.timings or {}).items()}
        self.metadata = dict(self.metadata or {})
        self.splits = [_record("splits", x, ("engine", "offset", "tokens")) for x in self.splits or ()]
        self.started_over = [_record("started_over", x, ("tokens", "reason")) for x in self.started_over or ()]

    def token_versions(self) -> list[Any]:
        """The weight version that made each output token, from the pieces (`splits`: each
        piece's version, the oldest its tokens may come from where the engine's reads did not
        bracket it exactly); the sample's weight_version for all of them when it has none."""
        if not self.splits:
            return [self.weight_version] * len(self.output_token_ids)
        out: list[Any] = [self.weight_version] * len(self.output_token_ids)
        for piece in self.splits:
            start, n = int(piece["offset"]), int(piece["tokens"])
            out[start:start + n] = [piece.get("weight_version")] * len(out[start:start + n])
        return out

    @property
    def group_key(self) -> str:
        return self.prompt if self.group is None else self.group

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Sample":
        if not isinstance(d, Mapping):
            raise TypeError(f"a sample must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown sample field(s) {unknown}; known: {sorted(names)} "
                             f"(put extra data in 'metadata')")
        missing = [n for n in ("prompt", "response", "prompt_token_ids", "output_token_ids") if n not in d]
        if missing:
            raise ValueError(f"sample lacks required field(s) {missing}")
        return cls(**dict(d))

    @classmethod
    def from_rollout(cls, result: Any, *, prompt: str, prompt_token_ids: Iterable[int] | None = None,
                     reward: float | None = None, weight_version: int | str | None = None,
                     group: str | None = None, **metadata: Any) -> "Sample":
        """A Sample from a rollout client's result: vime.trainer.rollout.RolloutResult, or any object
        or dict with text, token_ids, logprobs, finish_reason, engine, attempts (an int or a
        list) and the times sent/attempt_sent/first_token/finished, either in a `timings`
        mapping/object or as top-level fields, and, when it has them, splits and started_over
        (a continued request's pieces). prompt_token_ids and weight_version default to the
        result's own; its request_id goes into metadata."""
        timings_src = first_field(result, "timings", default=result)
        timings = {k: first_field(timings_src, k) for k in TIMING_KEYS}
        timings = {k: v for k, v in timings.items() if v is not None}
        attempts = first_field(result, "attempts", default=1)
        if not isinstance(attempts, int):  # a list of attempt records
            attempts = len(attempts)
        ptids = prompt_token_ids if prompt_token_ids is not None else first_field(result, "prompt_token_ids")
        if ptids is None:
            raise ValueError("prompt_token_ids: the result has none; pass prompt_token_ids=")
        if weight_version is None:
            weight_version = first_field(result, "weight_version")
        request_id = first_field(result, "request_id")
        if request_id is not None:
            metadata.setdefault("request_id", request_id)
        return cls(splits=list(first_field(result, "splits", default=())),
                   started_over=list(first_field(result, "started_over", default=())),
                   prompt=prompt, response=first_field(result, "text", "response", default=""),
                   prompt_token_ids=list(ptids),
                   output_token_ids=list(first_field(result, "token_ids", "output_token_ids", default=[])),
                   logprobs=first_field(result, "logprobs"), reward=reward, engine=first_field(result, "engine"),
                   finish_reason=first_field(result, "finish_reason"), attempts=attempts, timings=timings,
                   weight_version=weight_version, group=group, metadata=metadata)


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


@dataclass
class RolloutDump:
    """A loaded dump: header fields and the samples (iterating it iterates the samples)."""

    path: Path
    rollout_id: Any
    weight_version: Any
    created: float
    meta: dict[str, Any]
    samples: list[Sample]
    version: int = FORMAT_VERSION

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)


def template_error(path_template: str | os.PathLike[str], *, saving: bool = True) -> str | None:
    """Pure: why `path_template` cannot name one dump per round (None: it can). It must hold
    `{rollout_id}` and no other placeholder; `saving` words what a template without it does."""
    tmpl = os.fspath(path_template)
    if "{rollout_id}" not in tmpl and "{rollout_id:" not in tmpl:
        why = "or every round overwrites the last" if saving else "each round reads its own dump"
        return (f"dump path template {tmpl!r} must contain {{rollout_id}} "
                f"(e.g. 'dumps/rollout_{{rollout_id}}.jsonl'), {why}")
    try:
        tmpl.format(rollout_id=1)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError) as e:
        try:
            others = [f"{{{name}}}" for _, name, _, _ in string.Formatter().parse(tmpl)
                      if name is not None and name != "rollout_id"]
        except ValueError:
            others = []
        found = f"not {', '.join(others)}" if others else f"{str(e).rstrip('.')}"
        return (f"dump path template {tmpl!r}: only {{rollout_id}} may be used ({found}); "
                f"write a literal brace as '{{{{' or '}}}}'")
    return None


def dump_path(path_template: str | os.PathLike[str], rollout_id: Any) -> Path:
    """The template with `{rollout_id}` filled in. ValueError (template_error's sentence) if it
    has no `{rollout_id}` (every round would overwrite the last) or other placeholders."""
    if why := template_error(path_template):
        raise ValueError(why)
    return Path(os.fspath(path_template).format(rollout_id=rollout_id))


def _json_line(obj: Any) -> str:
    # Non-ASCII text stays readable (grep finds it); a line with a lone surrogate (not encodable
    # as UTF-8) falls back to \\u escapes, which read back to the same str.
    line = json.dumps(obj, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(obj, ensure_ascii=True)
    return line


def save_rollout(path_template: str | os.PathLike[str], rollout_id: Any, samples: Iterable[Sample | Mapping],
                 *, weight_version: int | str | None = None, **meta: Any) -> Path:
    """Write one round's samples to `path_template.format(rollout_id=rollout_id)` (parent folders
    created, the file replaced atomically); return the path. `meta` goes to the header's "meta"
    and must be JSON-serialisable."""
    path = dump_path(path_template, rollout_id)
    rows = [s if isinstance(s, Sample) else Sample.from_dict(s) for s in samples]
    now = time.time()
    header = {"format": FORMAT, "version": FORMAT_VERSION, "rollout_id": rollout_id,
              "weight_version": weight_version, "created": now,
              "created_iso": datetime.fromtimestamp(now, timezone.utc).isoformat(),
              "num_samples": len(rows), "meta": _plain(meta)}
    lines = [_json_line(header)] + [_json_line(s.to_dict()) for s in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write("\n".join(lines) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def _decoded(p: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DumpFormatError(f"{p}: not UTF-8 text at byte {e.start}: not a rollout dump") from None


def _empty(p: Path) -> DumpFormatError:
    return DumpFormatError(f"{p}: empty file: no header line (a truncated or unfinished dump)")


def _header(p: Path, line: str) -> dict[str, Any]:
    """The header line's checks, load_rollout's and read_header's."""
    try:
        header = json.loads(line)
    except ValueError as e:
        raise DumpFormatError(f"{p}:1: the header line is not JSON ({e}): not a {FORMAT} file, "
                              f"or a truncated one") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        got = header.get("format") if isinstance(header, dict) else type(header).__name__
        raise DumpFormatError(f"{p}:1: not a rollout dump: the header's format is {got!r}, "
                              f"expected {FORMAT!r}")
    if header.get("version") not in READABLE_VERSIONS:
        raise DumpFormatError(f"{p}:1: dump format version {header.get('version')!r} is not supported "
                              f"(this code reads versions {', '.join(map(str, READABLE_VERSIONS))}); load it "
                              f"with the code that wrote it, or convert it")
    missing = [k for k in _HEADER_KEYS if k not in header]
    if missing:
        raise DumpFormatError(f"{p}:1: the header lacks {missing}")
    n = header["num_samples"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise DumpFormatError(f"{p}:1: num_samples must be a non-negative int, got {n!r}")
    return header


def read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A dump's header, checked as load_rollout checks it, reading its first line only: a
    preflight over many rounds' dumps without loading their samples. DumpFormatError as
    load_rollout's; OSError if it cannot be read."""
    p = Path(path)
    with p.open("rb") as f:
        first = f.readline()
        if not first.strip():  # a blank first line: an empty file, or a header that is not JSON
            first += f.read()
    text = _decoded(p, first)
    if not text.strip():
        raise _empty(p)
    return _header(p, text.split("\n", 1)[0])


def load_rollout(path: str | os.PathLike[str]) -> RolloutDump:
    """Read a dump written by save_rollout; see the module docstring for what is checked."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"rollout dump {p} does not exist (save_rollout writes "
                                f"path_template.format(rollout_id=...); check the template and the id)") from None
    text = _decoded(p, raw)
    if not text.strip():
        raise _empty(p)
    lines = text.split("\n")
    ends_with_newline = lines[-1] == ""
    if ends_with_newline:
        lines.pop()

    header = _header(p, lines[0])
    n = header["num_samples"]

    body = lines[1:]
    samples: list[Sample] = []
    for i, line in enumerate(body, start=2):
        last = i == len(body) + 1
        try:
            d = json.loads(line)
        except ValueError as e:
            if last:
                raise DumpFormatError(
                    f"{p}:{i}: truncated: the last line is cut off ({e}); the header announces "
                    f"{n} samples, {len(samples)} are complete") from None
            raise DumpFormatError(f"{p}:{i}: not JSON ({e})") from None
        try:
            samples.append(Sample.from_dict(d))
        except (TypeError, ValueError) as e:
            raise DumpFormatError(f"{p}:{i}: bad sample: {e}") from None
    if len(samples) < n:
        raise DumpFormatError(f"{p}: truncated: the header announces {n} samples, the file holds "
                              f"{len(samples)}")
    if len(samples) > n:
        raise DumpFormatError(f"{p}: the header announces {n} samples, the file holds {len(samples)} "
                              f"(appended to after it was written?)")
    if not ends_with_newline:
        # Every line save_rollout writes ends with a newline; a parseable but unterminated last
        # line means the write stopped exactly at a token boundary.
        raise DumpFormatError(f"{p}:{len(lines)}: truncated: the last line has no newline")
    return RolloutDump(path=p, rollout_id=header["rollout_id"], weight_version=header["weight_version"],
                       created=header["created"], meta=dict(header.get("meta") or {}), samples=samples,
                       version=header["version"])


# -- the training batch ---------------------------------------------------------------------


def build_training_batch(samples: Iterable[Sample | Mapping], pad_id: int = 0) -> dict[str, Any]:
    """The RL step's input from a round's samples (see the module docstring for the tensors).
    Every sample needs a reward and one logprob per output token; ValueError names the sample
    that lacks them."""
    import torch

    rows = [s if isinstance(s, Sample) else Sample.from_dict(s) for s in samples]
    if not rows:
        raise ValueError("build_training_batch: no samples")
    for i, s in enumerate(rows):
        if s.reward is None:
            raise ValueError(f"sample {i} (engine {s.engine}) has no reward: score it before training")
        if s.logprobs is None or len(s.logprobs) != len(s.output_token_ids):
            got = "none" if s.logprobs is None else len(s.logprobs)
            raise ValueError(f"sample {i} (engine {s.engine}): {len(s.output_token_ids)} output tokens "
                             f"but {got} logprobs; request logprobs from the engine")
        if not s.output_token_ids:
            raise ValueError(f"sample {i} (engine {s.engine}) has no output tokens: nothing to train on")
        if not math.isfinite(s.reward):
            raise ValueError(f"sample {i}: reward {s.reward} is not finite")

    B = len(rows)
    L = max(len(s.prompt_token_ids) + len(s.output_token_ids) for s in rows)
    input_ids = torch.full((B, L), int(pad_id), dtype=torch.int64)
    attention_mask = torch.zeros((B, L), dtype=torch.int64)
    loss_mask = torch.zeros((B, L), dtype=torch.int64)
    old_logprobs = torch.zeros((B, L), dtype=torch.float32)
    prompt_lengths = torch.tensor([len(s.prompt_token_ids) for s in rows], dtype=torch.int64)
    response_lengths = torch.tensor([len(s.output_token_ids) for s in rows], dtype=torch.int64)
    for i, s in enumerate(rows):
        p, r = len(s.prompt_token_ids), len(s.output_token_ids)
        input_ids[i, :p + r] = torch.tensor(s.prompt_token_ids + s.output_token_ids, dtype=torch.int64)
        attention_mask[i, :p + r] = 1
        loss_mask[i, p:p + r] = 1
        old_logprobs[i, p:p + r] = torch.tensor(s.logprobs, dtype=torch.float32)

    rewards = torch.tensor([s.reward for s in rows], dtype=torch.float32)
    # Group baseline: the mean reward of the samples that share a group key (first-seen order, so
    # the sums run in the same order on a replay and the float result is identical).
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(rows):
        groups.setdefault(s.group_key, []).append(i)
    baseline = torch.zeros(B, dtype=torch.float32)
    for idx in groups.values():
        t = torch.tensor(idx, dtype=torch.int64)
        baseline[t] = rewards[t].mean()
    advantages = rewards - baseline
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
            "old_logprobs": old_logprobs, "rewards": rewards, "advantages": advantages,
            "prompt_lengths": prompt_lengths, "response_lengths": response_lengths}


def batch_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Names of the tensors that differ (shape, dtype or any value; NaN equals NaN) between two
    training batches, plus keys only one has. [] means a replay reproduced the batch exactly."""
    import torch

    out = [f"{k} (only in one batch)" for k in sorted(set(a) ^ set(b))]
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            out.append(f"{k} ({x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)})")
        elif x.is_floating_point():
            nx, ny = torch.isnan(x), torch.isnan(y)
            if not torch.equal(nx, ny) or not torch.equal(x.masked_fill(nx, 0), y.masked_fill(ny, 0)):
                out.append(k)
        elif not torch.equal(x, y):
            out.append(k)
    return out
