"""Probes over HTTP: liveness (/health) and the deep probe that sees a hang.

vLLM's /health only reads a flag: it says 200 in about 1 ms while the EngineCore is SIGSTOPped.
A 1-token completion is the one thing that exercises the engine loop. A busy engine answers
that probe late (it queues behind the rollout), so a probe timeout with vLLM's own counters
moving (generation tokens rising while requests run) is progress, not a hang.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass

import aiohttp

from .fsm import ProbeOutcome

_GEN_TOKENS = re.compile(r"^vllm:generation_tokens_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)
_RUNNING = re.compile(r"^vllm:num_requests_running(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)


@dataclass(frozen=True)
class Progress:
    generation_tokens: float
    requests_running: float


def parse_progress(metrics_text: str) -> Progress | None:
    """Sum vLLM's counters over label sets; None when the engine does not export them."""
    try:
        tokens = [float(v) for v in _GEN_TOKENS.findall(metrics_text)]
        running = [float(v) for v in _RUNNING.findall(metrics_text)]
    except ValueError:  # not a number we can read (e.g. "+Inf"): no progress to judge by
        return None
    if not tokens:
        return None
    return Progress(sum(tokens), sum(running))


class Prober:
    """Probes one engine over one shared aiohttp session."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, timeout: float):
        self.session = session
        self.base_url = base_url
        self.model = model
        self.timeout = timeout
        self._last_progress: Progress | None = None  # /metrics at the last timed-out probe

    async def health(self, timeout: float | None = None) -> ProbeOutcome:
        t0 = time.monotonic()
        try:
            async with self.session.get(
                f"{self.base_url}/health", timeout=aiohttp.ClientTimeout(total=timeout or self.timeout)
            ) as r:
                latency = time.monotonic() - t0
                if r.status == 200:
                    return ProbeOutcome(True, "health 200", latency)
                if r.status == 503:
                    return ProbeOutcome(False, "health 503: engine core dead", latency)
                return ProbeOutcome(False, f"health {r.status}", latency)
        except asyncio.TimeoutError:
            return ProbeOutcome(False, f"health timeout after {timeout or self.timeout:g}s")
        except aiohttp.ClientConnectorError as e:
            return ProbeOutcome(False, f"health: connection refused ({e.os_error.strerror if e.os_error else e})")
        except aiohttp.ClientError as e:
            return ProbeOutcome(False, f"health: {type(e).__name__}: {e}")
        except Exception as e:  # whatever the engine answered, a probe reports, never raises
            return ProbeOutcome(False, f"health: {type(e).__name__}: {e}")

    async def generate(self) -> ProbeOutcome:
        """One greedy token within the probe timeout; a late answer is judged by progress.

        vLLM's counters are read only when a probe times out, and compared with the reading at
        the previous timeout: a healthy engine costs one request per heartbeat. So the first
        late probe of a busy engine counts as a failure (SUSPECT, still routable) and the next
        one, seeing tokens generated since, as progress. A success forgets the reading, so a
        hang is never excused by work done before it.
        """
        t0 = time.monotonic()
        body = {"model": self.model, "prompt": "hi", "max_tokens": 1, "temperature": 0}
        try:
            async with self.session.post(
                f"{self.base_url}/v1/completions", json=body,
                timeout=aiohttp.ClientTimeout(total=self.timeout),
            ) as r:
                latency = time.monotonic() - t0
                if r.status != 200:
                    text = (await r.text())[:200]
                    if r.status == 503 and "paused" in text.lower():
                        # vLLM >= 0.33 answers 503 engine_paused while a trainer pushes weights
                        # (0.32 queues the request instead): a paused engine is not a hung one.
                        return ProbeOutcome(True, "paused: generation held by /pause", latency)
                    return ProbeOutcome(False, f"generate {r.status}: {text}", latency)
                data = await r.json()
                if not data.get("choices"):
                    return ProbeOutcome(False, "generate: no choices in answer", latency)
                self._last_progress = None
                return ProbeOutcome(True, "ok", latency)
        except asyncio.TimeoutError:
            before, now = self._last_progress, await self.progress()
            self._last_progress = now
            return self._judge_timeout(before, now)
        except aiohttp.ClientConnectorError:
            return ProbeOutcome(False, "generate: connection refused")
        except aiohttp.ClientError as e:
            return ProbeOutcome(False, f"generate: {type(e).__name__}: {e}")
        except Exception as e:  # a malformed answer (not JSON, wrong shape) is a failed probe
            return ProbeOutcome(False, f"generate: {type(e).__name__}: {e}")

    async def progress(self) -> Progress | None:
        # Its own 2 s bound, not the probe timeout: a busy API server answers /metrics late too,
        # and a hung EngineCore does not slow /metrics (the API server answers it).
        try:
            async with self.session.get(
                f"{self.base_url}/metrics", timeout=aiohttp.ClientTimeout(total=2.0)
            ) as r:
                if r.status != 200:
                    return None
                return parse_progress(await r.text())
        except Exception:  # whatever went wrong, there is no progress to judge by
            return None

    def _judge_timeout(self, before: Progress | None, now: Progress | None) -> ProbeOutcome:
        if before and now and now.requests_running > 0 and now.generation_tokens > before.generation_tokens:
            made = now.generation_tokens - before.generation_tokens
            return ProbeOutcome(True, f"busy: probe late, {made:g} tokens generated meanwhile")
        return ProbeOutcome(False, f"timeout after {self.timeout:g}s, no progress")

    async def check(self) -> ProbeOutcome:
        """One heartbeat: the deep probe, which proves liveness too when it answers. Only when
        it fails is /health asked, to say why (503: the engine core is dead)."""
        deep = await self.generate()
        if deep.ok:
            return deep
        live = await self.health()
        return deep if live.ok else ProbeOutcome(False, f"{live.detail}; {deep.detail}", deep.latency)

    async def weight_version(self) -> int | str | None:
        """The engine's weight version from vLLM's /weight_info (dev mode), as ours: None for
        the base weights ("default", never set) or when the route is not served; our
        published versions are integers, so digits become an int."""
        try:
            async with self.session.get(
                f"{self.base_url}/weight_info", timeout=aiohttp.ClientTimeout(total=self.timeout)
            ) as r:
                if r.status != 200:
                    return None
                body = await r.json()
                raw = body.get("weight_version") if isinstance(body, dict) else None
        except Exception:  # unreadable: treated as unknown, so never as the current version
            return None
        if not isinstance(raw, str) or raw == "default":
            return None
        return int(raw) if raw.isdigit() else raw
