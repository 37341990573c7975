"""Probes over HTTP: liveness (/health) and the deep probe that sees a hang.

vLLM's /health only reads a flag: it says 200 in about 1 ms while the EngineCore is SIGSTOPped.
A 1-token completion is the one thing that exercises the engine loop. A busy engine answers
that probe late (it queues behind the rollout, or behind one long step), so a late probe is
judged by the evidence read right then (`judge_late`):
- vLLM's own counters moved (tokens generated or prefilled): progress;
- a process of a spawned engine's group is stopped (state T): hung;
- the engine is paused (/is_paused: vLLM 0.32 queues requests while a weight push holds it):
  excused, up to sync_timeout;
- the group burns CPU (a first-use compile, a long prefill): busy, excused up to max_busy;
- none of these: a failed probe. Attached engines (no pid) have the counters and the pause only.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

import aiohttp

from .activity import GroupSample, busy, describe, sample_group
from ..settings import PROGRESS_WINDOW
from ..states import DAEMON_LIMIT, ProbeOutcome
from .http1 import Http1Client, HttpProtocolError, read_bounded

# Labels end on their own line ([^}\n]): an unclosed "{" must not make a scan of the whole
# answer per line (quadratic time on the event loop, seen with a 480 KB answer).
_GEN_TOKENS = re.compile(r"^vllm:generation_tokens_total(?:\{[^}\n]*\})?[ \t]+([0-9.eE+-]+)", re.M)
_PROMPT_TOKENS = re.compile(r"^vllm:prompt_tokens_total(?:\{[^}\n]*\})?[ \t]+([0-9.eE+-]+)", re.M)
_RUNNING = re.compile(r"^vllm:num_requests_running(?:\{[^}\n]*\})?[ \t]+([0-9.eE+-]+)", re.M)
# One engine's /metrics is tens of KB (its histograms); more is not read, and not judged.
MAX_METRICS = 4 << 20
# A late probe is judged on readings taken now, PROGRESS_WINDOW apart (in settings.py, part of the
# hang bound): /metrics twice (a decoding engine moves its counters within a few steps) and the
# group's CPU time (50 clock ticks of one core: enough resolution to tell 10% of a core from a
# stopped group's <1%).
# What a heartbeat saw (ProbeOutcome.kind; vime_probes_total{outcome}): answered in time;
# late, but vLLM's counters rose meanwhile; late, the group burning CPU with no token counted
# (excused up to max_busy); generation held by /pause (excused up to sync_timeout); a process
# of the group stopped (state T); late with no sign of work; the connection refused; any other
# failure (an HTTP error status, an answer that cannot be read).
# daemon_limit: the daemon could not open a connection for want of descriptors (its own
# open-file limit, EMFILE, or the system's, ENFILE): not held against the engine (fsm).
PROBE_KINDS = ("ok", "late_progress", "late_busy", "paused", "stopped", "timeout", "refused", "error",
               DAEMON_LIMIT)
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)


def _daemon_limit(what: str, e: OSError) -> ProbeOutcome:
    return ProbeOutcome(False, f"{what}: the daemon is out of descriptors ({e}); not the engine's failure: raise "
                               "the daemon's open-file limit (vime-supervisor --check-config says to what)",
                        kind=DAEMON_LIMIT)
# Our published versions are integers below 2**63 (what the journal, metrics and JSON
# consumers all take); anything else an engine says is an opaque label, never "current".
_VERSION = re.compile(r"[0-9]{1,19}")


@dataclass(frozen=True)
class WeightRead:
    """What one read of /weight_info found. `readable` False: no answer could be read (not
    reached, timed out, the daemon out of descriptors, a 5xx, a body that is not JSON), so
    `version` says nothing. Readable with `version` None: the engine holds its base weights
    ("default") or does not serve the route (a 4xx)."""

    readable: bool
    version: int | str | None = None
    detail: str = ""

    def or_remembered(self, remembered: int | str | None) -> int | str | None:
        """The version of a process that never stopped while it was not read: what it says
        when it says it (base weights included), what it had when it cannot be read."""
        return self.version if self.readable else remembered


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
    connection of its own (supervisor/engine/http1.py: aiohttp costs ~0.3 ms of CPU a request, a
    third of a core at 1024 engines), the rare reads (/health, /metrics, /weight_info) over
    the daemon's shared aiohttp session. Call close() when the engine's process goes, so a
    new incarnation is never probed over a connection to the old one."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, timeout: float, *,
                 group: Callable[[], int | None] | None = None, api_key: str | None = None):
        self.session = session
        self.base_url = base_url
        self.model = model
        self.timeout = timeout
        self.group = group  # the process group of a spawned engine's current incarnation
        # vLLM's key guards /v1 only (0.32: /v1, /v2, /inference, /cohere): the deep probe and
        # the warm-up need it; sent on the other reads too, where it is harmless.
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
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
                headers={"Content-Type": "application/json", **self.auth},
                timeout=aiohttp.ClientTimeout(total=self.timeout),
            ) as r:
                return r.status, await r.read()
        host, port, path = self._lean_target
        if self._lean is None:
            self._lean = Http1Client(host, port, headers=self.auth)
        return await self._lean.post_json(path, self._body, self.timeout)

    async def health(self, timeout: float | None = None) -> ProbeOutcome:
        t0 = time.monotonic()
        try:
            async with self.session.get(
                f"{self.base_url}/health", headers=self.auth,
                timeout=aiohttp.ClientTimeout(total=timeout or self.timeout),
            ) as r:
                latency = time.monotonic() - t0
                if r.status == 200:
                    return ProbeOutcome(True, "health 200", latency, kind="ok")
                if r.status == 503:
                    return ProbeOutcome(False, "health 503: engine core dead", latency, kind="error")
                return ProbeOutcome(False, f"health {r.status}", latency, kind="error")
        except asyncio.TimeoutError:
            return ProbeOutcome(False, f"health timeout after {timeout or self.timeout:g}s", kind="timeout")
        except aiohttp.ClientConnectorError as e:
            if e.os_error is not None and e.os_error.errno in _OUT_OF_DESCRIPTORS:
                return _daemon_limit("health", e.os_error)
            return ProbeOutcome(False, f"health: connection refused ({e.os_error.strerror if e.os_error else e})",
                                kind="refused")
        except aiohttp.ClientError as e:
            return ProbeOutcome(False, f"health: {type(e).__name__}: {e}", kind="error")
        except Exception as e:  # whatever the engine answered, a probe reports, never raises
            return ProbeOutcome(False, f"health: {type(e).__name__}: {e}", kind="error")

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
                    return ProbeOutcome(True, "paused: generation held by /pause", latency, excuse="paused",
                                        kind="paused")
                return ProbeOutcome(False, f"generate {status}: {text}", latency, kind="error")
            data = json.loads(raw)
            if not data.get("choices"):
                return ProbeOutcome(False, "generate: no choices in answer", latency, kind="error")
            return ProbeOutcome(True, "ok", latency, kind="ok")
        except asyncio.TimeoutError:  # before OSError: TimeoutError is one since Python 3.11
            return await self._late()
        except aiohttp.ClientConnectorError as e:
            if e.os_error is not None and e.os_error.errno in _OUT_OF_DESCRIPTORS:
                return _daemon_limit("generate", e.os_error)
            return ProbeOutcome(False, "generate: connection refused", kind="refused")
        except aiohttp.ClientError as e:
            return ProbeOutcome(False, f"generate: {type(e).__name__}: {e}", kind="error")
        except ConnectionRefusedError:  # the lean client could not connect
            return ProbeOutcome(False, "generate: connection refused", kind="refused")
        except OSError as e:  # unreachable, no such host, ... or the daemon's own limit
            if e.errno in _OUT_OF_DESCRIPTORS:
                return _daemon_limit("generate", e)
            return ProbeOutcome(False, f"generate: cannot connect: {e}", kind="error")
        except HttpProtocolError as e:  # it connected, but the answer was cut short or unreadable
            return ProbeOutcome(False, f"generate: HttpProtocolError: {e}", kind="error")
        except Exception as e:  # a malformed answer (not JSON, wrong shape) is a failed probe
            return ProbeOutcome(False, f"generate: {type(e).__name__}: {e}", kind="error")

    async def progress(self) -> Progress | None:
        # Its own 2 s bound, not the probe timeout: a busy API server answers /metrics late too,
        # and a hung EngineCore does not slow /metrics (the API server answers it).
        try:
            async with self.session.get(
                f"{self.base_url}/metrics", headers=self.auth, timeout=aiohttp.ClientTimeout(total=2.0)
            ) as r:
                raw = await read_bounded(r, MAX_METRICS) if r.status == 200 else None
            return None if raw is None else parse_progress(raw.decode("utf-8", "replace"))
        except Exception:  # whatever went wrong, there is no progress to judge by
            return None

    async def _late(self) -> ProbeOutcome:
        """The evidence about a late probe, all read now (a hang is never excused by work done
        before it): the group's processes, /is_paused, and two readings of the counters and
        of the group's CPU time, PROGRESS_WINDOW apart."""
        pgid = self.group() if self.group is not None else None
        cpu_before = await asyncio.to_thread(sample_group, pgid) if pgid else None
        if cpu_before is not None and cpu_before.stopped:  # nothing else to wait for
            return judge_late(self.timeout, None, None, cpu_before, cpu_before, paused=False)
        # /is_paused is a utility call into the EngineCore: a paused (idle) core answers at
        # once, a busy or hung one not within the window, which is then no evidence either way.
        paused = asyncio.ensure_future(self.is_paused(PROGRESS_WINDOW))
        try:
            before = await self.progress()
            await asyncio.sleep(PROGRESS_WINDOW)
            now = await self.progress() if before is not None else None
            cpu_after = await asyncio.to_thread(sample_group, pgid) if pgid else None
            is_paused = await paused
        finally:
            paused.cancel()
        return judge_late(self.timeout, before, now, cpu_before, cpu_after, paused=is_paused)

    async def is_paused(self, timeout: float) -> bool:
        """vLLM's /is_paused (dev mode); False when it does not answer in time or at all."""
        try:
            async with self.session.get(f"{self.base_url}/is_paused", headers=self.auth,
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                body = await r.json() if r.status == 200 else None
        except Exception:  # unknown is not paused: the probe is judged on the rest
            return False
        return isinstance(body, dict) and body.get("is_paused") is True

    async def check(self) -> ProbeOutcome:
        """One heartbeat: the deep probe, which proves liveness too when it answers. Only when
        it fails is /health asked, to say why (503: the engine core is dead)."""
        deep = await self.generate()
        if deep.ok or deep.kind == DAEMON_LIMIT:  # no descriptor for /health either
            return deep
        live = await self.health()
        return deep if live.ok else ProbeOutcome(False, f"{live.detail}; {deep.detail}", deep.latency, kind=deep.kind)

    async def weight_version(self) -> int | str | None:
        """The engine's weight version from vLLM's /weight_info (dev mode), as ours: None for
        the base weights ("default", never set), when the route is not served, and when it
        cannot be read (never the current version); our published versions are integers, so
        digits become an int. read_weight_version tells those apart."""
        return (await self.read_weight_version()).version

    async def read_weight_version(self) -> WeightRead:
        url = f"{self.base_url}/weight_info"
        try:
            async with self.session.get(url, headers=self.auth,
                                        timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                if r.status >= 500 or r.status == 429:
                    return WeightRead(False, detail=f"/weight_info answered {r.status}")
                if r.status != 200:
                    return WeightRead(True, detail=f"/weight_info answered {r.status}: not served")
                body = await r.json(content_type=None)
        except asyncio.TimeoutError:
            return WeightRead(False, detail=f"/weight_info: no answer within {self.timeout:g}s")
        except aiohttp.ClientConnectorError as e:
            return WeightRead(False, detail=f"/weight_info: {e.os_error or e}")
        except Exception as e:  # an answer that cannot be read says nothing of the weights
            return WeightRead(False, detail=f"/weight_info: {type(e).__name__}: {e}")
        raw = body.get("weight_version") if isinstance(body, dict) else None
        return WeightRead(True, parse_version(raw), detail=f"/weight_info says {raw!r}"[:120])


def parse_version(raw: object) -> int | str | None:
    """An engine's weight version label as ours. The engine's answer is untrusted input: only
    plain ASCII digits that fit our versions become an int ("²" and 5,000 digits do not);
    other strings stay opaque labels (shortened), never equal to a published version."""
    if not isinstance(raw, str) or raw == "default":
        return None
    if _VERSION.fullmatch(raw) and int(raw) < 2**63:
        return int(raw)
    return raw if len(raw) <= 64 else raw[:61] + "..."


def judge_late(timeout: float, before: Progress | None, now: Progress | None,
               cpu_before: GroupSample | None, cpu_after: GroupSample | None, *, paused: bool) -> ProbeOutcome:
    """Pure: what a probe that got no answer within `timeout` means, from readings taken now."""
    late = f"probe late (>{timeout:g}s)"
    if cpu_after is not None and cpu_after.stopped:
        return ProbeOutcome(False, f"{late}; stopped: {describe(cpu_after.stopped)}", kind="stopped")
    # Counters that rose prove the engine loop stepped, whether or not requests are still
    # running at this instant (a round may just have ended).
    if before and now and now.tokens > before.tokens:
        return ProbeOutcome(True, f"busy: {late}, {now.tokens - before.tokens:g} tokens processed meanwhile",
                            kind="late_progress")
    if paused:
        return ProbeOutcome(True, f"paused: {late}, generation held by /pause", excuse="paused", kind="paused")
    if cpu_before is not None and cpu_after is not None:
        working, cores = busy(cpu_before, cpu_after)
        if working:
            return ProbeOutcome(True, f"busy: {late}, no tokens, processes at {cores:.0%} of a core",
                                excuse="busy", kind="late_busy")
        return ProbeOutcome(False, f"timeout after {timeout:g}s, no progress (processes at {cores:.0%} "
                                   f"of a core: {cpu_after.describe()})", kind="timeout")
    return ProbeOutcome(False, f"timeout after {timeout:g}s, no progress", kind="timeout")
