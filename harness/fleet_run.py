"""One goodput run on an emulated GPU fleet (issue 36): the real daemon spawns the emulated
engines (harness/emulated_engine.py, protocol stand-ins for vLLM, time-scaled; the daemon's
timings scaled with them: harness/fleet_plan.py), the real rollout client (trainer/rollout.py)
sends an RL-shaped workload through them, and faults from harness/fault_clock.py strike at their
scaled times. The policy alone decides whether to wait or to run short: nothing here waits for
a whole fleet.

A step: round start -> the round's requests (one long tail) -> round end -> training (a sleep of
train_s, scaled) -> an emulated push of the next version into every routable engine (the
emulated engine's weight-transfer routes, announced to the daemon as pushes are) -> that version
published with a checkpoint, from which the daemon reloads every engine the push missed (a
restarted one, a spare with spares_sync = "publish"). A round whose requests cannot all be
answered is lost and run again: every run does the same work.

What the ledger reads is observed from outside: every poll_s the daemon's status (routable, a
spare in STANDBY) and each emulated engine's /emulator/state (dead, hung, poisoned); the faults
with the times they were injected; the daemon's restarts and their causes from its log; each
sample checked token for token against what the weights of its round's version generate (the
emulated engine's tokens are a function of the context and the weights held), so a sample made
with other weights is stale whatever any engine reported.

Not in the loop: a router's traffic (the rollout client picks engines itself from the daemon's
routable list; with `router` the daemon spawns and feeds vllm-router, so its admin calls load the
daemon as they would, but no request goes through it) and a trainer agent (the published checkpoint is the daemon's way to bring a restarted
engine to the version).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import struct
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

from vime.supervisor.tasks import wait_event

from . import emulated_engine
from .emulated_model import PARAMETERS, Vocab, delay_quantile, generate
from .fault_clock import ScheduledFault
from .fleet_plan import (LAG_QUANTILE, Observed, Policy, Workload, daemon_tables, histogram_quantile, intervals_of,
                         invalid, lag_histogram, per_bucket, prompt_ids, restarts_from, round_lengths, serving_intervals)
from .goodput_ledger import Injection, Piece, RunRecord, Sample, async_sample
from .local_daemon import Daemon, standin_model, standin_python, write_config

MUTATIONS = ("stale", "false-restart")


@dataclass
class Outcome:
    record: RunRecord
    invalid: str | None                     # why the run is not to be reported; None: valid
    lag_p99_s: float
    delay_p99_s: float
    intervals: dict[str, float]
    daemon_config: dict[str, dict[str, Any]]
    faults_injected: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)   # what went wrong in the run itself
    # the two histograms behind the p99s: upper bound (s) -> count in that bucket alone
    lag_hist: dict[str, float] = field(default_factory=dict)
    delay_hist: dict[str, int] = field(default_factory=dict)
    updates: list[dict[str, Any]] = field(default_factory=list)   # async: the in-flight updates
    samples_cut: dict[str, int] = field(default_factory=dict)     # async: samples continued, spanning versions


def _checkpoint(folder: Path, model: Path) -> Path:
    """A checkpoint the daemon accepts (config.json and one safetensors file with an empty
    tensor), standing for the trained weights: the emulated reload costs model_bytes at the
    reload bandwidth whatever it reads."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text((model / "config.json").read_text())
    header = json.dumps({"w": {"dtype": "BF16", "shape": [0], "data_offsets": [0, 0]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return folder


class FleetRun:
    def __init__(self, w: Workload, policy: Policy, schedule: Sequence[ScheduledFault], seed: int, tmp: Path,
                 mutation: str | None = None, say: Any = print, router: bool = False):
        if mutation is not None and mutation not in MUTATIONS:
            raise ValueError(f"unknown mutation {mutation!r}; known: {', '.join(MUTATIONS)}")
        self.w, self.policy, self.seed, self.tmp, self.mutation, self.say = w, policy, seed, tmp, mutation, say
        self.router = router
        self.schedule = list(schedule) if policy.faults else []
        self.names = [f"e{i}" for i in range(w.engines + policy.spares)]
        self.observed = {n: Observed() for n in self.names}
        self.injections: list[Injection] = []
        self.injected: list[dict[str, Any]] = []
        self.problems: list[str] = []
        self.daemons: list[Daemon] = []
        self.pids: dict[str, int] = {}
        self.status: dict[str, Any] = {}
        self.delays: dict[tuple[str, int], tuple[list[float], list[int]]] = {}
        self.lag: dict[float, float] = {}
        self._lag_last: dict[float, float] = {}
        self.samples: list[Sample] = []
        self.generated = self.discarded = 0
        self.rounds = self.rounds_lost = 0
        self.published = 0
        self.stale_regenerated = 0
        self.updates: list[dict[str, Any]] = []  # async: each in-flight update's waves, seconds, failures
        self.pieces: dict[str, int] = {}  # async: samples continued, and spanning versions
        self.publishes: list[tuple[float, int]] = []  # (wall time its publish began, version)

    # -- set-up -------------------------------------------------------------------------------

    def _config(self) -> Path:
        w, tmp = self.w, self.tmp
        model = standin_model(tmp / "model")
        self.model = model
        self.ckpt = _checkpoint(tmp / "ckpt", model)
        python = standin_python(tmp, Path(emulated_engine.__file__))
        (tmp / "faults").mkdir(exist_ok=True)
        overrides: dict[tuple[str, str], float] = {}
        args = ["--time-scale", str(w.scale), "--param", f"seqs_per_request={w.seqs_per_request}",
                "--dump-params", str(tmp / "params.json")]
        per: dict[str, list[str]] = {n: ["--fault-file", str(tmp / "faults" / n)] for n in self.names}
        warmup: dict[str, Any] = {}
        if self.mutation == "stale":  # one engine reports the versions it is given but keeps its weights
            per["e0"] += ["--fault", "lie-version"]
        elif self.mutation == "false-restart":
            # A batch of the round's size compiles (a shape the one-request warm-up never ran),
            # judged by a counters-only rule: busy excused for a moment only.
            args += ["--fault", f"slow-batch-at={w.samples_per_engine}", "--param", "first_batch_s=300"]
            overrides[("health_check", "max_busy")] = 0.05
            warmup = {"requests": 1}
        self.tables = daemon_tables(w, self.policy, overrides=overrides)
        # One range for all of the run's ports (the engines', then the daemon's metrics, then
        # the router's two): ranges picked apart at random could overlap, nothing binding them yet.
        base = emulated_engine.free_port_range(len(self.names) + 3)
        self.metrics_port = base + len(self.names)
        sup = {"runtime_dir": str(tmp / "run"), "log_dir": str(tmp / "logs"), "python": str(python),
               "metrics_address": f"127.0.0.1:{self.metrics_port}", **self.tables["supervisor"]}
        sections: dict[str, dict[str, Any]] = {"supervisor": sup, "health_check": self.tables["health_check"],
                                               "restart": self.tables["restart"], "weights": self.tables["weights"],
                                               "engine_defaults": {"args": args}}
        if warmup:
            sections["warmup"] = warmup
        if self.router:  # the daemon spawns vllm-router and keeps its list; no request goes through it
            from .router_proc import VIME_FLAGS

            rport = self.metrics_port + 1
            pport = rport + 1
            self.config_router_url = f"http://127.0.0.1:{rport}"
            sections["router"] = {"url": self.config_router_url, "spawn": True,
                                  "args": [*VIME_FLAGS, "--prometheus-host", "127.0.0.1", "--prometheus-port",
                                           str(pport)]}
        self.urls = {n: f"http://127.0.0.1:{base + i}" for i, n in enumerate(self.names)}
        return write_config(tmp / "sup.toml", engines=[
            {"name": n, "model": str(model), "served_model_name": "tiny", "port": base + i, "args": per[n]}
            for i, n in enumerate(self.names)], **sections)

    # -- observing ----------------------------------------------------------------------------

    async def _observe(self, session: Any, client: Any) -> None:
        tick = 0
        while True:
            t = time.time()
            try:
                st = await client.status()
                self.status = st
                for e in st["engines"]:
                    if e.get("pid"):
                        self.pids[e["name"]] = e["pid"]
                proc = (st.get("router") or {}).get("process") or {}
                if proc.get("pid"):
                    self.pids["router"] = proc["pid"]
            except Exception:  # the daemon is away (killed, restarting): its last answer stands
                st = self.status

            states = await asyncio.gather(*(self._engine_state(session, n) for n in self.names))
            listed = {e["name"]: e for e in st.get("engines", ())}
            for name, s in zip(self.names, states):
                if s is not None and self.pids.get(name) not in (None, s.get("pid")):
                    s = None  # another process on this engine's port: not this run's engine
                healthy = s is not None and not (s["dead"] or s["hung"] or s["poisoned"])
                e = listed.get(name, {})
                self.observed[name].points.append((t, healthy and bool(e.get("routable")),
                                                   healthy and e.get("state") == "STANDBY"))
                if s is not None and "sched_delay" in s:
                    d = s["sched_delay"]
                    self.delays[(name, s["pid"])] = (d["le"], d["counts"])
            if tick % max(1, round(2.0 / self.w.poll_s)) == 0:
                await self._read_lag(session)
            tick += 1
            await asyncio.sleep(max(0.0, self.w.poll_s - (time.time() - t)))

    async def _engine_state(self, session: Any, name: str) -> dict | None:
        """One engine as observed: {"dead", "hung", "poisoned"} (and "sched_delay", "pid" where
        the engine says), None when unknown. Here the emulated engine's /emulator/state; a
        subclass observes real engines from outside (harness/fleet_real.py)."""
        import aiohttp

        # Kept-alive connections (a fleet polled on new ones costs the host more CPU than the
        # workload); a connection a restart broke is retried once on a new one.
        for _ in range(2):
            try:
                async with session.get(self.urls[name] + "/emulator/state",
                                       timeout=aiohttp.ClientTimeout(total=max(1.0, 4 * self.w.poll_s))) as r:
                    return await r.json() if r.status == 200 else None
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                continue
            except Exception:
                return None
        return None

    async def _read_lag(self, session: Any) -> None:
        try:
            async with session.get(f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
                now = lag_histogram(await r.text())
        except Exception:
            return
        if not now:
            return
        last = self._lag_last
        restarted = now.get(float("inf"), 0) < last.get(float("inf"), 0)
        for le, n in now.items():
            self.lag[le] = self.lag.get(le, 0.0) + (n if restarted else n - last.get(le, 0.0))
        self._lag_last = now

    # -- faults -------------------------------------------------------------------------------

    def _kill(self, name: str) -> None:
        pid = self.pids.get(name)
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    async def _emulator_fault(self, session: Any, name: str, fault: str) -> str | None:
        """None when the fault landed (or the engine could not be reached: already down); the
        name when another process on the engine's port refused it (409: not the daemon's pid)."""
        # The pid the daemon gave for the engine: whatever else answers on its port (a run
        # beside this one that picked the same ports) refuses the fault.
        with contextlib.suppress(Exception):
            async with session.post(self.urls[name] + "/emulator/fault",
                                    json={"fault": fault, "pid": self.pids.get(name)}) as r:
                await r.read()
                return name if r.status == 409 else None
        return None

    async def _inject(self, session: Any, t0: float, stop: asyncio.Event) -> None:
        """Strike the schedule's faults on the clock until `stop` is set at the work's end. A
        strike under way then (a hang's or a poisoned push's request, a daemon's restart) ends and
        is recorded: it began inside the run, and the daemon's answer to it is counted."""
        for f in self.schedule:
            if await wait_event(stop, max(0.0, t0 + f.wall_s(self.w.scale) - time.time())):
                return
            names = tuple(f"e{i}" for i in f.engines)
            at = time.time()
            if f.kind in ("kill", "node"):
                for n in names:
                    self._kill(n)
            elif f.kind == "crash-start":
                for n in names:
                    (self.tmp / "faults" / n).write_text("crash-at-start\n")
                    self._kill(n)
            refused: list[str | None] = []
            if f.kind == "hang":
                refused = await asyncio.gather(*(self._emulator_fault(session, n, "hang") for n in names))
            elif f.kind == "push":  # a push that failed midway: the engine left half-loaded
                refused = await asyncio.gather(*(self._emulator_fault(session, n, "poison") for n in names))
            elif f.kind == "daemon":
                d = self.daemons[-1]
                d.killed_by_us = True
                d.proc.kill()
                await asyncio.to_thread(d.proc.wait)
                await asyncio.sleep(self.w.wall(1.0))
                self.daemons.append(Daemon(self.cfg))
            self.injections.append(Injection(at=at, kind=f.kind, engines=names))
            self.injected.append({"seq": f.seq, "kind": f.kind, "engines": list(names), "at_engine_s": round(f.at_s, 3),
                                  "wall_offset_s": round(at - t0, 3), "refused": [n for n in refused if n]})

    # -- the workload ---------------------------------------------------------------------------

    def _push_wall(self) -> tuple[int, float]:
        """(the bytes one engine receives, the wall seconds a push of them takes)."""
        nbytes = int(PARAMETERS["model_bytes"].value)
        return nbytes, self.w.wall(nbytes / PARAMETERS["push_bytes_per_s"].value)

    async def _push_routes(self, session: Any, url: str, version: int) -> None:
        """The emulated push of `version` into the engine at `url`: its weight-transfer routes
        (raises what failed)."""
        import aiohttp

        nbytes, push_wall = self._push_wall()
        steps = [("/init_weight_transfer_engine", {"init_info": {"emulated": True}}),
                 ("/start_weight_update", {}),
                 ("/update_weights", {"update_info": {"emulated_bytes": nbytes}}),
                 ("/finish_weight_update", {"weight_version": str(version)})]
        for route, body in steps:
            async with session.post(url.rstrip("/") + route, json=body,
                                    timeout=aiohttp.ClientTimeout(total=10 * push_wall + 10.0)) as r:
                if r.status >= 400:
                    raise RuntimeError(f"{route}: {r.status} {(await r.text())[:200]}")
                await r.read()

    async def _push_and_publish(self, session: Any, client: Any, version: int) -> None:
        routable = (await client.routable_engines())["engines"]
        names = [e["name"] for e in routable]
        nbytes, push_wall = self._push_wall()
        failed: dict[str, str] = {}
        push_id = None
        if names:
            push_id = await client.push_begin(version, names, nbytes, 10 * push_wall + 10.0)

        async def one(e: Mapping[str, Any]) -> None:
            try:
                await self._push_routes(session, str(e["url"]), version)
            except Exception as ex:
                failed[e["name"]] = str(ex) or type(ex).__name__
        await asyncio.gather(*(one(e) for e in routable))
        if push_id is not None:
            with contextlib.suppress(Exception):  # a daemon restarted meanwhile no longer knows the push
                await client.push_end(push_id, not failed, failed or None)
        await self._publish(client, version)

    async def _publish(self, client: Any, version: int) -> None:
        """`version` published with the checkpoint, from which the daemon reloads every engine
        the push missed; the time it began kept (a sample returned after it is judged against it)."""
        self.publishes.append((time.time(), version))
        await client.publish_weights(version, checkpoint=str(self.ckpt))
        self.published = version

    def _check(self, result: Any, prompt: list[int], required: int) -> int:
        """The version whose weights made this sample's tokens (-1: none of the run's)."""
        toks = list(result.token_ids or ())
        for v in [required, *range(required - 1, 0, -1)]:
            if generate(prompt, len(toks), str(v), self.choices) == toks:
                return v
        return 0 if generate(prompt, len(toks), "default", self.choices) == toks else -1

    def _requests(self, rnd: int) -> tuple[list[int], list[list[int]]]:
        """Step `rnd`'s requests (the same in every run of the seed): output lengths, prompts."""
        lengths = round_lengths(self.seed, rnd, self.w)
        return lengths, [prompt_ids(self.seed, rnd, i, self.w, self.choices) for i in range(len(lengths))]

    async def _send(self, prompts: list[list[int]], lengths: list[int]) -> list[Any]:
        return await asyncio.gather(*(self.rollout.complete(p, max_tokens=n, temperature=1.0, ignore_eos=True)
                                      for p, n in zip(prompts, lengths)), return_exceptions=True)

    def _tally(self, rnd: int, results: list[Any]) -> bool:
        """Count a round's tokens; False (the round lost, its tokens discarded) when a request
        could not be answered."""
        ok = [r for r in results if not isinstance(r, BaseException)]
        for r in ok:
            self.generated += r.n_tokens + r.tokens_regenerated
            self.discarded += r.tokens_regenerated
        if len(ok) < len(results):
            self.rounds_lost += 1
            self.discarded += sum(r.n_tokens for r in ok)
            errs = {type(x).__name__ + ": " + str(x)[:120] for x in results if isinstance(x, BaseException)}
            self.say(f"    round {rnd} lost ({len(results) - len(ok)} requests unanswered: {sorted(errs)[:2]})")
            return False
        return True

    async def _round(self, client: Any, rnd: int) -> bool:
        """One round's requests; False when the round is lost (a request could not be answered)."""
        lengths, prompts = self._requests(rnd)
        self.rounds += 1
        attempt = self.rounds
        required = self.published
        with contextlib.suppress(Exception):
            await client.start_round(attempt)
        results = await self._send(prompts, lengths)
        with contextlib.suppress(Exception):
            await client.end_round(attempt)
        if not self._tally(rnd, results):
            return False
        for res, p in zip(results, prompts):  # every request answered, in order
            self.samples.append(Sample(version=self._check(res, p, required), expected=required))
        return True

    def _rollout_client(self, client: Any) -> Any:
        """The rollout client of this run: its timings scaled with the engines'."""
        from vime.trainer.rollout import RolloutClient

        w = self.w
        return RolloutClient(client, max_attempts=8, request_timeout=max(60.0, 40 * w.wall(w.restart_s)),
                             refresh_interval=max(0.5, w.wall(10.0)), max_concurrency=10_000,
                             backoff_initial=max(0.01, w.wall(0.5)), backoff_max=max(0.1, w.wall(10.0)),
                             cooldown=max(0.1, w.wall(5.0)), model="tiny",
                             continue_partial=self.policy.continue_partial)

    async def _workload(self, session: Any, client: Any) -> None:
        self.rollout = self._rollout_client(client)
        await self.rollout.start()
        try:
            await self._push_and_publish(session, client, 1)
            await self._steps(session, client)
        finally:
            self.stale_regenerated = self.rollout.stats.stale_samples
            await self.rollout.aclose()

    async def _steps(self, session: Any, client: Any) -> None:
        """Sync mode: round, training, push and publish, step after step."""
        w = self.w
        for rnd in range(1, w.rounds + 1):
            while not await self._round(client, rnd):
                await self._until_routable(client)  # lost: run it again once an engine serves
            self.say(f"    round {rnd} done at +{time.time() - self.t0:.1f} s")
            await asyncio.sleep(w.wall(w.train_s))
            await self._push_and_publish(session, client, rnd + 1)

    async def _until_routable(self, client: Any) -> None:
        """Until an engine serves (the policy decides when that is)."""
        while not (await self._routable(client)):
            await asyncio.sleep(self.w.poll_s)

    async def _routable(self, client: Any) -> int:
        try:
            return len((await client.routable_engines())["engines"])
        except Exception:
            return 0

    # -- the run ------------------------------------------------------------------------------

    async def run(self, ready_within: float) -> Outcome:
        import aiohttp

        from vime.supervisor.client import AsyncSupervisorClient

        self.cfg = self._config()
        self.choices = Vocab(str(self.model)).choices
        t_launch = time.time()
        self.daemons.append(Daemon(self.cfg))
        sock = self.tmp / "run" / "supervisor.sock"
        client = AsyncSupervisorClient(str(sock), connect_timeout=30, timeout=60)
        tasks: list[asyncio.Task] = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                         trust_env=False) as session, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trust_env=False) as watch:
            try:
                while not sock.exists():
                    if self.daemons[0].proc.poll() is not None:
                        raise RuntimeError(f"the daemon exited: {self.daemons[0].raw[-3:]}")
                    await asyncio.sleep(0.05)
                tasks.append(asyncio.ensure_future(self._observe(watch, client)))
                while await self._routable(client) < self.w.engines:
                    if time.time() - t_launch > ready_within:
                        states = sorted(f"{e['name']}:{e.get('state')}" for e in self.status.get("engines", ())
                                        if not e.get("routable"))
                        raise RuntimeError(f"fewer than {self.w.engines} engines routable after {ready_within:g} s; "
                                           f"not routable: {', '.join(states[:12]) or 'no status read'}")
                    await asyncio.sleep(self.w.poll_s)
                t0 = time.time()
                self.t_ready = t0 - t_launch
                self.say(f"    {self.w.engines} engines routable after {self.t_ready:.1f} s")
                self.lag.clear()  # the loop lag over the workload, not the fleet's boot
                await self._read_lag(session)
                self.lag.clear()
                self.t0 = t0
                stop = asyncio.Event()
                inject = asyncio.ensure_future(self._inject(session, t0, stop))
                tasks.append(inject)
                await self._workload(session, client)
                t_end = time.time()
                # The clock strikes nothing after the last step: a fault then would be no part of
                # the run (left out of its injections), yet the daemon's restart of it would count,
                # unbacked: a false restart the bench made. Not cancelled: a strike under way is
                # finished and recorded.
                stop.set()
                await asyncio.gather(inject, return_exceptions=True)
                await asyncio.sleep(self.w.poll_s)  # one more observation after the end
                await self._read_lag(session)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for d in self.daemons:
                    if d.proc.poll() is None:
                        await asyncio.to_thread(d.terminate, 60)
                self._sweep()
                # the daemons' own lines, for a run whose folder is kept
                (self.tmp / "daemon.log").write_text("".join(line if line.endswith("\n") else line + "\n"
                                                             for d in self.daemons for line in d.raw))
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                self.problems.append(f"{t.get_name()}: {t.exception()!r}")
        return self._outcome(t_launch, t_end)

    def _sweep(self) -> None:
        """Kill what the daemons left (a daemon killed by a fault just before the end, not yet
        started again): every engine (and router) process group of this run's, known by its
        command line."""
        mark = str(self.tmp).encode()
        if self.router:
            mark_router = str(self.config_router_url).rsplit(":", 1)[1].encode()
        for name, pid in set(self.pids.items()):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
                ours = (b"vllm-router" in cmd and mark_router in cmd) if name == "router" else mark in cmd
            except OSError:
                continue
            if ours:
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)

    def _outcome(self, t_launch: float, t_end: float) -> Outcome:
        events = [ev for d in self.daemons for ev in d.events]
        restarts = restarts_from(events, lambda ev: datetime.fromisoformat(ev["timestamp"]).timestamp())
        record = RunRecord(
            policy=self.policy.name, seed=self.seed, target=self.w.engines, launched_at=t_launch, end=t_end,
            # faults the clock struck after the last step are no part of the run
            injections=[i for i in self.injections if i.at <= t_end], serving=serving_intervals(self.observed),
            restarts=restarts,
            samples=self.samples, tokens_generated=self.generated, tokens_discarded=self.discarded,
            rounds=self.rounds, rounds_lost=self.rounds_lost, spares=self.policy.spares, work_start=self.t0,
            spare_ready=serving_intervals(self.observed, spare=True), stale_regenerated=self.stale_regenerated)
        le: list[float] = []
        counts: list[int] = []
        for le_, c in self.delays.values():
            le = list(le_)
            counts = [a + b for a, b in zip(counts, c)] if counts else list(c)
        delay = delay_quantile(le, counts, LAG_QUANTILE) if counts else 0.0
        lag = histogram_quantile(self.lag, LAG_QUANTILE)
        ivals = intervals_of(self.w, self.tables, PARAMETERS["step_base_s"].value,
                             PARAMETERS["step_per_seq_s"].value)
        return Outcome(record=record, invalid=invalid(ivals, lag, delay), lag_p99_s=lag, delay_p99_s=delay,
                       intervals=ivals, daemon_config=self.tables,
                       faults_injected=[f for f in self.injected if f["wall_offset_s"] <= t_end - self.t0],
                       problems=self.problems, lag_hist=per_bucket(self.lag),
                       delay_hist={f"{b:g}": c for b, c in zip([*le, float("inf")], counts) if c},
                       updates=self.updates, samples_cut=dict(self.pieces))


class AsyncFleetRun(FleetRun):
    """The async workload (a policy in weights mode "async"), as trainer/rl_loop.py's
    AsyncRLLoop runs it: step k+1's requests stream while step k trains; each version then goes
    into the routable engines by an in-flight update (trainer/inflight.py: abort + continue, in
    waves keeping the policy's serving_fraction serving, each wave a push announced to the
    daemon) and is published with the checkpoint for the engines the update missed. The same
    steps and requests as the sync run of the seed, one version published per step, no round
    opened. Each sample is judged per piece (goodput_ledger.async_sample): every piece's tokens
    what the version its split claims makes from the prefix, its oldest within max_staleness of
    the version current when it was returned; a sample past the bound the rollout client
    regenerates (counted: stale_regenerated)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pieces.update(continued=0, spanning_versions=0)

    async def _steps(self, session: Any, client: Any) -> None:
        w = self.w
        pending: asyncio.Future | None = asyncio.ensure_future(self._batch(1))
        try:
            for rnd in range(1, w.rounds + 1):
                assert pending is not None
                while not await pending:  # lost: sent again once an engine serves, nothing beside it
                    await self._until_routable(client)
                    pending = asyncio.ensure_future(self._batch(rnd))
                pending = asyncio.ensure_future(self._batch(rnd + 1)) if rnd < w.rounds else None
                self.say(f"    step {rnd}'s samples in at +{time.time() - self.t0:.1f} s")
                await asyncio.sleep(w.wall(w.train_s))  # training step rnd while step rnd + 1 streams
                await self._update(session, client, rnd + 1)
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)

    async def _batch(self, rnd: int) -> bool:
        """Step `rnd`'s requests, no round opened; False when one could not be answered."""
        lengths, prompts = self._requests(rnd)
        self.rounds += 1
        results = await self._send(prompts, lengths)
        if not self._tally(rnd, results):
            return False
        self.samples.extend(self._judge(res, p) for res, p in zip(results, prompts))
        for res in results:  # how many samples an update or a fault cut, and how many span versions
            self.pieces["continued"] += len(res.splits) > 1
            self.pieces["spanning_versions"] += len({s.weight_version for s in res.splits}) > 1
        return True

    def _judge(self, result: Any, prompt: list[int]) -> Sample:
        """The sample by the async rule, against the version whose publish began last before it
        was returned."""
        from vime.trainer.rollout_types import SPAN_BRACKET

        current = max((v for t, v in self.publishes if t <= result.finished), default=0)
        pieces = [Piece(s.offset, s.tokens, s.weight_version, s.weight_version_end if s.span == SPAN_BRACKET else None)
                  for s in result.splits]
        return async_sample(prompt, list(result.token_ids or ()), pieces,
                            lambda ctx, n, v: generate(list(ctx), n, v, self.choices), current,
                            self.policy.max_staleness)

    async def _update(self, session: Any, client: Any, version: int) -> None:
        """`version` into the routable engines while requests stream (an in-flight update), then
        published with the checkpoint (the engines the update missed reload it)."""
        from vime.trainer.inflight import InFlightUpdate, waves

        await self.rollout.refresh(force=True)
        behind = [e for e in self.rollout.engines if e.weight_version != version]
        if behind:
            nbytes, push_wall = self._push_wall()
            try:  # too few engines to keep the floor: all at once, as AsyncRLLoop
                waves([e.name for e in behind], self.policy.serving_fraction)
                fraction = self.policy.serving_fraction
            except ValueError:
                fraction = 0.0

            async def push(engine: Any, v: int) -> None:
                await self._push_routes(session, engine.url, v)
            update = InFlightUpdate([self.rollout], push=push, engines=behind, serving_fraction=fraction,
                                    mode="abort", timeout=10 * push_wall + 10.0, nbytes=nbytes)
            try:
                done = await update.run(version, supervisor=client, publish=False)
                self.updates.append({"version": version, "waves": len(done.waves), "serving_min": done.serving_min,
                                     "seconds_max": max(done.seconds.values(), default=0.0), "failed": done.failed})
            except Exception as e:  # a refused announcement, the daemon away: the publish reloads them
                self.updates.append({"version": version, "error": f"{type(e).__name__}: {e}"[:300]})
        await self._publish(client, version)


def run(w: Workload, policy: Policy, schedule: Sequence[ScheduledFault], seed: int, tmp: Path, *,
        mutation: str | None = None, ready_within: float = 300.0, say: Any = print, router: bool = False) -> Outcome:
    """One run, in a fresh event loop; `tmp` holds its folders (the daemon's log among them).
    `router`: the daemon also spawns and feeds vllm-router (its list kept; no request sent through it)."""
    cls = AsyncFleetRun if policy.is_async else FleetRun
    return asyncio.run(cls(w, policy, schedule, seed, tmp, mutation, say, router).run(ready_within))
