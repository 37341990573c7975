"""The warm-up: a new incarnation's first work goes down the rollout's own sampling path.

vLLM compiles on first use (on CPU, the sampler the first time a batch samples with
temperature and logprobs). Sent while the engine is still STARTING, that compile happens
outside the rounds, and a warm-up that fails is a failed start with the engine's own error in
the reason (docs/concepts.md; measured in docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from ..config import WarmupPolicy
from .http1 import read_bounded

# A warm-up answer is a few KB; an engine that sends more is refused, never buffered whole.
MAX_ANSWER = 1 << 20


class WarmupFailed(Exception):
    pass


async def warm_up(base_url: str, model: str, policy: WarmupPolicy, headers: dict[str, str] | None = None) -> str:
    """Send the warm-up batch and wait for all of it. Returns a summary; raises WarmupFailed
    with the engine's answer when a request fails. Unbounded here: the caller holds the bound
    (what is left of first_wait)."""
    if policy.requests <= 0:
        return "warm-up off"
    body = {"model": model, "prompt": policy.prompt, "max_tokens": policy.max_tokens,
            "temperature": policy.temperature, "top_p": policy.top_p, "ignore_eos": True}
    if policy.logprobs > 0:
        body["logprobs"] = policy.logprobs
    data = json.dumps(body).encode()

    async def one(session: aiohttp.ClientSession) -> int:
        try:
            async with session.post(f"{base_url}/v1/completions", data=data,
                                    headers={"Content-Type": "application/json", **(headers or {})}) as r:
                raw = await read_bounded(r, MAX_ANSWER)
        except aiohttp.ClientError as e:
            raise WarmupFailed(f"warm-up request failed: {type(e).__name__}: {e}") from None
        if raw is None:
            raise WarmupFailed(f"warm-up answer ({r.status}) over {MAX_ANSWER} bytes: not a completion")
        if r.status != 200:
            text = raw[:300].decode("utf-8", "replace").strip()
            raise WarmupFailed(f"warm-up request answered {r.status}: {text}")
        try:
            usage = json.loads(raw).get("usage") or {}
            return int(usage.get("completion_tokens", 0))
        except (ValueError, AttributeError, TypeError, OverflowError):
            raise WarmupFailed(f"warm-up answer is not a completion: {raw[:200]!r}") from None

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    # A pool of its own: the daemon's shared one allows 4 connections per engine, and the
    # batch must reach the engine at once to warm the shapes a rollout batch has.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=policy.requests)) as session:
        try:
            async with asyncio.TaskGroup() as tg:  # the first failure cancels the rest
                tasks = [tg.create_task(one(session)) for _ in range(policy.requests)]
        except* WarmupFailed as group:
            raise group.exceptions[0] from None
    tokens = sum(t.result() for t in tasks)
    return f"warm-up: {policy.requests} requests, {tokens} tokens in {loop.time() - t0:.1f}s"
