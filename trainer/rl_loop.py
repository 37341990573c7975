"""The example RL loop, the file to copy: a tiny Llama trained on rollouts from vLLM engines
under the daemon (docs/getting-started.md).

    python -m vime.trainer.rl_loop --model DIR [--socket PATH] [--num-rollout 30] [debug flags]
    python -m vime.trainer.rl_loop --model DIR --cluster auto     # engines on many nodes (Ray)

Each step is one round: round start N -> rollouts (RolloutClient) -> round end N -> reward and
a GRPO-style update (trainer/rl.py) -> the new weights pushed into every routable engine -> the
version published. A ResyncAgent thread brings restarted engines to the published version.

With --async (AsyncRLLoop, below RLLoop; the daemon in [weights] mode = "async") there
are no rounds: the next batch streams while the trainer trains on the last one, and each step's
version reaches the engines by an in-flight update (trainer/inflight.py) before it is published.
A harness acts at a step's hook points by overriding them (harness/chaos.py injects faults
there): before_round, during_round, rollout_round, after_round, train_and_push, push_all, push_into,
after_run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from vime.supervisor.client import AsyncSupervisorClient, SupervisorClient, SupervisorError
from vime.supervisor.protocol import RUNNING_STATES, EngineStatus, State
from vime.supervisor.states import VersionRule, WeightsMode
from vime.trainer.dumps import (
    DumpFormatError, Sample, dump_path, load_rollout, read_header, save_rollout, template_error,
)
from vime.trainer.fingerprint import make_fingerprint
from vime.trainer.inflight import InFlightUpdate, waves
from vime.trainer.resync_agent import ResyncAgent, ResyncRecord
from vime.trainer.rl import PROMPTS, TARGET, Policy, StepStats, reward
from vime.trainer.rollout import RolloutClient, RolloutResult
from vime.trainer.rollout_types import Engine
from vime.trainer.trace import DaemonEventRecorder, Tracer

if TYPE_CHECKING:  # imported where it is used: it needs torch
    from vime.weight_sync.broadcast import FleetSender

WHOLE_STATES = frozenset(s.value for s in RUNNING_STATES)  # RUNNING, SUSPECT


@dataclass
class StepRecord:
    step: int
    round: int | None
    version: int | None             # the version rolled out with (None: replayed)
    samples: int
    reward_mean: float
    loss: float | None
    logprob_gap_max: float | None
    digest: str | None              # the policy's weights after the step
    engines: dict[str, int]          # answers per engine
    resent: int                      # requests that needed more than one attempt
    stale: int                       # answers from an engine listed at another version
    pushed: dict[str, str]           # engine -> "ok" / error, for this step's version
    seconds: float
    lost: bool = False
    error: str | None = None
    duplicates: int = 0              # samples of one logical request counted twice (must be 0)
    # Output tokens streamed by attempts that then failed (a fault cut them), of those kept in
    # a continued sample, and of those thrown away (the request started over): RolloutResult's.
    tokens_cut: int = 0
    tokens_reused: int = 0
    tokens_regenerated: int = 0
    continued: int = 0               # samples continued on another engine from their streamed tokens
    # --async only: samples left out of training because a token was more than max_staleness
    # versions behind the version trained from (`version`), and each trained sample's pieces'
    # versions (RolloutResult.splits, in token order).
    past_staleness: int = 0
    span_versions: list[list[Any]] = field(default_factory=list)


@dataclass
class Report:
    steps: list[StepRecord] = field(default_factory=list)
    final_version: int | None = None
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> state, version
    syncs: list[dict[str, Any]] = field(default_factory=list)         # the agent's pushes
    rounds_lost: int = 0
    stale_responses: int = 0
    seconds: float = 0.0
    stopped: str | None = None       # why the run stopped before its last step (None: it did not)
    signal: int | None = None        # the signal that stopped it (SIGINT, SIGTERM), if one did
    mode: str = "sync"               # "async" with --async
    max_staleness: int = 0           # the daemon's bound in force (0 in sync mode)
    updates: list[dict[str, Any]] = field(default_factory=list)  # --async: each in-flight update
    stale_regenerated: int = 0       # --async: samples the rollout client regenerated for staleness

    def as_dict(self) -> dict[str, Any]:
        return {"steps": [asdict(s) for s in self.steps],
                "final_version": self.final_version, "engines": self.engines, "syncs": self.syncs,
                "rounds_lost": self.rounds_lost, "stale_responses": self.stale_responses,
                "tokens_cut": sum(s.tokens_cut for s in self.steps),
                "tokens_reused": sum(s.tokens_reused for s in self.steps),
                "tokens_regenerated": sum(s.tokens_regenerated for s in self.steps),
                "requests_continued": sum(s.continued for s in self.steps),
                "seconds": self.seconds, "stopped": self.stopped, "signal": self.signal,
                "mode": self.mode, "max_staleness": self.max_staleness, "updates": self.updates,
                "samples_past_staleness": sum(s.past_staleness for s in self.steps),
                "stale_regenerated": self.stale_regenerated,
                "reward_first": self.steps[0].reward_mean if self.steps else None,
                "reward_last": self.steps[-1].reward_mean if self.steps else None}


class Rollouts(NamedTuple):
    """What one round gave: scored samples, the raw results, and whether the round was lost."""
    samples: list[Sample]
    results: list[RolloutResult]
    stale: int                       # answers from an engine listed at another version
    lost: bool = False
    error: str | None = None


# -- the parts that talk to the daemon -----------------------------------------------------


class EngineFatal(Exception):
    """An engine is FATAL (its start budget or flapping window is spent): with --stop-on-fatal
    no wait goes on for it."""


class DaemonView:
    """The daemon as the loop sees it: its engines and bounded waits on them. `stop` (set on
    SIGINT/SIGTERM) ends every wait at once; with `stop_on_fatal` a wait raises EngineFatal as
    soon as an engine is FATAL."""

    def __init__(self, client: SupervisorClient, stop: threading.Event | None = None, stop_on_fatal: bool = False):
        self.client = client
        self.stop = stop or threading.Event()
        self.stop_on_fatal = stop_on_fatal

    def engines(self) -> list[EngineStatus]:
        return self.client.status()["engines"]

    def fatal(self, engines: list[EngineStatus] | None = None) -> list[str]:
        """'name: reason' of every FATAL engine."""
        return [f"{e['name']} FATAL: {e.get('reason') or '?'}" for e in (engines or self.engines())
                if e["state"] == State.FATAL]

    def whole(self, version: int | None) -> bool:
        """Every engine serving the given version or kept as a warm spare (STANDBY: synced
        when it is promoted); a FATAL one too must be back."""
        return all(e["state"] == State.STANDBY
                   or e["state"] in WHOLE_STATES and (version is None or e.get("weight_version") == version)
                   for e in self.engines())

    def wait(self, pred, timeout: float, poll: float = 0.2) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stop.is_set():
            if pred():
                return True
            if self.stop_on_fatal and (fatal := self.fatal()):
                raise EngineFatal("; ".join(fatal))
            self.stop.wait(poll)
        return False if self.stop.is_set() else pred()

    def settle_syncs(self, timeout: float) -> bool:
        """In the gap: wait while an engine is ready but behind (STALE) or being synced, so
        the agent's push lands before the next round opens (an engine still booting is not
        waited for)."""
        behind = (State.STALE, State.SYNCING)
        return self.wait(lambda: not any(e["state"] in behind for e in self.engines()), timeout)


class Pusher:
    """Pushes each new version into the routable engines: all at once over one group
    (`push_many`, a FleetSender broadcast), or one engine over its own group (`push`, a
    WeightSender per URL: the resync of one engine, and the chaos harness's faulted push)."""

    def __init__(self, backend: str = "gloo", master_address: str | None = None):
        self.backend = backend
        self.master_address = master_address
        self.senders: dict[str, Any] = {}
        self.fleet: FleetSender | None = None  # one broadcast group into many engines, made on first use

    def push(self, url: str, tensors, version: int, *, pause_mode: str | None = "abort") -> str:
        """One version into one engine: "ok", "poisoned: ..." (it holds half a version) or
        "failed: ..." (it died or went away). pause_mode None: the caller paused the engine
        and resumes it (an in-flight update)."""
        from vime.weight_sync.sender import WeightSender

        self._leave_fleet(url)
        sender = self.senders.get(url) or self.senders.setdefault(
            url, WeightSender(url, backend=self.backend, master_address=self.master_address))
        sender.pause_mode = pause_mode  # the group is the engine's, whoever pauses it
        return self.push_with(sender, url, tensors, version)

    def push_many(self, urls: list[str], tensors, version: int, *,
                  announce: Callable[[list[str], int, float], None] | None = None) -> dict[str, str]:
        """One version into every engine in one broadcast: url -> outcome, as push() says it.
        A receiver that failed the broadcast costs only itself: the others are redone once
        over a new group. gloo only; backend "nccl" pushes one engine after the other."""
        if self.backend != "gloo":
            return {u: self.push(u, tensors, version) for u in urls}
        from vime.weight_sync.broadcast import FleetSender

        for url in urls:  # the engine's group is about to be replaced by the fleet's
            old = self.senders.pop(url, None)
            if old is not None:
                old.drop_group()  # local end only: a /shutdown would race the fleet's init
        if self.fleet is None:
            self.fleet = FleetSender(master_address=self.master_address)
        self.fleet.announce = announce  # (receivers, bytes, the push's bound): told to the daemon
        out: dict[str, str] = {}
        for url, r in self.fleet.push(urls, tensors, version).items():
            if r.ok:
                out[url] = "ok"
            elif r.status == "poisoned":
                out[url] = f"poisoned: {r.error}"
            else:  # unreachable (the daemon sees it itself) or intact on its old weights
                out[url] = f"failed: {r.status}: {r.error}"
        return out

    def push_with(self, sender, url: str, tensors, version: int) -> str:
        """One push through `sender`, its outcome as push() says it."""
        from vime.weight_sync.errors import PoisonedEngine, WeightSyncError

        self._leave_fleet(url)
        try:
            sender.push(tensors, version)
            return "ok"
        except PoisonedEngine as e:
            self.senders.pop(url, None)
            return f"poisoned: {e}"
        except WeightSyncError as e:  # it died or went away: the daemon sees that itself
            self.senders.pop(url, None)
            return f"failed: {e}"

    def _leave_fleet(self, url: str) -> None:
        """A per-engine group replaces the fleet's in that engine: the fleet must rebuild, or
        its next broadcast would wait on a rank that is no longer there."""
        if self.fleet is not None and url.rstrip("/") in self.fleet.members:
            self.fleet.drop_group()

    def drop(self, url: str) -> None:
        """Close and forget the sender (its process group) of one engine."""
        old = self.senders.pop(url, None)
        if old is not None:
            old.close()
        self._leave_fleet(url)

    def close(self) -> None:
        for s in self.senders.values():
            s.close()
        self.senders.clear()
        if self.fleet is not None:
            self.fleet.close()
            self.fleet = None


# -- the loop ----------------------------------------------------------------------------


class RLLoop:
    """The loop. `run()` runs every step. A harness acts by overriding the methods under "hook
    points" (no-ops or the plain behaviour here), `rollout_round` and `train_and_push`."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.policy = Policy(args.model, lr=args.lr, seed=args.seed)
        self.report = Report()
        self.published: int | None = None  # the version the daemon has as current
        self.base = 0                      # published version = base + policy.version
        self.next_round = 1
        self.stop = threading.Event()       # set by SIGINT/SIGTERM (or by a caller): every wait ends
        # Set while a live run is on (_run_steps). The client is open_client()'s: a
        # SupervisorClient, or with --cluster a ClusterClient (the same verbs, and more).
        self.client: Any = None
        self.view: DaemonView
        self.rollout: RolloutClient | None = None
        self.agent: ResyncAgent | None = None
        self.pusher: Pusher
        self.tracer: Tracer
        self.recorder: DaemonEventRecorder  # the daemon's events, for the trace

    def log(self, msg: str) -> None:
        print(f"[rl {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    # -- hook points -------------------------------------------------------------------------

    async def before_round(self, step: int) -> None:
        """In the gap, before the step's round opens."""

    async def during_round(self, step: int, rnd: int, gather: asyncio.Future) -> None:
        """Runs beside the round's rollouts (`gather`, not to be awaited here: it may be
        cancelled); the round ends once both are done."""

    async def after_round(self, step: int, rnd: int | None) -> None:
        """In the gap, after the round ended and before training."""

    def push_into(self, engine: dict[str, Any], tensors, version: int) -> str:
        """One engine's push of a new version (in a worker thread, under the policy's lock)."""
        return self.pusher.push(engine["url"], tensors, version)

    def enough(self, step: int) -> bool:
        """After each step: end the run here, as if --num-rollout were reached (a run by the
        clock: the soak's --hours)."""
        return False

    def after_run(self) -> None:
        """Once the run is over and the event recorder stopped (`recorder.events` complete)."""

    async def generate(self, step: int, prompts: list[str]) -> list[RolloutResult]:
        """The round's requests, one result per prompt in order (a harness may shape them)."""
        assert self.rollout is not None, "generate() runs inside run(), after the client started"
        return await self.rollout.gather(prompts, **self.sampling())

    # -- samples ---------------------------------------------------------------------------

    def prompts(self) -> list[str]:
        a = self.args
        chosen = [PROMPTS[i % len(PROMPTS)] for i in range(a.rollout_batch_size)]
        return [p for p in chosen for _ in range(a.n_samples_per_prompt)]

    def sampling(self) -> dict[str, Any]:
        return {"max_tokens": self.args.rollout_max_response_len, "temperature": self.args.rollout_temperature,
                "logprobs": 1}

    def score(self, results, prompts) -> list[Sample]:
        return [Sample.from_rollout(r, prompt=p, reward=reward(r.text, self.args.target), group=p)
                for r, p in zip(results, prompts)]

    # -- entry -----------------------------------------------------------------------------

    def run(self) -> Report:
        """The whole run. SIGINT/SIGTERM (when called from the main thread) stop it: the report
        comes back with `stopped` and `signal` set, as it does when it stops for lost rounds or
        a FATAL engine."""
        t0 = time.monotonic()
        try:
            if self.args.debug_train_only:
                self._train_only()
            else:
                asyncio.run(self._run_live())
        except (asyncio.CancelledError, KeyboardInterrupt):
            if self.report.signal is None:
                raise
            self.report.stopped = f"interrupted by {signal.Signals(self.report.signal).name}"
        finally:
            self.report.seconds = time.monotonic() - t0
            (self.out / "summary.json").write_text(json.dumps(self.report.as_dict(), indent=1, default=str))
        return self.report

    def _train_only(self) -> None:
        a = self.args
        if not a.load_debug_rollout_data:
            raise SystemExit("--debug-train-only needs --load-debug-rollout-data PATH_WITH_{rollout_id}")
        for step in range(1, a.num_rollout + 1):
            t0 = time.monotonic()
            dump = load_rollout(dump_path(a.load_debug_rollout_data, step))
            stats = self.policy.train_step(dump.samples)
            self.record(step, None, None, Rollouts(dump.samples, [], 0), stats, {}, t0)

    def record(self, step: int, rnd: int | None, version: int | None, out: Rollouts,
               stats: StepStats | None, pushed: dict[str, str], t0: float) -> StepRecord:
        samples = out.samples
        engines: dict[str, int] = {}
        ids = [s.metadata["request_id"] for s in samples if s.metadata.get("request_id")]
        for s in samples:
            engines[s.engine or "?"] = engines.get(s.engine or "?", 0) + 1
        rec = StepRecord(step=step, round=rnd, version=version, samples=len(samples),
                         reward_mean=(sum(s.reward or 0 for s in samples) / len(samples)) if samples else 0.0,
                         loss=stats.loss if stats else None,
                         logprob_gap_max=stats.logprob_gap_max if stats else None,
                         digest=self.policy.digest() if stats else None, engines=engines,
                         resent=sum(1 for r in out.results if len(r.attempts) > 1), stale=out.stale, pushed=pushed,
                         seconds=time.monotonic() - t0, lost=out.lost, error=out.error,
                         duplicates=len(ids) - len(set(ids)),
                         tokens_cut=sum(r.tokens_before_fault for r in out.results),
                         tokens_reused=sum(r.tokens_reused for r in out.results),
                         tokens_regenerated=sum(r.tokens_regenerated for r in out.results),
                         continued=sum(r.continued for r in out.results))
        self.report.steps.append(rec)
        gap = "" if rec.logprob_gap_max is None else f" logprob gap {rec.logprob_gap_max:.1e}"
        self.log(f"step {step}: reward {rec.reward_mean:.2f}{gap} from {engines or '-'}"
                 + (f", {rec.resent} re-sent" if rec.resent else "")
                 + (f" (tokens cut by faults {rec.tokens_cut}: reused {rec.tokens_reused} in {rec.continued} "
                    f"continued request(s), regenerated {rec.tokens_regenerated})" if rec.tokens_cut else "")
                 + (f", LOST: {out.error}" if out.lost else ""))
        return rec

    # -- the trainer's connections ---------------------------------------------------------

    async def connect(self) -> None:
        """The rollout client and the resync agent: what a trainer process holds open."""
        a = self.args
        self.rollout = RolloutClient(self.async_client(), model=a.served_model_name,
                                     continue_partial=a.continue_partial)
        await self.rollout.start()
        if not a.debug_rollout_only:
            await asyncio.to_thread(self.start_agent)

    def open_client(self) -> Any:
        """The blocking client of the fleet: the local daemon's socket, or with --cluster every
        node's daemon through the cluster client (vime.cluster; the same verbs)."""
        a = self.args
        if not a.cluster:
            return SupervisorClient(a.socket)
        from vime.cluster import ClusterClient

        nodes = a.cluster_nodes.split(",") if a.cluster_nodes else None
        return ClusterClient(nodes, socket_path=a.socket, min_healthy=a.cluster_min_healthy, ray_address=a.cluster,
                             router_url=a.cluster_router_url)

    def async_client(self) -> Any:
        """The rollout client's view of the fleet (the same agents as open_client's, with --cluster)."""
        return self.client.aio if self.args.cluster else AsyncSupervisorClient(self.args.socket)

    def agent_client(self) -> Any:
        """The sync agent's own client: its stop() ends only its own event streams."""
        return self.client.sibling() if self.args.cluster else SupervisorClient(self.args.socket)

    def start_agent(self) -> None:
        self.agent = ResyncAgent(self.agent_client(), self._agent_weights, lock=self.policy.lock,
                                 on_sync=self._on_sync, master_address=self.args.rendezvous_address).start()

    def stop_agent(self) -> None:
        if self.agent is not None:
            self.agent.stop()
            self.agent = None

    async def disconnect(self) -> None:
        self.stop_agent()
        if self.rollout is not None:
            await self.rollout.aclose()
            self.rollout = None

    def _agent_weights(self):
        """The ResyncAgent's view: the published version and its tensors, or no version while
        the trainer's tensors are ahead of what the daemon has (a step, or a publish that failed)."""
        current = self.base + self.policy.version
        return (self.published if self.published == current else None), self.policy.named_tensors()

    def _on_sync(self, r: ResyncRecord) -> None:
        self.report.syncs.append({"engine": r.engine, "version": r.version, "ok": r.ok,
                                  "seconds": round(r.seconds, 3), "error": r.error})

    # -- signals ---------------------------------------------------------------------------

    def _on_signal(self, signum: int, task: asyncio.Task) -> None:
        if self.stop.is_set():
            self.log(f"{signal.Signals(signum).name} again: already stopping (bounded)")
            return
        self.log(f"{signal.Signals(signum).name}: stopping the run (ending the round, closing connections)")
        self.report.signal = signum
        self.stop.set()
        task.cancel()

    def _catch_signals(self) -> list[tuple[int, Any]]:
        """SIGINT, SIGTERM and SIGHUP cancel the run (main thread only); what to restore after."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None  # called from the run's task
        saved: list[tuple[int, Any]] = []
        if threading.current_thread() is not threading.main_thread():
            return saved
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            saved.append((sig, signal.getsignal(sig)))
            loop.add_signal_handler(sig, self._on_signal, sig, task)
        return saved

    @staticmethod
    def _restore_signals(saved: list[tuple[int, Any]]) -> None:
        loop = asyncio.get_running_loop()
        for sig, old in saved:
            loop.remove_signal_handler(sig)
            signal.signal(sig, old if old is not None else signal.SIG_DFL)

    # -- the live run ----------------------------------------------------------------------

    def stop_reason(self) -> str | None:
        """Why the run must stop after this step, if it must."""
        lost = [s for s in self.report.steps if s.lost]
        if len(lost) > self.args.max_lost_rounds:
            return (f"{len(lost)} round(s) lost, more than --max-lost-rounds {self.args.max_lost_rounds} "
                    f"(step {lost[-1].step}: {lost[-1].error})")
        if self.view.stop_on_fatal and (fatal := self.view.fatal()):
            return "; ".join(fatal)
        return None

    async def _run_live(self) -> None:
        saved = self._catch_signals()
        try:
            await self._run_steps()
        finally:
            self._restore_signals(saved)

    async def _run_steps(self) -> None:
        a = self.args
        self.client = client = self.open_client()
        self.view = DaemonView(client, self.stop, stop_on_fatal=a.stop_on_fatal)
        status = client.status()
        if status.get("round_open"):
            # A trainer before us left its round open (it died mid-round): close it.
            self.log(f"round {status['round']} was left open by a previous trainer: ending it")
            client.end_round(status["round"])
        self.published = status.get("weight_version")
        self.next_round = (status.get("round") or 0) + 1
        self.tracer = Tracer()
        self.recorder = DaemonEventRecorder(client, self.tracer).start()
        self.pusher = Pusher(master_address=a.rendezvous_address)
        train = not a.debug_rollout_only
        try:
            await self.connect()
            if train and self.publish_first():
                # Another run published before us: the engines hold its weights. Ours go
                # out first as the next version, so every round below is on-policy.
                self.base = 0 if self.published is None else self.published + 1
                await asyncio.to_thread(self._locked_push_and_publish)
            try:
                for step in range(1, a.num_rollout + 1):
                    await self.step(step, train)
                    why = await asyncio.to_thread(self.stop_reason)
                    if why:
                        self.report.stopped = f"stopped after step {step}: {why}"
                        break
                    if self.enough(step):
                        break
            except EngineFatal as e:
                self.report.stopped = f"stopped: {e}"
            if self.report.stopped:
                self.log(self.report.stopped)
            elif train:
                self.log(f"waiting (in the gap) for every engine to be RUNNING on v{self.published}")
                view = self.view
                if not await asyncio.to_thread(view.wait, lambda: view.whole(self.published), a.final_wait):
                    self.log(f"not every engine is RUNNING on v{self.published} after {a.final_wait:g}s")
        finally:
            await self.disconnect()
            self.pusher.close()
            self.recorder.stop()
            self.after_run()
            self.tracer.write(self.out / "trace.json")
            self.tracer.save_summary(self.out / "long_tail.json")
            rep = self.report
            rep.final_version = self.published
            try:
                rep.engines = {e["name"]: {"state": e["state"], "weight_version": e.get("weight_version"),
                                           "restarts": e.get("restarts"), "pid": e.get("pid")}
                               for e in client.status()["engines"]}
            except SupervisorError as e:  # the daemon is gone: the report says so, the error stands
                self.log(f"could not read the engines' final state: {e}")
            rep.rounds_lost = sum(s.lost for s in rep.steps)
            rep.stale_responses = sum(s.stale for s in rep.steps)
            client.close()
            if a.cluster:
                client.shutdown()  # the node agents too

    def publish_first(self) -> bool:
        """Do our weights go out as a version before the first rollout? When another run
        published before us (the engines hold its weights)."""
        return self.published is not None

    # -- one step --------------------------------------------------------------------------

    async def step(self, step: int, train: bool) -> None:
        a = self.args
        t0 = time.monotonic()
        await self.before_round(step)
        rolled_with = self.published
        rnd = None
        if a.load_debug_rollout_data:
            dump = load_rollout(dump_path(a.load_debug_rollout_data, step))
            out = Rollouts(dump.samples, [], 0)
        else:
            rnd, out = await self.rollout_round(step)
        await self.after_round(step, rnd)
        if a.save_debug_rollout_data and out.samples:
            save_rollout(a.save_debug_rollout_data, step, out.samples, weight_version=self.published,
                         round=rnd, target=a.target)
        stats: StepStats | None = None
        pushed: dict[str, str] = {}
        if train and out.samples:
            with self.tracer.span(f"train step {step}"):
                stats, pushed = await asyncio.to_thread(self.train_and_push, step, out.samples)
        self.record(step, rnd, rolled_with if not a.load_debug_rollout_data else None, out, stats, pushed, t0)

    async def rollout_round(self, step: int) -> tuple[int, Rollouts]:
        """One round of rollouts. The round is ended whatever happens inside it; an error
        inside it loses the round (counted, and it may stop the run)."""
        rnd = self.next_round
        self.next_round += 1
        a = self.args
        prompts = self.prompts()
        client = self.client
        await asyncio.to_thread(client.start_round, rnd)
        gather = beside = None
        results, lost, error = [], False, None
        t_round = time.time()
        try:
            assert self.rollout is not None  # connect() opened it
            await self.rollout.refresh(force=True)
            gather = asyncio.ensure_future(self.generate(step, prompts))
            beside = asyncio.ensure_future(self.during_round(step, rnd, gather))
            try:
                results = await asyncio.wait_for(asyncio.shield(gather), a.round_timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"the round's rollouts did not end within --round-timeout "
                                   f"{a.round_timeout:g}s") from None
        except Exception as e:  # noqa: BLE001 - the round is lost; it is counted (and may stop the run)
            lost, error = True, f"{type(e).__name__}: {e}"
        finally:
            if gather is not None and not gather.done():  # cancelled (Ctrl-C): abandon the requests
                gather.cancel()
            if beside is not None:
                try:
                    await beside
                except Exception as e:  # noqa: BLE001 - a harness's failure does not lose the round
                    self.log(f"during_round of step {step} failed: {type(e).__name__}: {e}")
            await asyncio.to_thread(client.end_round, rnd)
        self.tracer.add_round(rnd, t_round, time.time(), step=step,
                              tokens_cut=sum(r.tokens_before_fault for r in results),
                              tokens_reused=sum(r.tokens_reused for r in results),
                              tokens_regenerated=sum(r.tokens_regenerated for r in results))
        for r in results:
            # A request cut by a fault: its pieces and what was thrown away, on its span.
            cut: dict[str, Any] = {} if not r.tokens_before_fault else {
                "tokens_reused": r.tokens_reused, "tokens_regenerated": r.tokens_regenerated,
                "splits": [f"{s.engine}@{s.weight_version} [{s.offset}+{s.tokens}] {s.outcome}" for s in r.splits],
                "started_over": [f"{x.engine}: {x.tokens} tokens: {x.reason}" for x in r.started_over]}
            self.tracer.add_request(r, round=rnd, **cut)
        stale = sum(1 for r in results if self.published is not None and r.weight_version != self.published)
        return rnd, Rollouts(self.score(results, prompts) if results else [], results, stale, lost, error)

    # -- the gap: train, push, publish -----------------------------------------------------

    def train_and_push(self, step: int, samples: list[Sample]) -> tuple[StepStats, dict[str, str]]:
        with self.policy.lock:  # the agent pushes only between steps
            stats = self.policy.train_step(samples)
            pushed = self.push_and_publish()
        self.view.settle_syncs(self.args.sync_wait)
        return stats, pushed

    def _locked_push_and_publish(self) -> dict[str, str]:
        with self.policy.lock:
            return self.push_and_publish()

    def push_all(self, engines: list[dict[str, Any]], tensors, version: int) -> dict[str, str]:
        """The step's push into every routable engine: one broadcast over one group
        (Pusher.push_many), announced to the daemon (POST /v1/pushes) so each receiver's pause
        is excused for exactly the push's bound, and ended with the receivers that failed.
        name -> outcome, as push_into says it."""
        if not engines:
            return {}
        name_of = {e["url"].rstrip("/"): e["name"] for e in engines}
        announced: list[str] = []

        def announce(urls: list[str], nbytes: int, bound_s: float) -> None:
            try:
                push = self.client.push_begin(version, [name_of[u] for u in urls], nbytes, bound_s)
            except SupervisorError as e:  # the push goes on; a pause is excused up to sync_timeout
                self.log(f"could not announce the push of v{version}: {e}")
                return
            announced.append(push)
            # --cluster: a node that did not take it leaves its receivers excused up to sync_timeout only
            for name, why in sorted(getattr(push, "unannounced", {}).items()):
                self.log(f"push of v{version} into {name}: {why}")

        outcomes: dict[str, str] = {}
        try:
            by_url = self.pusher.push_many(list(name_of), tensors, version, announce=announce)
            outcomes = {name_of[u]: o for u, o in by_url.items()}
        finally:
            for push in announced:
                failed = {n: o for n, o in outcomes.items() if o != "ok"}
                try:
                    self.client.push_end(push, ok=bool(outcomes) and not failed, failed=failed or None)
                except SupervisorError as e:  # expired meanwhile: the daemon ended it itself
                    self.log(f"could not end the push of v{version}: {e}")
        return outcomes

    def push_and_publish(self, checkpoint: Path | None = None) -> dict[str, str]:
        """Push the policy's version into every routable engine (one broadcast), then publish
        it. An engine whose push failed midway is reported poisoned (the daemon restarts it)."""
        version = self.base + self.policy.version
        tensors = self.policy.named_tensors()
        pushed = self.push_all(self.client.routable_engines()["engines"], tensors, version)
        for name, outcome in pushed.items():
            if outcome.startswith("poisoned"):
                self.log(f"push of v{version} into {name}: {outcome}; reporting it poisoned")
                try:
                    self.client.report_failure(name, f"push of v{version} failed midway: {outcome}", poisoned=True)
                except SupervisorError as e:
                    self.log(f"could not report {name} poisoned: {e}")
        self.client.publish_weights(version, checkpoint=checkpoint, fingerprint=self.fingerprint())
        self.published = version
        return pushed

    def fingerprint(self) -> dict[str, Any] | None:
        """The policy's fingerprint now, published with its version so that no engine is
        routable at it unless its outputs match (None with --no-fingerprint: the label check)."""
        if not getattr(self.args, "fingerprint", True):
            return None
        with self.policy.lock:
            return make_fingerprint(self.policy.model)


# -- the async loop (--async) --------------------------------------------------------------


# After an engine failed its update: how long the daemon has to take it out of routing (and
# promote a spare in its place) before the update's second pass reads who serves. A death is
# acted on at once; a live engine whose push failed stays routable at its old version.
FILL_WAIT = 5.0


class AsyncModeError(ValueError):
    """--async against a daemon whose [weights] rule cannot serve it."""


def check_async_rule(rule: VersionRule) -> None:
    """--async needs the daemon in async mode with max_staleness >= 1: the batch trained at
    each step streamed while the last version was pushed, so some of its tokens are one
    version behind the one it is trained from."""
    if rule.mode is not WeightsMode.ASYNC:
        raise AsyncModeError('--async needs the daemon in async mode: set [weights] mode = "async" and '
                             "max_staleness = 1 (or more) in its config and reload it (supervisorctl reload, or "
                             "SIGHUP); or run without --async")
    if rule.bound < 1:
        raise AsyncModeError("--async trains on a batch that streamed while the last version was pushed (one "
                             "version behind): set [weights] max_staleness = 1 (or more) in the daemon's config "
                             "and reload it")


def piece_versions(sample: Sample) -> list[Any]:
    """The versions of a sample's pieces, in token order (the one it was answered at when it
    has no pieces)."""
    return [s.get("weight_version") for s in sample.splits] or [sample.weight_version]


class AsyncRLLoop(RLLoop):
    """--async: generation and training overlap, with no rounds. Step k trains on batch k
    while batch k+1 streams; its version then reaches every routable engine by an in-flight
    update (trainer/inflight.py: paused with abort, pushed, verified, resumed; the cut
    requests continue on the new weights and their splits say which tokens each version made),
    the warm spares are pushed too, and the version is published. A sample with a token more
    than max_staleness versions behind the version it would be trained from is left out
    (counted: past_staleness). Faults are the daemon's and the rollout client's, as in the
    sync loop: with no round open a failed engine is restarted (or a spare promoted) at once,
    and an engine that fails its update is left to the daemon."""

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        self.report.mode = "async"
        self.pending: asyncio.Future | None = None  # the next batch, streaming while we train

    # -- hook points -------------------------------------------------------------------------

    async def push_in_flight(self, engine: Engine, tensors, version: int) -> str:
        """One engine's push during an in-flight update (it is paused; the update resumes it),
        as push_into says it."""
        def locked() -> str:
            with self.policy.lock:
                return self.pusher.push(engine.url, tensors, version, pause_mode=None)
        return await asyncio.to_thread(locked)

    # -- setup and teardown ------------------------------------------------------------------

    def publish_first(self) -> bool:
        return True  # the first batch is generated at a published version, as every later one

    async def connect(self) -> None:
        await super().connect()
        assert self.rollout is not None
        check_async_rule(self.rollout.rule)  # before anything is pushed
        self.report.max_staleness = self.rollout.rule.bound

    async def disconnect(self) -> None:
        if self.pending is not None and not self.pending.done():  # the run stopped early
            self.pending.cancel()
            await asyncio.gather(self.pending, return_exceptions=True)
        if self.rollout is not None:
            self.report.stale_regenerated = self.rollout.stats.stale_samples
        await super().disconnect()

    # -- one step ----------------------------------------------------------------------------

    async def step(self, step: int, train: bool) -> None:
        a = self.args
        t0 = time.monotonic()
        await self.before_round(step)
        if self.pending is None:  # the first step: nothing streamed yet
            assert self.rollout is not None
            await self.rollout.refresh(force=True)  # the engines at the version just published
            self.pending = asyncio.ensure_future(self.rollout_batch(step))
        out = await self.pending
        self.pending = asyncio.ensure_future(self.rollout_batch(step + 1)) if step < a.num_rollout else None
        await self.after_round(step, None)
        trained_from = self.published
        fresh = [s for s in out.samples if not self.past_bound(s)]
        if a.save_debug_rollout_data and fresh:
            save_rollout(a.save_debug_rollout_data, step, fresh, weight_version=trained_from, target=a.target)
        stats: StepStats | None = None
        pushed: dict[str, str] = {}
        if fresh:
            with self.tracer.span(f"train step {step}"):
                stats = await asyncio.to_thread(self.policy.train_step, fresh)
            with self.tracer.span(f"update v{self.base + self.policy.version}"):
                pushed = await self.update_and_publish()
        rec = self.record(step, None, trained_from, out._replace(samples=fresh), stats, pushed, t0)
        rec.past_staleness = len(out.samples) - len(fresh)
        rec.span_versions = [piece_versions(s) for s in fresh]
        if rec.past_staleness:
            self.log(f"step {step}: {rec.past_staleness} sample(s) past max_staleness "
                     f"{self.report.max_staleness} of v{trained_from}: not trained on")

    def past_bound(self, sample: Sample) -> bool:
        """A token more than max_staleness versions behind the version trained from."""
        assert self.rollout is not None
        return any(self.rollout.rule.too_old(v, self.published) for v in piece_versions(sample))

    async def rollout_batch(self, step: int) -> Rollouts:
        """One batch, no round: an error loses it (counted as a lost round, as in the sync loop)."""
        prompts = self.prompts()
        results: list[RolloutResult] = []
        lost, error = False, None
        try:
            results = await asyncio.wait_for(self.generate(step, prompts), self.args.round_timeout)
        except asyncio.TimeoutError:
            lost, error = True, f"the batch did not end within --round-timeout {self.args.round_timeout:g}s"
        except Exception as e:  # noqa: BLE001 - the batch is lost; it is counted (and may stop the run)
            lost, error = True, f"{type(e).__name__}: {e}"
        for r in results:
            self.tracer.add_request(r, round=None, splits=[f"{s.engine}@{s.weight_version} [{s.offset}+{s.tokens}] "
                                                           f"{s.outcome}" for s in r.splits])
        return Rollouts(self.score(results, prompts) if results else [], results, 0, lost, error)

    # -- the update ----------------------------------------------------------------------------

    async def update_and_publish(self) -> dict[str, str]:
        """The policy's version into every routable engine while requests stream (in waves of
        --serving-fraction), then into the warm spares, then published. Each wave is announced
        to the daemon as a push (InFlightUpdate.run's supervisor): its engines' pauses are
        excused for the push's bound, and at its end the daemon reads their /weight_info
        again. A second pass takes an engine that became routable during the first (a spare
        promoted in a failed engine's place: the daemon is given FILL_WAIT to act on the
        failure first). name -> outcome; a poisoned engine is reported (the daemon restarts it)."""
        assert self.rollout is not None
        version = self.base + self.policy.version
        tensors = self.policy.named_tensors()  # unchanged until the next step trains, after the publish
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        outcomes: dict[str, str] = {}
        failed: set[str] = set()  # reported already

        async def push(engine: Engine, v: int) -> None:
            outcomes[engine.name] = outcome = await self.push_in_flight(engine, tensors, v)
            if outcome != "ok":
                raise RuntimeError(outcome)

        for _ in range(2):
            await self.rollout.refresh()
            behind = [e for e in self.rollout.engines if e.weight_version != version and e.name not in outcomes]
            if not behind:
                break
            update = InFlightUpdate([self.rollout], push=push, engines=behind, timeout=self.args.sync_wait,
                                    serving_fraction=self.serving_fraction([e.name for e in behind]), nbytes=nbytes)
            # Published below, once the spares hold it too, with the policy's fingerprint.
            done = await update.run(version, supervisor=self.rollout.supervisor, publish=False)
            for name, why in done.failed.items():
                outcomes.setdefault(name, f"failed: {why}")
                failed.add(name)
            self.report.updates.append({"version": version, "waves": done.waves, "seconds": done.seconds,
                                        "serving_min": done.serving_min, "failed": done.failed,
                                        "pushes": done.pushes})
            if not done.failed:
                break
            self.log(f"update to v{version}: failed in {', '.join(f'{n} ({w})' for n, w in done.failed.items())}")
            await asyncio.to_thread(self.report_poisoned, {n: outcomes[n] for n in done.failed}, version)
            await asyncio.to_thread(self.view.wait, lambda: not set(done.failed) & self.routable_names(), FILL_WAIT)
        outcomes.update(await asyncio.to_thread(self.push_spares, tensors, version))
        await asyncio.to_thread(self.report_poisoned, {n: o for n, o in outcomes.items() if n not in failed}, version)
        await asyncio.to_thread(self.client.publish_weights, version, fingerprint=self.fingerprint())
        self.published = version
        return outcomes

    def routable_names(self) -> set[str]:
        return {e["name"] for e in self.client.routable_engines()["engines"]}

    def serving_fraction(self, names: list[str]) -> float:
        """--serving-fraction, or 0 (all at once) when these engines are too few to keep it."""
        try:
            waves(names, self.args.serving_fraction)
            return self.args.serving_fraction
        except ValueError:
            return 0.0

    def push_spares(self, tensors, version: int) -> dict[str, str]:
        """The warm spares (STANDBY: nothing in flight) to `version`, so that one promoted in a
        failed engine's place serves at once at an allowed version."""
        spares = [e for e in self.view.engines() if e["state"] == State.STANDBY and e.get("weight_version") != version]
        with self.policy.lock:
            return {e["name"]: self.pusher.push(e["url"], tensors, version) for e in spares}

    def report_poisoned(self, outcomes: dict[str, str], version: int) -> None:
        for name, outcome in outcomes.items():
            if "poisoned" in outcome:
                self.log(f"push of v{version} into {name}: {outcome}; reporting it poisoned")
                try:
                    self.client.report_failure(name, f"push of v{version} failed midway: {outcome}", poisoned=True)
                except SupervisorError as e:
                    self.log(f"could not report {name} poisoned: {e}")


# -- output --------------------------------------------------------------------------------


def quiet_rollout_log() -> None:
    """One line per re-sent request is too much beside the step table (which counts them)."""
    logging.getLogger("vime.rollout").setLevel(logging.ERROR)


def format_steps(rep: Report) -> list[str]:
    lines = ["", "steps", f"  {'step':>4} {'round':>5} {'ver':>4} {'reward':>6} {'gap':>8} {'re-sent':>7}  engines"]
    for s in rep.steps:
        gap = "-" if s.logprob_gap_max is None else f"{s.logprob_gap_max:.1e}"
        eng = " ".join(f"{k}:{v}" for k, v in sorted(s.engines.items()))
        lines.append(f"  {s.step:>4} {s.round if s.round is not None else '-':>5} "
                     f"{s.version if s.version is not None else '-':>4} {s.reward_mean:>6.2f} {gap:>8} "
                     f"{s.resent:>7}  {eng}{'  LOST ' + (s.error or '') if s.lost else ''}")
    return lines


def format_end(rep: Report) -> list[str]:
    lines = []
    if rep.engines:
        lines += ["", f"engines at the end (trainer at v{rep.final_version})"]
        for name, e in sorted(rep.engines.items()):
            ver = "base" if e["weight_version"] is None else f"v{e['weight_version']}"
            lines.append(f"  {name:<12}{e['state']:<10}{ver}  restarts {e.get('restarts')}"
                         + ("  (warm spare: synced when promoted)" if e["state"] == State.STANDBY else ""))
    if rep.stopped:
        lines += ["", f"STOPPED EARLY: {rep.stopped}"]
    if rep.mode == "async":
        failed = sum(len(u["failed"]) for u in rep.updates)
        lines += ["", f"async: {len(rep.updates)} in-flight update(s) ({failed} engine update(s) failed)   "
                      f"samples past max_staleness {rep.max_staleness}: {sum(s.past_staleness for s in rep.steps)} "
                      f"not trained on, {rep.stale_regenerated} regenerated by the rollout client"]
    cut = sum(s.tokens_cut for s in rep.steps)
    lines += ["", f"rounds lost {rep.rounds_lost}   stale responses {rep.stale_responses}   "
              f"tokens cut by faults {cut} (reused {sum(s.tokens_reused for s in rep.steps)} in "
              f"{sum(s.continued for s in rep.steps)} continued request(s), "
              f"regenerated {sum(s.tokens_regenerated for s in rep.steps)})   "
              f"agent syncs {len(rep.syncs)} ({sum(1 for s in rep.syncs if s['ok'])} ok)   "
              f"reward {rep.steps[0].reward_mean if rep.steps else 0:.2f} -> "
              f"{rep.steps[-1].reward_mean if rep.steps else 0:.2f}   {rep.seconds:.0f}s"]
    return lines


def format_report(rep: Report) -> str:
    return "\n".join(format_steps(rep) + format_end(rep))


# -- command line --------------------------------------------------------------------------


def build_parser(prog: str = "python -m vime.trainer.rl_loop", description: str | None = __doc__
                 ) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the policy's model directory (trainer/tiny_model.py builds one)")
    ap.add_argument("--served-model-name", default=None, help="model name the engines serve (default: the only one)")
    ap.add_argument("--socket", default=None, help="the daemon's control socket ($VIME_SUPERVISOR_SOCKET)")
    ap.add_argument("--out", default="rl-run", help="folder for summary.json, trace.json, long_tail.json")
    g = ap.add_argument_group("many nodes (docs/cluster.md; pip install vime-supervisor[cluster])")
    g.add_argument("--cluster", metavar="RAY_ADDRESS", default=None,
                   help="the fleet is every node's daemon, through Ray (auto, or HEAD:PORT); --socket is "
                        "then each daemon's socket on its node")
    g.add_argument("--cluster-nodes", metavar="ADDR,ADDR", default=None,
                   help="the nodes' Ray addresses (default: every node with the vime_supervisor resource)")
    g.add_argument("--cluster-min-healthy", type=int, default=1, metavar="N",
                   help="rounds start only with N routable engines across the nodes")
    g.add_argument("--cluster-router-url", metavar="URL", default=None,
                   help="the router the nodes' daemons feed: a lost node's engines are taken out of it here")
    g.add_argument("--rendezvous-address", metavar="ADDR", default=None,
                   help="this node's address that engines join weight pushes at ($VIME_RENDEZVOUS_ADDRESS; "
                        "default: the address routed towards each engine)")
    g = ap.add_argument_group("rollout and training (slime's names)")
    g.add_argument("--num-rollout", type=int, default=30, help="steps (one round each)")
    g.add_argument("--rollout-batch-size", type=int, default=4, help="prompts per round")
    g.add_argument("--n-samples-per-prompt", type=int, default=8, help="samples per prompt (the GRPO group)")
    g.add_argument("--rollout-max-response-len", type=int, default=12)
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--target", default=TARGET, help="reward 1 when the sampled text contains this")
    g.add_argument("--no-continue-partial", dest="continue_partial", action="store_false",
                   help="a request cut by a fault is sent again whole (slime's behaviour; its streamed tokens "
                        "are thrown away and generated again), instead of continued from the tokens already "
                        "streamed (RolloutClient's continue_partial)")
    g.add_argument("--no-fingerprint", dest="fingerprint", action="store_false",
                   help="publish versions without a fingerprint: engines are then routable on their /weight_info "
                        "label alone (docs/weights.md#fingerprints)")
    g = ap.add_argument_group("async (the daemon in [weights] mode = \"async\", max_staleness >= 1)")
    g.add_argument("--async", dest="async_", action="store_true",
                   help="no rounds: the next batch streams while the trainer trains on the last one; each "
                        "version reaches the engines by an in-flight update (abort + continue), then is published")
    g.add_argument("--serving-fraction", type=float, default=0.0, metavar="F",
                   help="with --async: the share of engines that keep serving while the others update (waves; "
                        "default 0: all at once; too few engines to keep it: all at once)")
    g = ap.add_argument_group("waits and when to stop early")
    g.add_argument("--sync-wait", type=float, default=60.0, help="longest wait in a gap for engines being synced")
    g.add_argument("--final-wait", type=float, default=300.0, help="longest wait at the end for every engine to be current")
    g.add_argument("--max-lost-rounds", type=int, default=0, metavar="N",
                   help="stop once more rounds than this are lost (default 0: at the first lost round)")
    g.add_argument("--stop-on-fatal", action="store_true",
                   help="stop as soon as an engine is FATAL instead of waiting (bounded) for an operator to start it")
    g.add_argument("--round-timeout", type=float, default=900.0,
                   help="longest a round's rollouts may take; past it the round is lost")
    g = ap.add_argument_group("debug (slime's flags)")
    g.add_argument("--save-debug-rollout-data", metavar="PATH_WITH_{rollout_id}")
    g.add_argument("--load-debug-rollout-data", metavar="PATH_WITH_{rollout_id}")
    g.add_argument("--debug-rollout-only", action="store_true", help="roll out, do not train or push")
    g.add_argument("--debug-train-only", action="store_true",
                   help="train on loaded dumps; no daemon or engine (needs --load-debug-rollout-data)")
    return ap


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse flags that exclude each other (argparse's exit status 2, with what to do)."""
    for flag in ("num_rollout", "rollout_batch_size", "n_samples_per_prompt", "rollout_max_response_len"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1, not {getattr(args, flag)}")
    if args.debug_train_only and not args.load_debug_rollout_data:
        ap.error("--debug-train-only needs --load-debug-rollout-data PATH_WITH_{rollout_id}")
    if args.debug_train_only and args.debug_rollout_only:
        ap.error("--debug-train-only and --debug-rollout-only exclude each other")
    if not 0 <= args.serving_fraction < 1:
        ap.error(f"--serving-fraction must be in [0, 1), got {args.serving_fraction:g}")
    if args.serving_fraction and not args.async_:
        ap.error("--serving-fraction sets the waves of --async's in-flight updates: add --async, or drop it "
                 "(the sync loop updates its engines in the gap between rounds)")
    if args.async_:
        for flag, on in (("--debug-train-only", args.debug_train_only), ("--debug-rollout-only", args.debug_rollout_only),
                         ("--load-debug-rollout-data", args.load_debug_rollout_data), ("--cluster", args.cluster)):
            if on:
                ap.error(f"--async and {flag} exclude each other (--async trains and pushes while live rollouts "
                         "stream from this node's daemon)")


def exit_status(args: argparse.Namespace, rep: Report) -> int:
    """0 when the run did all its steps, lost no round, saw no stale answer and ends with every
    engine on its version; 128 + the signal that stopped it; else 1."""
    if rep.signal is not None:
        return 128 + rep.signal
    ok = not rep.stopped and rep.rounds_lost == 0 and rep.stale_responses == 0 and (
        args.debug_train_only or args.debug_rollout_only
        or all(e["weight_version"] == rep.final_version for e in rep.engines.values()
               if e["state"] not in (State.FATAL, State.STANDBY)))  # a spare is synced when promoted
    return 0 if ok else 1


def check_model(model: str) -> str | None:
    """Why `model` is not a model directory the policy can load (None: it looks like one)."""
    path = Path(model)
    what = ("no such directory" if not path.exists() else "not a directory" if not path.is_dir()
            else "not a model directory (no config.json in it)" if not (path / "config.json").is_file() else None)
    if what is None:
        return None
    return (f"--model {model}: {what}; pass the policy's model directory, a Hugging Face save_pretrained "
            "folder (python -m vime.trainer.tiny_model DIR builds a tiny one)")


def check_dumps(template: str, steps: int) -> str | None:
    """Why rounds 1..steps cannot all be read from the dumps --load-debug-rollout-data names
    (None: each is a file whose header load_rollout reads). Found before the model loads, so a
    dump missing or corrupt at round 20 does not cost 19 rounds of training first. The rounds
    are looked at in order up to the first that fails."""
    flag = f"--load-debug-rollout-data {template}"
    if why := template_error(template, saving=False):
        return f"{flag}: {why}"
    for step in range(1, steps + 1):
        path = dump_path(template, step)
        if why := _unreadable(path):
            why = f"{path}: {why}"
        else:
            try:
                read_header(path)
                continue
            except (DumpFormatError, OSError) as e:
                why = str(e)  # it names the path
        later = f" (round {step} of {steps}; later rounds not checked)" if step < steps else ""
        return (f"{flag}: {why}{later}; pass the template --save-debug-rollout-data wrote "
                "({rollout_id} is the round, 1 to --num-rollout), or lower --num-rollout to the rounds saved")
    return None


def _unreadable(path: Path) -> str | None:
    if not path.parent.is_dir():
        return f"no folder {path.parent}"
    if not path.exists():
        return "no such file"
    if not path.is_file():
        return "not a file"
    if not os.access(path, os.R_OK):
        return "not readable (permissions)"
    return None


def mode_refusal(rule: VersionRule, async_: bool, trains: bool = True) -> str | None:
    """Why a loop cannot run against a daemon whose answers carry `rule` (None: it can): --async
    needs async mode with max_staleness >= 1 (check_async_rule); the round loop, training,
    needs sync mode (in async mode a restarted engine serves a version behind inside a round,
    and rounds gate nothing)."""
    if async_:
        try:
            check_async_rule(rule)
        except AsyncModeError as e:
            return str(e)
        return None
    if trains and rule.mode is WeightsMode.ASYNC:
        return ('the daemon is in async mode ([weights] mode = "async"): add --async, or set [weights] mode = '
                '"sync" in its config and reload it (supervisorctl reload, or SIGHUP)')
    return None


def preflight(args: argparse.Namespace) -> str | None:
    """What the run cannot start with, found before the model is loaded: a --model that is not
    a model directory, a --load-debug-rollout-data dump missing or unreadable (its header read
    as load_rollout reads it), a --save-debug-rollout-data template dump_path would refuse at the
    first save, no daemon at --socket, a daemon whose [weights] mode the loop cannot run against.
    None: go on (--cluster asks each node's daemon as it connects; --debug-train-only needs none)."""
    if why := check_model(args.model):
        return why
    if args.load_debug_rollout_data and (why := check_dumps(args.load_debug_rollout_data, args.num_rollout)):
        return why
    if args.save_debug_rollout_data and (why := template_error(args.save_debug_rollout_data)):
        return f"--save-debug-rollout-data {args.save_debug_rollout_data}: {why}"
    if args.debug_train_only or args.cluster:
        return None
    client = SupervisorClient(args.socket)
    try:
        rule = VersionRule.from_answer(client.status())
    except SupervisorError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        client.close()
    return mode_refusal(rule, args.async_, trains=not args.debug_rollout_only)


def run_and_report(loop: type[RLLoop], args: argparse.Namespace, name: str,
                   fmt: Callable[[Report], str] = format_report) -> int:
    """Build and run the loop, print its report with fmt, and return the exit status (2: it
    could not run; said in one line, before the model is loaded where preflight finds why)."""
    quiet_rollout_log()
    if why := preflight(args):
        print(f"{name}: {why}", file=sys.stderr)
        return 2
    try:
        rep = loop(args).run()
    except (OSError, ValueError, SupervisorError) as e:  # a missing or bad dump, no daemon
        print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(fmt(rep))
    return exit_status(args, rep)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    return run_and_report(AsyncRLLoop if args.async_ else RLLoop, args, "rl_loop")


if __name__ == "__main__":
    sys.exit(main())
