"""Probes over HTTP: liveness (/health) and the deep probe that sees a hang.

vLLM's /health only reads a flag: it says 200 in about 1 ms while the EngineCore is SIGSTOPped.
A 1-token completion is the one thing that exercises the engine loop. A busy engine answers
that probe late (it queues behind the rollout), so a probe timeout with vLLM's own counters
moving (generation tokens rising while requests run) is progress, not a hang.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from .fsm import ProbeOutcome
from .http1 import Http1Client, HttpProtocolError

_GEN_TOKENS = re.compile(r"^vllm:generation_tokens_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)
_PROMPT_TOKENS = re.compile(r"^vllm:prompt_tokens_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)
_RUNNING = re.compile(r"^vllm:num_requests_running(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)
# After a first late probe there is no earlier reading to compare with: /metrics is read again
# this much later. A stepping engine moves its counters within a few decode steps; a hung one not.
PROGRESS_WINDOW = 0.25


@dataclass(frozen=True)
class Progress:
    generation_tokens: float
    requests_running: float
    prompt_tokens: float = 0.0

    @property
    def tokens(self) -> float:
        """Tokens the engine has processed (prefill too: a long prompt's prefill is progress)."""
        return self.generation_tokens + self.prompt_tokens


def parse_progress(metrics_text: str) -> Progress | None:
    """Sum vLLM's counters over label sets; None when the engine does not export them."""
    try:
        tokens = [float(v) for v in _GEN_TOKENS.findall(metrics_text)]
        running = [float(v) for v in _RUNNING.findall(metrics_text)]
        prompt = [float(v) for v in _PROMPT_TOKENS.findall(metrics_text)]
    except ValueError:  # not a number we can read (e.g. "+Inf"): no progress to judge by
        return None
    if not tokens:
        return None
    return Progress(sum(tokens), sum(running), sum(prompt))


def _lean_target(base_url: str) -> tuple[str, int, str] | None:
    """(host, port, path) of the deep probe for the lean client; None where it cannot go
    (https: it speaks no TLS), so the probe stays on aiohttp. VIME_PROBE_HTTP=aiohttp keeps
    every probe on aiohttp: an escape hatch, and the baseline of bench/fleet_scale.py."""
    if os.environ.get("VIME_PROBE_HTTP") == "aiohttp":
        return None
    try:
        url = urlsplit(base_url)
        port = url.port or 80
    except ValueError:  # a port that is not a number: aiohttp will say what is wrong
        return None
    if url.scheme != "http" or not url.hostname or url.query:
        return None
    return url.hostname, port, f"{url.path.rstrip('/')}/v1/completions"


class Prober:
    """Probes one engine: the deep probe (every heartbeat) over a lean kept-alive HTTP/1.1
    connection of its own (supervisor/http1.py: aiohttp costs ~0.3 ms of CPU a request, a
    third of a core at 1024 engines), the rare reads (/health, /metrics, /weight_info) over
    the daemon's shared aiohttp session. Call close() when the engine's process goes, so a
    new incarnation is never probed over a connection to the old one."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, timeout: float):
        self.session = session
        self.base_url = base_url
        self.model = model
        self.timeout = timeout
        self._body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 1, "temperature": 0}).encode()
        self._lean_target = _lean_target(base_url)
        self._lean: Http1Client | None = None  # created at the first probe, dropped by close()

    def close(self) -> None:
        """Drop the deep probe's connection (the next probe opens a new one). Synchronous: safe
        in a cancelled task's `finally`."""
        if self._lean is not None:
            self._lean.close()
            self._lean = None

    async def _post_completion(self) -> tuple[int, bytes]:
        if self._lean_target is None:
            async with self.session.post(
                f"{self.base_url}/v1/completions", data=self._body,
                headers={"Content-Type": "application/json"}, timeout=aiohttp.ClientTimeout(total=self.timeout),
            ) as r:
                return r.status, await r.read()
        host, port, path = self._lean_target
        if self._lean is None:
            self._lean = Http1Client(host, port)
        return await self._lean.post_json(path, self._body, self.timeout)

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

        vLLM's counters (tokens generated and prefilled) are read only when a probe times out
        (a healthy engine costs one request per heartbeat): twice, PROGRESS_WINDOW apart.
        Risen counters are progress (a busy engine), still ones a failure.
        """
        t0 = time.monotonic()
        try:
            status, raw = await self._post_completion()
            latency = time.monotonic() - t0
            if status != 200:
                text = raw.decode("utf-8", "replace")[:200]
                if status == 503 and "paused" in text.lower():
                    # vLLM >= 0.33 answers 503 engine_paused while a trainer pushes weights
                    # (0.32 queues the request instead): a paused engine is not a hung one.
                    return ProbeOutcome(True, "paused: generation held by /pause", latency)
                return ProbeOutcome(False, f"generate {status}: {text}", latency)
            data = json.loads(raw)
            if not data.get("choices"):
                return ProbeOutcome(False, "generate: no choices in answer", latency)
            return ProbeOutcome(True, "ok", latency)
        except asyncio.TimeoutError:  # before OSError: TimeoutError is one since Python 3.11
            # Two readings of the counters, PROGRESS_WINDOW apart, both taken now: a hang is
            # never excused by work done before it, and a busy engine is not counted a failure
            # (seen: a saturated engine at the RL demo's first round stopped as hung).
            before = await self.progress()
            if before is None:
                return self._judge_timeout(None, None)
            await asyncio.sleep(PROGRESS_WINDOW)
            return self._judge_timeout(before, await self.progress())
        except aiohttp.ClientConnectorError:
            return ProbeOutcome(False, "generate: connection refused")
        except aiohttp.ClientError as e:
            return ProbeOutcome(False, f"generate: {type(e).__name__}: {e}")
        except ConnectionRefusedError:  # the lean client could not connect
            return ProbeOutcome(False, "generate: connection refused")
        except OSError as e:  # unreachable, no such host, ...
            return ProbeOutcome(False, f"generate: cannot connect: {e}")
        except HttpProtocolError as e:  # it connected, but the answer was cut short or unreadable
            return ProbeOutcome(False, f"generate: HttpProtocolError: {e}")
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
        # Counters that rose prove the engine loop stepped since the last reading, whether or
        # not requests are still running at this instant (a round may just have ended).
        if before and now and now.tokens > before.tokens:
            made = now.tokens - before.tokens
            return ProbeOutcome(True, f"busy: probe late, {made:g} tokens processed meanwhile")
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
