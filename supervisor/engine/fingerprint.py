"""A weight version's fingerprint: what the trainer's own weights say for a few fixed prompts,
checked on an engine before it is routable at that version (docs/weights.md#fingerprints).

`/weight_info` is a label the engine sets itself; a push answered 200 that sent nothing, a push
of another version's tensors or half a push, and `/update_weight_version` called by hand all
leave it saying the version. What the engine computes cannot be set by hand: the daemon sends
the fingerprint's prompts (token ids) to `/v1/completions` with `prompt_logprobs` and compares
the logprob of every prompt token, teacher-forced (no sampling, so no greedy near-tie can make
two equal models diverge), with the trainer's, within a tolerance.

Pure but for `probe` (one HTTP request). The trainer side is trainer/fingerprint.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import Conflict
from ..protocol import BF16_GPU_TOLERANCE, FP32_CPU_TOLERANCE
from ..states import VersionRule

__all__ = ["Fingerprint", "FingerprintError", "Comparison", "Verdict", "parse", "request_body", "observed", "compare",
           "probe", "judge", "unverified", "is_unverified", "relabel", "republished", "unchecked", "FP32_CPU_TOLERANCE", "BF16_GPU_TOLERANCE", "MAX_PROMPTS", "MAX_PROMPT_TOKENS", "MAX_TOKEN_ID"]

# The largest fingerprint these allow (8 x 128 tokens, ids up to MAX_TOKEN_ID, each logprob
# at its longest JSON) is about 39 KB as JSON, so a publish carrying it fits the control
# socket's 64 KiB request body with room to spare (tests/unit/test_fingerprint.py measures it).
# make_fingerprint's default is 4 x 48.
MAX_PROMPTS = 8
MAX_PROMPT_TOKENS = 128
MAX_TOKEN_ID = 2**31 - 1  # above any vocabulary; bounds a token id's JSON


class FingerprintError(ValueError):
    """A fingerprint that cannot be used: the message says what to send instead."""


@dataclass(frozen=True)
class Fingerprint:
    """`prompts`: token ids; `logprobs[i][j]`: the trainer's logprob of prompts[i][j + 1]
    given prompts[i][: j + 1] (one fewer than the prompt's tokens). `tolerance`: the largest
    |difference| still taken as the same weights."""

    prompts: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]
    tolerance: float

    def to_json(self) -> dict[str, Any]:
        return {"prompts": [list(p) for p in self.prompts], "logprobs": [list(lp) for lp in self.logprobs],
                "tolerance": self.tolerance}


def parse(obj: Any) -> Fingerprint:
    """A fingerprint from its JSON form, checked; FingerprintError says what is wrong."""
    if not isinstance(obj, dict):
        raise FingerprintError("fingerprint must be an object {prompts, logprobs, tolerance} "
                               "(vime.trainer.fingerprint.make_fingerprint builds one)")
    unknown = sorted(set(obj) - {"prompts", "logprobs", "tolerance"})
    if unknown:
        raise FingerprintError(f"fingerprint has unknown fields {', '.join(unknown)}; "
                               "send prompts, logprobs and tolerance")
    prompts, logprobs, tol = obj.get("prompts"), obj.get("logprobs"), obj.get("tolerance")
    if not isinstance(prompts, list) or not 1 <= len(prompts) <= MAX_PROMPTS:
        raise FingerprintError(f"fingerprint.prompts must be a list of 1 to {MAX_PROMPTS} prompts (token id lists)")
    if not isinstance(logprobs, list) or len(logprobs) != len(prompts):
        raise FingerprintError("fingerprint.logprobs must be a list with one entry per prompt")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (math.isfinite(tol) and tol > 0):
        raise FingerprintError(f"fingerprint.tolerance must be a number > 0, got {tol!r}")
    ps: list[tuple[int, ...]] = []
    ls: list[tuple[float, ...]] = []
    for i, (p, lp) in enumerate(zip(prompts, logprobs)):
        if (not isinstance(p, list) or not 2 <= len(p) <= MAX_PROMPT_TOKENS
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in p)):
            raise FingerprintError(f"fingerprint.prompts[{i}] must be 2 to {MAX_PROMPT_TOKENS} token ids "
                                   f"(ints 0 to {MAX_TOKEN_ID})")
        if (not isinstance(lp, list) or len(lp) != len(p) - 1
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x <= 0
                           for x in lp)):
            raise FingerprintError(f"fingerprint.logprobs[{i}] must be {len(p) - 1} logprobs (finite, <= 0): one "
                                   "per prompt token after the first")
        ps.append(tuple(p))
        ls.append(tuple(float(x) for x in lp))
    return Fingerprint(tuple(ps), tuple(ls), float(tol))


def request_body(fp: Fingerprint, model: str) -> dict[str, Any]:
    """The /v1/completions request that makes an engine compute the fingerprint: one token
    generated (vLLM needs one), every prompt token's logprob returned."""
    return {"model": model, "prompt": [list(p) for p in fp.prompts], "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": 0}


def observed(answer: Any, fp: Fingerprint) -> list[list[float]]:
    """Each prompt token's logprob (after the first) from a /v1/completions answer to
    request_body; FingerprintError if the answer does not carry them."""
    try:
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != len(fp.prompts):
            raise FingerprintError(f"{len(choices)} choices for {len(fp.prompts)} prompts")
        out: list[list[float]] = []
        for prompt, c in zip(fp.prompts, choices):
            entries = c["prompt_logprobs"]
            if not isinstance(entries, list) or len(entries) != len(prompt):
                raise FingerprintError(f"prompt_logprobs has {len(entries) if isinstance(entries, list) else '?'} "
                                       f"entries for a {len(prompt)}-token prompt")
            # entries[0] is None (nothing predicts the first token); each later one maps token id
            # (a string in JSON) to {"logprob": ...} and always holds the prompt's own token.
            out.append([float(entries[j][str(prompt[j])]["logprob"]) for j in range(1, len(prompt))])
        return out
    except FingerprintError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise FingerprintError(f"the engine's answer carries no prompt_logprobs ({type(e).__name__}: {e})") from e


@dataclass(frozen=True)
class Comparison:
    max_diff: float  # max |expected - observed| over every compared token (inf: not comparable)
    where: tuple[int, int]  # (prompt, position) of it
    tolerance: float

    @property
    def matches(self) -> bool:
        return self.max_diff <= self.tolerance

    def describe(self) -> str:
        i, j = self.where
        verdict = "within" if self.matches else "over"
        return (f"fingerprint max |logprob difference| {self.max_diff:.3g} (prompt {i}, token {j + 1}) "
                f"{verdict} tolerance {self.tolerance:g}")


def compare(fp: Fingerprint, got: list[list[float]]) -> Comparison:
    """How far an engine's logprobs are from the fingerprint's. NaN counts as infinitely far."""
    worst, where = 0.0, (0, 0)
    if len(got) != len(fp.logprobs):
        return Comparison(math.inf, (0, 0), fp.tolerance)
    for i, (want, have) in enumerate(zip(fp.logprobs, got)):
        if len(have) != len(want):
            return Comparison(math.inf, (i, 0), fp.tolerance)
        for j, (a, b) in enumerate(zip(want, have)):
            d = abs(a - b)
            if not d <= worst:  # NaN too
                worst, where = (d if math.isfinite(d) else math.inf), (i, j)
    return Comparison(worst, where, fp.tolerance)


_UNVERIFIED = "-unverified"


def unverified(version: int) -> str:
    """The weight version an engine is taken to hold when its label says `version` but its
    outputs were not shown to match: never a published version, so it is synced again."""
    return f"{version}{_UNVERIFIED}"


@dataclass(frozen=True)
class Verdict:
    """What an engine that answers (ready, or recovered) with /weight_info saying `label` is
    taken to hold, once the version's fingerprint was run on it: `version`, the weight version
    its state machine is given (the label, or unverified(label): STALE, synced and checked
    again); `condemn`, why it is poisoned (stopped, restarted, never routed); `mismatch`, why
    its outputs did not match (logged and counted, whatever `fingerprint_mismatch` says)."""

    version: int | str | None
    condemn: str | None = None
    mismatch: str | None = None


def unchecked(label: int | str | None, fingerprinted: int | None, rule: VersionRule) -> Verdict | None:
    """Pure: the verdict on an engine answering (ready, recovered) with /weight_info saying
    `label` without running a fingerprint, or None when the fingerprint must be run (the label
    says `fingerprinted`, the current version, which has one). Only the current version's
    fingerprint is known, so another version's content cannot be checked: a label `rule` allows
    all the same (async mode, within max_staleness) is not routable on its word alone; it is
    unverified(label): STALE, synced to the current version and checked then, as at a publish.
    Without a fingerprint in force, or at a label the rule does not allow (never routable at it,
    sync mode's older versions): the label as it is."""
    if fingerprinted is None or isinstance(label, bool) or not isinstance(label, int):
        return Verdict(label)
    if label == fingerprinted:
        return None
    if rule.allows(label, fingerprinted):
        return Verdict(unverified(label))
    return Verdict(label)


def is_unverified(label: int | str | None) -> bool:
    """Is `label` an unverified(version) label (never a published version)?"""
    return isinstance(label, str) and label.endswith(_UNVERIFIED)


def relabel(held: int | str | None, read: int | str | None, *, checked: bool, fingerprinted: int | None,
            rule: VersionRule) -> int | str | None:
    """Pure: the weight version an engine is taken to hold when its /weight_info is read again
    at a publish (`held`: what it was taken to hold; `read`: what the route says now; `checked`:
    its outputs matched the published version's fingerprint at this publish; `fingerprinted`:
    the published version, when it has a fingerprint). A read is not a verification: an
    unverified engine stays unverified at what it says now (only a sync, checked, verifies it),
    and a label that moved since the engine was verified is believed only where a label alone
    is (fingerprints.unchecked): never at a fingerprinted version its outputs were not checked at."""
    if checked or read == held:
        return read
    if is_unverified(held):
        return unverified(read) if isinstance(read, int) and not isinstance(read, bool) else held
    verdict = unchecked(read, fingerprinted, rule)
    if verdict is None:  # it says the fingerprinted version, and was not checked at it
        assert isinstance(read, int)
        return unverified(read)
    return verdict.version


def judge(label: int, why: str | None, computed: bool, action: str) -> Verdict:
    """Pure: the verdict on an engine whose label says `label`, the current version, which has
    a fingerprint. `why`: None if its outputs matched, else what failed; `computed`: False when
    the check could not be made (no answer in time): that says nothing of its weights, so it is
    not counted, and it is synced and checked again as if it had not matched. `action`:
    fingerprint_mismatch (poison | resync | warn)."""
    if why is None:
        return Verdict(label)
    if not computed:
        return Verdict(unverified(label))
    if action == "warn":
        return Verdict(label, mismatch=why)
    if action == "resync":
        return Verdict(unverified(label), mismatch=why)
    return Verdict(unverified(label), condemn=f"poisoned: /weight_info says v{label}, but {why}", mismatch=why)


def republished(version: int, in_force: Fingerprint | None, sent: Fingerprint | None) -> Fingerprint | None:
    """Pure: the fingerprint in force once `version`, already current, is published again with
    `sent`. None sent, or the one in force again (a retry): the one in force, nothing changes.
    One where none is in force (a publish that carried none, a journal from before
    fingerprints): kept for the checks to come. Another one: Conflict, since the engines
    already routable at `version` were checked against the one in force, not against it."""
    if sent is None or sent == in_force:
        return in_force
    if in_force is None:
        return sent
    raise Conflict(f"version {version} is already current with another fingerprint; the engines routable at it "
                   "were checked against that one: publish a new version for new weights or a new fingerprint")


async def probe(session: Any, base_url: str, model: str, fp: Fingerprint, headers: dict[str, str],
                timeout: float) -> Comparison:
    """Run the fingerprint on the engine (aiohttp `session`). Raises FingerprintError when the
    engine answers but not with logprobs, and the transport's errors as they are."""
    import aiohttp

    async with session.post(f"{base_url}/v1/completions", json=request_body(fp, model), headers=headers,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        if r.status != 200:
            raise FingerprintError(f"/v1/completions answered {r.status}: {(await r.text())[:200]}")
        answer = await r.json(content_type=None)
    return compare(fp, observed(answer, fp))
