"""The example RL loop: a tiny Llama trained on rollouts from vLLM engines under the daemon.

    python -m vime.trainer.rl_loop --model DIR [--socket PATH] [--num-rollout 30] [faults] [debug flags]

Each step is one round:

    round start N -> rollouts (RolloutClient: routed by the daemon, re-sent on failures)
    -> round end N -> reward, GRPO-style update (trainer/rl.py) -> push the new weights into
    every routable engine (weight_sync) -> publish the version -> let recovered engines sync

A SyncAgent thread answers the daemon's `sync_request`s: an engine that was restarted comes
back on the base weights and gets the current version pushed, verified by the daemon, before it
is routed again. Faults on demand (`--kill-at`, `--hang-at`, `--fail-push-at`) act on the real
engine processes; each waits, in the round gap, until every engine is RUNNING so that it is
measured on a whole fleet. The run ends once every engine is back on the trainer's version, and
prints (and writes to OUT/summary.json) a table of steps, each fault's detection and recovery,
the version each engine ends on, and the rounds lost.

It stops early, and says why (`Report.stopped`), when more rounds are lost than
`--max-lost-rounds` (default 0: at the first), when an engine is FATAL (with `--stop-on-fatal`;
the demo sets it), or on SIGINT (Ctrl-C) / SIGTERM: the round in progress is abandoned and
ended, the connections closed, the summary written. Every wait has a bound (`--fault-wait`,
`--sync-wait`, `--final-wait`, `--round-timeout`).

slime's debug flags work here: `--save-debug-rollout-data 'DIR/{rollout_id}.jsonl'` keeps each
round's samples; `--load-debug-rollout-data` replays them instead of rolling out (with
`--debug-train-only` no daemon or engine is needed at all); `--debug-rollout-only` rolls out
without training.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vime.harness import faults as F
from vime.supervisor.client import AsyncSupervisorClient, SupervisorClient, SupervisorError
from vime.trainer.dumps import Sample, dump_path, load_rollout, save_rollout
from vime.trainer.rl import PROMPTS, TARGET, Policy, StepStats, reward

WHOLE_STATES = ("RUNNING", "SUSPECT")


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


@dataclass
class Report:
    steps: list[StepRecord] = field(default_factory=list)
    faults: list[F.Fault] = field(default_factory=list)
    final_version: int | None = None
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> state, version
    syncs: list[dict[str, Any]] = field(default_factory=list)         # the agent's pushes
    rounds_lost: int = 0
    stale_responses: int = 0
    seconds: float = 0.0
    stopped: str | None = None       # why the run stopped before its last step (None: it did not)
    signal: int | None = None        # the signal that stopped it (SIGINT, SIGTERM), if one did

    def as_dict(self) -> dict[str, Any]:
        return {"steps": [asdict(s) for s in self.steps], "faults": [f.as_dict() for f in self.faults],
                "final_version": self.final_version, "engines": self.engines, "syncs": self.syncs,
                "rounds_lost": self.rounds_lost, "stale_responses": self.stale_responses,
                "seconds": self.seconds, "stopped": self.stopped, "signal": self.signal,
                "reward_first": self.steps[0].reward_mean if self.steps else None,
                "reward_last": self.steps[-1].reward_mean if self.steps else None}


# -- the parts that talk to the daemon -----------------------------------------------------


class EngineFatal(Exception):
    """An engine is FATAL (its start budget or flapping window is spent): with --stop-on-fatal
    no wait goes on for it."""


class Fleet:
    """The daemon as the loop sees it: status, waits, and the engines' processes for faults.
    `stop` (set on SIGINT/SIGTERM) ends every wait at once; with `stop_on_fatal` a wait raises
    EngineFatal as soon as an engine is FATAL."""

    def __init__(self, client: SupervisorClient, stop: threading.Event | None = None, stop_on_fatal: bool = False):
        self.client = client
        self.stop = stop or threading.Event()
        self.stop_on_fatal = stop_on_fatal

    def engines(self) -> list[dict[str, Any]]:
        return self.client.status()["engines"]

    def fatal(self, engines: list[dict[str, Any]] | None = None) -> list[str]:
        """'name: reason' of every FATAL engine."""
        return [f"{e['name']} FATAL: {e.get('reason') or '?'}" for e in (engines or self.engines())
                if e["state"] == "FATAL"]

    def whole(self, version: int | None) -> bool:
        """Every engine serving the given version (a FATAL one too must be back)."""
        return all(e["state"] in WHOLE_STATES and (version is None or e.get("weight_version") == version)
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
        return self.wait(lambda: not any(e["state"] in ("STALE", "SYNCING") for e in self.engines()), timeout)


class Pusher:
    """Pushes each new version into the routable engines, one WeightSender (group) per URL."""

    def __init__(self, backend: str = "gloo"):
        self.backend = backend
        self.senders: dict[str, Any] = {}

    def push(self, engine: dict[str, Any], tensors, version: int, *, fail_halfway: bool = False) -> str:
        from vime.weight_sync.errors import PoisonedEngine, WeightSyncError
        from vime.weight_sync.sender import WeightSender

        url = engine["url"]
        if fail_halfway:  # its own sender, in small buckets, so "halfway" is inside the transfer
            old = self.senders.pop(url, None)
            if old is not None:
                old.close()
            sender = WeightSender(url, backend=self.backend, bucket_bytes=256 << 10, solo_bytes=None,
                                  progress=F.FailHalfway())
        else:
            sender = self.senders.get(url) or self.senders.setdefault(url, WeightSender(url, backend=self.backend))
        try:
            sender.push(tensors, version)
            return "ok"
        except PoisonedEngine as e:
            self.senders.pop(url, None)
            return f"poisoned: {e}"
        except WeightSyncError as e:  # it died or went away: the daemon sees that itself
            self.senders.pop(url, None)
            return f"failed: {e}"
        finally:
            if fail_halfway:
                sender.close()

    def close(self) -> None:
        for s in self.senders.values():
            s.close()
        self.senders.clear()


# -- the loop ----------------------------------------------------------------------------


class Hooks:
    """What a chaos harness lends the loop for faults it cannot do alone (harness/soak.py):
    kill -9 of the daemon (restarted like systemd would), and a model directory that can be
    broken and mended so an engine crashes at start."""

    def kill_daemon(self) -> None:
        raise NotImplementedError("a daemon fault needs a harness that restarts the daemon")

    def break_model(self, engine: str) -> None:
        raise NotImplementedError("a crash-start fault needs a harness that owns the engine's model path")

    def fix_model(self, engine: str) -> None:
        raise NotImplementedError


class RLLoop:
    def __init__(self, args: argparse.Namespace, *, plan: list[F.Fault] | None = None, hooks: Hooks | None = None):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.policy = Policy(args.model, lr=args.lr, seed=args.seed)
        self.report = Report()
        self.plan = plan if plan is not None else [
            F.Fault(kind, step) for kind, step in
            (("kill", args.kill_at), ("hang", args.hang_at), ("push", args.fail_push_at)) if step]
        self.report.faults = self.plan
        self.hooks = hooks or Hooks()
        self.published: int | None = None  # the version the daemon has as current
        self.base = 0                      # published version = base + policy.version
        self.next_round = 1
        self.rc: Any = None
        self.agent: Any = None
        self.recorder: Any = None
        self.stop = threading.Event()       # set by SIGINT/SIGTERM (or by a caller): every wait ends

    def log(self, msg: str) -> None:
        print(f"[rl {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    # -- samples ---------------------------------------------------------------------------

    def prompts(self) -> list[str]:
        a = self.args
        chosen = [PROMPTS[i % len(PROMPTS)] for i in range(a.rollout_batch_size)]
        return [p for p in chosen for _ in range(a.n_samples_per_prompt)]

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
            self._record(step, None, None, dump.samples, stats, {}, [], 0, t0)

    def _record(self, step, rnd, version, samples, stats: StepStats | None, pushed, results, stale, t0,
                lost=False, error=None) -> StepRecord:
        engines: dict[str, int] = {}
        ids = [s.metadata["request_id"] for s in samples if s.metadata.get("request_id")]
        for s in samples:
            engines[s.engine or "?"] = engines.get(s.engine or "?", 0) + 1
        rec = StepRecord(step=step, round=rnd, version=version, samples=len(samples),
                         reward_mean=(sum(s.reward or 0 for s in samples) / len(samples)) if samples else 0.0,
                         loss=stats.loss if stats else None,
                         logprob_gap_max=stats.logprob_gap_max if stats else None,
                         digest=self.policy.digest() if stats else None, engines=engines,
                         resent=sum(1 for r in results if len(r.attempts) > 1), stale=stale, pushed=pushed,
                         seconds=time.monotonic() - t0, lost=lost, error=error,
                         duplicates=len(ids) - len(set(ids)))
        self.report.steps.append(rec)
        gap = "" if rec.logprob_gap_max is None else f" logprob gap {rec.logprob_gap_max:.1e}"
        self.log(f"step {step}: reward {rec.reward_mean:.2f}{gap} from {engines or '-'}"
                 + (f", {rec.resent} re-sent" if rec.resent else "") + (f", LOST: {error}" if lost else ""))
        return rec

    # -- the trainer's connections ---------------------------------------------------------

    async def _connect(self) -> None:
        """The rollout client and the sync agent: what a trainer process holds open."""
        from vime.trainer.rollout import RolloutClient

        a = self.args
        self.rc = RolloutClient(AsyncSupervisorClient(a.socket), model=a.served_model_name)
        await self.rc.start()
        if not a.debug_rollout_only:
            await asyncio.to_thread(self._start_agent)

    def _start_agent(self) -> None:
        from vime.trainer.agent import SyncAgent

        self.agent = SyncAgent(SupervisorClient(self.args.socket), self._agent_weights,
                               lock=self.policy.lock, on_sync=self._on_sync).start()

    async def _disconnect(self) -> None:
        if self.agent is not None:
            self.agent.stop()
            self.agent = None
        if self.rc is not None:
            await self.rc.aclose()
            self.rc = None

    def _on_sync(self, r) -> None:
        self.report.syncs.append({"engine": r.engine, "version": r.version, "ok": r.ok,
                                  "seconds": round(r.seconds, 3), "error": r.error})

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
        saved = []
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

    def _stop_reason(self, fleet: Fleet, step: int) -> str | None:
        """Why the run must stop after this step, if it must."""
        lost = [s for s in self.report.steps if s.lost]
        if len(lost) > self.args.max_lost_rounds:
            return (f"{len(lost)} round(s) lost, more than --max-lost-rounds {self.args.max_lost_rounds} "
                    f"(step {lost[-1].step}: {lost[-1].error})")
        if fleet.stop_on_fatal and (fatal := fleet.fatal()):
            return "; ".join(fatal)
        return None

    async def _run_live(self) -> None:
        saved = self._catch_signals()
        try:
            await self._run_live_inner()
        finally:
            self._restore_signals(saved)

    async def _run_live_inner(self) -> None:
        from vime.trainer.trace import DaemonEventRecorder, Tracer

        a = self.args
        client = SupervisorClient(a.socket)
        fleet = Fleet(client, self.stop, stop_on_fatal=a.stop_on_fatal)
        status = client.status()
        if status.get("round_open"):
            # A trainer before us left its round open (it died mid-round): close it.
            self.log(f"round {status['round']} was left open by a previous trainer: ending it")
            client.end_round(status["round"])
        self.published = status.get("weight_version")
        self.next_round = (status.get("round") or 0) + 1
        tracer = Tracer()
        self.recorder = DaemonEventRecorder(client, tracer).start()
        pusher = Pusher()
        train = not a.debug_rollout_only
        try:
            await self._connect()
            if train and self.published is not None:
                # Another run published before us: the engines hold its weights. Ours go
                # out first as the next version, so every round below is on-policy.
                self.base = self.published + 1
                await asyncio.to_thread(self._locked_push_and_publish, fleet, pusher)
            try:
                for step in range(1, a.num_rollout + 1):
                    await self._step(step, fleet, pusher, tracer, train)
                    why = await asyncio.to_thread(self._stop_reason, fleet, step)
                    if why:
                        self.report.stopped = f"stopped after step {step}: {why}"
                        break
            except EngineFatal as e:
                self.report.stopped = f"stopped: {e}"
            if self.report.stopped:
                self.log(self.report.stopped)
            elif train:
                self.log(f"waiting (in the gap) for every engine to be RUNNING on v{self.published}")
                if not await asyncio.to_thread(fleet.wait, lambda: fleet.whole(self.published), a.final_wait):
                    self.log(f"not every engine is RUNNING on v{self.published} after {a.final_wait:g}s")
        finally:
            await self._disconnect()
            pusher.close()
            self.recorder.stop()
            for f in self.plan:
                F.timeline(f, self.recorder.events)
            tracer.write(self.out / "trace.json")
            tracer.save_summary(self.out / "long_tail.json")
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

    # -- one step --------------------------------------------------------------------------

    async def _step(self, step, fleet: Fleet, pusher: Pusher, tracer, train: bool) -> None:
        a = self.args
        t0 = time.monotonic()
        rolled_with = self.published
        fault = next((f for f in self.plan if f.fired_step is None and f.step <= step), None)
        if fault is not None and not await self._ready_for(fault, fleet):
            fault = None  # postponed to the next step
        rnd = None
        if a.load_debug_rollout_data:
            dump = load_rollout(dump_path(a.load_debug_rollout_data, step))
            samples, results, stale, lost, error = dump.samples, [], 0, False, None
        else:
            rnd, (samples, results, stale, lost, error) = await self._rollout(step, fault, fleet, tracer)
        if fault is not None and fault.kind == "kill-gap":
            await asyncio.to_thread(self._inject, fault, step, fleet, "in the gap")
        if a.save_debug_rollout_data and samples:
            save_rollout(a.save_debug_rollout_data, step, samples, weight_version=self.published,
                         round=rnd, target=a.target)
        stats, pushed = None, {}
        if train and samples:
            with tracer.span(f"train step {step}"):
                stats, pushed = await asyncio.to_thread(self._train_and_push, step, samples, fleet, pusher, fault)
        self._record(step, rnd, rolled_with if not a.load_debug_rollout_data else None, samples, stats,
                     pushed, results, stale, t0, lost=lost, error=error)

    async def _ready_for(self, fault: F.Fault, fleet: Fleet) -> bool:
        """A fault is injected on a whole fleet: wait for it in the gap (bounded)."""
        if not await asyncio.to_thread(fleet.whole, self.published):
            self.log(f"{fault.kind} fault due: waiting (gap) for every engine to be RUNNING on v{self.published}")
            ok = await asyncio.to_thread(fleet.wait, lambda: fleet.whole(self.published), self.args.fault_wait)
            if not ok:
                fault.note = f"postponed: fleet not whole within {self.args.fault_wait:g}s"
                return False
        if fault.kind in F.NO_ENGINE:
            fault.engine = fault.kind
            return True
        engines = sorted(e["name"] for e in await asyncio.to_thread(fleet.engines) if e["state"] in WHOLE_STATES)
        last = [f.engine for f in self.plan if f.engine is not None and f.kind not in F.NO_ENGINE]
        fresh = [n for n in engines if not last or n != last[-1]]
        fault.engine = (fresh or engines)[0]
        return True

    async def _rollout(self, step, fault, fleet: Fleet, tracer):
        """One round of rollouts; (round, (samples, results, stale, lost, error)). The round
        is ended whatever happens inside it (unless a reconnected trainer already ended it)."""
        rnd = self.next_round
        self.next_round += 1
        a = self.args
        prompts = self.prompts()
        client = fleet.client
        await asyncio.to_thread(client.start_round, rnd)
        injector = gather = None
        results, lost, error, ended = [], False, None, False
        t_round = time.time()
        try:
            await self.rc.refresh(force=True)
            gather = asyncio.ensure_future(self.rc.gather(prompts, max_tokens=a.rollout_max_response_len,
                                                          temperature=a.rollout_temperature, logprobs=1))
            if fault is not None and fault.kind == "disconnect":
                ended = True  # the reconnected trainer ends it (or it is lost)
                return await self._disconnect_mid_round(fault, step, rnd, gather, fleet, tracer)
            if fault is not None and fault.kind in F.IN_ROUND:
                injector = asyncio.ensure_future(self._inject_later(fault, step, fleet, gather))
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
            if injector is not None:
                try:
                    await injector
                except Exception as e:  # noqa: BLE001 - a fault that could not be injected is a note
                    fault.note = f"injection failed: {type(e).__name__}: {e}"
                    self.log(f"{fault.kind} fault: {fault.note}")
            if not ended:
                await asyncio.to_thread(client.end_round, rnd)
        tracer.add_round(rnd, t_round, time.time(), step=step)
        for r in results:
            tracer.add_request(r, round=rnd)
        stale = sum(1 for r in results if self.published is not None and r.weight_version != self.published)
        return rnd, ((self.score(results, prompts) if results else []), results, stale, lost, error)

    async def _disconnect_mid_round(self, fault, step, rnd, gather, fleet: Fleet, tracer):
        """The trainer goes away mid-round (its rollout client and sync agent drop their
        connections, its requests are abandoned); a trainer that connects again finds the round
        open, ends it, and runs the step again in a new round."""
        await self._in_flight(gather)
        fault.fired_step, fault.injected_at = step, time.time()
        fault.confirmed = not gather.done()  # requests were in flight when it went
        gather.cancel()
        await asyncio.gather(gather, return_exceptions=True)
        await self._disconnect()
        self.log(f"FAULT the trainer disconnected in round {rnd} of step {step}")
        await asyncio.sleep(1.0)
        await self._connect()
        status = await asyncio.to_thread(fleet.client.status)
        if status["round_open"] and status["round"] == rnd:
            await asyncio.to_thread(fleet.client.end_round, rnd)
            fault.detected_as = f"reconnected: round {rnd} was still open; ended it, step {step} runs again"
        else:
            fault.confirmed = False
            fault.detected_as = f"reconnected: round {rnd} was not open ({status.get('round')}, open {status.get('round_open')})"
        fault.detected_at = fault.ready_at = time.time()
        tracer.add_round(rnd, fault.injected_at, time.time(), step=step, abandoned=True)
        rnd2, out = await self._rollout(step, None, fleet, tracer)
        fault.resynced_at = time.time()
        fault.resync_reason = f"step {step} completed in round {rnd2}"
        return rnd2, out

    async def _in_flight(self, gather, engine: str | None = None) -> None:
        """Wait (at most fault_delay) until this round has requests in flight (on `engine`)."""
        deadline = time.monotonic() + self.args.fault_delay
        while not gather.done() and time.monotonic() < deadline:
            out = self.rc.outstanding()
            if (out.get(engine) if engine else out):
                return
            await asyncio.sleep(0.005)

    async def _inject_later(self, fault: F.Fault, step: int, fleet: Fleet, gather) -> None:
        await self._in_flight(gather, None if fault.kind in F.NO_ENGINE else fault.engine)
        if gather.done():  # the round finished first: try again at the next step
            fault.engine = None
            fault.note = f"round of step {step} ended before the injection; postponed"
            return
        fault.confirmed = True  # injected with the round's requests in flight
        await asyncio.to_thread(self._inject, fault, step, fleet, "during the round")

    def _inject(self, fault: F.Fault, step: int, fleet: Fleet, when: str) -> None:
        engines = fleet.engines()
        fault.fired_step, fault.injected_at = step, time.time()
        if fault.kind == "daemon":
            fault.note = "pids before: " + ", ".join(f"{e['name']}={e.get('pid')}" for e in engines)
            self.hooks.kill_daemon()
            self.log(f"FAULT kill -9 of the daemon {when} of step {step}")
            return
        eng = next(e for e in engines if e["name"] == fault.engine)
        fault.pid, fault.incarnation = eng.get("pid"), eng.get("incarnation")
        if fault.kind == "hang":
            core = F.hang_core(fault.pid)
            fault.note = f"EngineCore pid {core}"
            self.log(f"FAULT SIGSTOP {fault.engine}'s EngineCore (pid {core}) {when} of step {step}")
            return
        if fault.kind == "crash-start":
            self.hooks.break_model(fault.engine)
            threading.Thread(target=self._mend_after_crash, args=(fault,), daemon=True).start()
        F.kill_server(fault.pid)
        self.log(f"FAULT kill -9 {fault.engine} (pid {fault.pid}) {when} of step {step}"
                 + (" with its model broken: the restart will crash" if fault.kind == "crash-start" else ""))

    def _mend_after_crash(self, fault: F.Fault) -> None:
        """Once the restart has crashed (BACKOFF), mend the model so the next attempt boots."""
        ev = self.recorder.wait_for(lambda e: e.get("event") == "transition" and e.get("engine") == fault.engine
                                    and e.get("to_state") in ("BACKOFF", "FATAL")
                                    and e.get("ts", 0) >= fault.injected_at, self.args.fault_wait,
                                    raise_on_timeout=False)
        self.hooks.fix_model(fault.engine)
        fault.confirmed = ev is not None  # the restart really crashed
        fault.note = f"start crashed ({(ev or {}).get('reason', 'not seen')[:120]}); model mended"
        if ev is not None and ev["to_state"] == "FATAL":
            SupervisorClient(self.args.socket).start(fault.engine)  # what an operator would do

    # -- the gap: train, push, publish -----------------------------------------------------

    def _train_and_push(self, step, samples, fleet: Fleet, pusher: Pusher, fault: F.Fault | None):
        if fault is not None and fault.kind == "poison-reload" and self.agent is not None:
            self.agent.stop()  # before taking the lock: the agent may be waiting for it
            self.agent = None
        with self.policy.lock:  # the agent pushes only between steps
            stats = self.policy.train_step(samples)
            if fault is not None and fault.kind == "poison-reload":
                pushed = self._poisoned_reload(step, fleet, pusher, fault)
            else:
                pushed = self._push_and_publish(fleet, pusher, fault if fault and fault.kind == "push" else None,
                                                step)
        fleet.settle_syncs(self.args.sync_wait)
        return stats, pushed

    def _locked_push_and_publish(self, fleet: Fleet, pusher: Pusher) -> dict[str, str]:
        with self.policy.lock:
            return self._push_and_publish(fleet, pusher)

    def _agent_weights(self):
        """The SyncAgent's view: the published version and its tensors, or no version while the
        trainer's tensors are ahead of what the daemon has (a step, or a publish that failed)."""
        current = self.base + self.policy.version
        return (self.published if self.published == current else None), self.policy.named_tensors()

    def _push_and_publish(self, fleet: Fleet, pusher: Pusher, push_fault: F.Fault | None = None,
                          step: int = 0, checkpoint: Path | None = None) -> dict[str, str]:
        version = self.base + self.policy.version
        tensors = self.policy.named_tensors()
        pushed: dict[str, str] = {}
        for eng in fleet.client.routable_engines()["engines"]:
            fail = push_fault is not None and eng["name"] == push_fault.engine
            if fail:
                push_fault.fired_step = step
                push_fault.injected_at = time.time()
                st = next((e for e in fleet.engines() if e["name"] == eng["name"]), {})
                push_fault.pid, push_fault.incarnation = st.get("pid"), st.get("incarnation")
            pushed[eng["name"]] = outcome = pusher.push(eng, tensors, version, fail_halfway=fail)
            if fail:
                push_fault.confirmed = outcome.startswith("poisoned")
            if outcome.startswith("poisoned"):
                self.log(f"push of v{version} into {eng['name']}: {outcome}; reporting it poisoned")
                try:
                    fleet.client.report_failure(eng["name"], f"push of v{version} failed midway: {outcome}",
                                                poisoned=True)
                except SupervisorError as e:
                    self.log(f"could not report {eng['name']} poisoned: {e}")
        fleet.client.publish_weights(version, checkpoint=checkpoint)
        self.published = version
        return pushed

    def _poisoned_reload(self, step, fleet: Fleet, pusher: Pusher, fault: F.Fault) -> dict[str, str]:
        """No agent, a checkpoint that breaks while being reloaded: the daemon's reload
        fallback poisons the engine, which is restarted; mended, the next sync succeeds."""
        from vime.weight_sync.checkpoint import save_checkpoint

        version = self.base + self.policy.version
        ckpt = self.out / "checkpoints" / f"v{version}"
        save_checkpoint(self.policy.model, self.args.model, ckpt)
        # The trainer's agent is away (stopped by the caller): the checkpoint is all the daemon has.
        pushed = self._push_and_publish(fleet, pusher, None, step, checkpoint=ckpt)
        weights = ckpt / "model.safetensors"
        good = weights.read_bytes()
        _replace_bytes(weights, good[: len(good) // 2])  # truncated after it was validated
        eng = next(e for e in fleet.engines() if e["name"] == fault.engine)
        fault.pid, fault.incarnation, fault.fired_step = eng.get("pid"), eng.get("incarnation"), step
        fault.injected_at = time.time()
        F.kill_server(fault.pid)
        self.log(f"FAULT kill -9 {fault.engine} in the gap of step {step}, no agent, checkpoint {ckpt} truncated")
        ev = self.recorder.wait_for(lambda e: e.get("event") == "sync_failed" and e.get("engine") == fault.engine
                                    and e.get("ts", 0) >= fault.injected_at, self.args.fault_wait,
                                    raise_on_timeout=False)
        fault.confirmed = ev is not None  # the daemon's reload really failed
        fault.note = f"reload failed: {(ev or {}).get('reason', 'not seen')[:150]}"
        _replace_bytes(weights, good)
        self._start_agent()
        self.log(f"checkpoint mended and the agent back after: {fault.note}")
        return pushed


def _replace_bytes(path: Path, data: bytes) -> None:
    """Rewrite a file atomically: a concurrent reader sees the old bytes or the new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# -- output --------------------------------------------------------------------------------


def quiet_rollout_log() -> None:
    """One line per re-sent request is too much beside the step table (which counts them)."""
    import logging

    logging.getLogger("vime.rollout").setLevel(logging.ERROR)


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s" if v < 10 else f"{v:.1f}s"


def format_report(rep: Report) -> str:
    lines = ["", "steps", f"  {'step':>4} {'round':>5} {'ver':>4} {'reward':>6} {'gap':>8} {'re-sent':>7}  engines"]
    for s in rep.steps:
        gap = "-" if s.logprob_gap_max is None else f"{s.logprob_gap_max:.1e}"
        eng = " ".join(f"{k}:{v}" for k, v in sorted(s.engines.items()))
        lines.append(f"  {s.step:>4} {s.round if s.round is not None else '-':>5} "
                     f"{s.version if s.version is not None else '-':>4} {s.reward_mean:>6.2f} {gap:>8} "
                     f"{s.resent:>7}  {eng}{'  LOST ' + (s.error or '') if s.lost else ''}")
    if rep.faults:
        lines += ["", "faults", f"  {'fault':<30}{'engine':<11}{'step':>5}{'detected':>10}{'back up':>10}"
                  f"{'resynced':>10}  how it was seen"]
        for f in rep.faults:
            if f.injected_at is None:
                lines.append(f"  {F.WHAT[f.kind]:<30}{'-':<11}{f.step:>5}  not injected: {f.note or 'run too short'}")
                continue
            lines.append(f"  {F.WHAT[f.kind]:<30}{f.engine:<11}{f.fired_step:>5}{_s(f.after(f.detected_at)):>10}"
                         f"{_s(f.after(f.ready_at)):>10}{_s(f.after(f.resynced_at)):>10}  "
                         f"{(f.detected_as or 'not detected')[:90]}")
    if rep.engines:
        lines += ["", f"engines at the end (trainer at v{rep.final_version})"]
        for name, e in sorted(rep.engines.items()):
            lines.append(f"  {name:<12}{e['state']:<10}v{e['weight_version']}  restarts {e.get('restarts')}")
    if rep.stopped:
        lines += ["", f"STOPPED EARLY: {rep.stopped}"]
    lines += ["", f"rounds lost {rep.rounds_lost}   stale responses {rep.stale_responses}   "
              f"agent syncs {len(rep.syncs)} ({sum(1 for s in rep.syncs if s['ok'])} ok)   "
              f"reward {rep.steps[0].reward_mean if rep.steps else 0:.2f} -> "
              f"{rep.steps[-1].reward_mean if rep.steps else 0:.2f}   {rep.seconds:.0f}s"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m vime.trainer.rl_loop", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the policy's model directory (trainer/tiny_model.py builds one)")
    ap.add_argument("--served-model-name", default=None, help="model name the engines serve (default: the only one)")
    ap.add_argument("--socket", default=None, help="the daemon's control socket ($VIME_SUPERVISOR_SOCKET)")
    ap.add_argument("--out", default="rl-run", help="folder for summary.json, trace.json, long_tail.json")
    g = ap.add_argument_group("rollout and training (slime's names)")
    g.add_argument("--num-rollout", type=int, default=30, help="steps (one round each)")
    g.add_argument("--rollout-batch-size", type=int, default=4, help="prompts per round")
    g.add_argument("--n-samples-per-prompt", type=int, default=8, help="samples per prompt (the GRPO group)")
    g.add_argument("--rollout-max-response-len", type=int, default=12)
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--target", default=TARGET, help="reward 1 when the sampled text contains this")
    g = ap.add_argument_group("faults on demand (each waits in the gap until every engine is RUNNING)")
    g.add_argument("--kill-at", type=int, default=0, metavar="STEP", help="kill -9 an engine's server during that round")
    g.add_argument("--hang-at", type=int, default=0, metavar="STEP", help="SIGSTOP an engine's EngineCore during that round")
    g.add_argument("--fail-push-at", type=int, default=0, metavar="STEP", help="fail the push into one engine midway")
    g.add_argument("--fault-delay", type=float, default=2.0,
                   help="longest wait into a round for requests in flight before kill/hang (else postponed)")
    g.add_argument("--fault-wait", type=float, default=300.0, help="longest wait for a whole fleet before a fault")
    g.add_argument("--sync-wait", type=float, default=60.0, help="longest wait in a gap for engines being synced")
    g.add_argument("--final-wait", type=float, default=300.0, help="longest wait at the end for every engine to be current")
    g = ap.add_argument_group("when to stop early")
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_rollout_log()
    if args.debug_train_only and not args.load_debug_rollout_data:
        build_parser().error("--debug-train-only needs --load-debug-rollout-data PATH_WITH_{rollout_id}")
    if args.debug_train_only and args.debug_rollout_only:
        build_parser().error("--debug-train-only and --debug-rollout-only exclude each other")
    if args.load_debug_rollout_data and (args.kill_at or args.hang_at or args.fail_push_at):
        build_parser().error("faults need live rollouts: drop --load-debug-rollout-data")
    try:
        rep = RLLoop(args).run()
    except (OSError, ValueError, SupervisorError) as e:  # a missing or bad dump, no daemon
        print(f"rl_loop: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(format_report(rep))
    if rep.signal is not None:
        return 128 + rep.signal
    ok = not rep.stopped and rep.rounds_lost == 0 and rep.stale_responses == 0 and (
        args.debug_train_only or args.debug_rollout_only
        or all(e["weight_version"] == rep.final_version for e in rep.engines.values() if e["state"] != "FATAL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
