"""The chaos loop: the example RL loop (trainer/rl_loop.py) with faults injected at its hook
points, on the real engine processes (harness/faults.py). The demo, the soak and the goodput
bench run it (docs/testing.md, docs/getting-started.md).

    python -m vime.harness.chaos --model DIR --socket PATH --kill-at 3 --hang-at 12 --fail-push-at 21
    python -m vime.harness.chaos --model DIR --socket PATH --fault kill-mid-push@4

Each fault waits, in the round gap, until every engine is RUNNING on the trainer's version, so
it is measured on a whole fleet; `faults.timeline` then reads when it was detected, back up and
resynced. The daemon fault needs hooks that restart it: DaemonKeeper (the demo's) or the soak's
Keeper.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from vime.harness import faults
from vime.harness.local_daemon import Daemon
from vime.supervisor.client import SupervisorClient, SupervisorError
from vime.trainer import rl_loop
from vime.trainer.rl_loop import WHOLE_STATES, Report, RLLoop, Rollouts


class ChaosHooks:
    """What a harness lends the chaos loop for faults it cannot do alone (harness/soak.py's
    Keeper): kill -9 of the daemon (restarted like systemd would), and a model directory that
    can be broken and mended so an engine crashes at start."""

    def kill_daemon(self) -> None:
        raise NotImplementedError("a daemon fault needs a harness that restarts the daemon")

    def break_model(self, engine: str) -> None:
        raise NotImplementedError("a crash-start fault needs a harness that owns the engine's model path")

    def fix_model(self, engine: str) -> None:
        raise NotImplementedError


class DaemonKeeper(ChaosHooks):
    """Owns a local daemon like systemd would, for the daemon fault (the demo's hooks): kill -9,
    then the same daemon started again 1 s later (systemd's RestartSec=1). Its engines run on in
    process groups of their own; the new daemon re-adopts them from its journal. `start` makes
    one local_daemon.Daemon; every daemon started is kept, so their spawned engines can be
    stopped."""

    def __init__(self, start: Callable[[], Daemon]) -> None:
        self._start = start
        self.daemons = [start()]

    @property
    def daemon(self) -> Daemon:
        """The daemon now (the last one started)."""
        return self.daemons[-1]

    def spawned_pids(self) -> list[int]:
        return [pid for d in self.daemons for pid in d.spawned_pids()]

    def kill_daemon(self) -> None:
        old = self.daemon
        old.killed_by_us = True
        old.kill()  # SIGKILL, reaped
        time.sleep(1.0)
        self.daemons.append(self._start())
        client = SupervisorClient(self.daemon.sock, connect_timeout=60)
        try:
            client.status()  # answering again
        finally:
            client.close()


@dataclass
class ChaosReport(Report):
    faults: list[faults.Fault] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {**super().as_dict(), "faults": [f.as_dict() for f in self.faults]}


class ChaosLoop(RLLoop):
    report: ChaosReport

    def __init__(self, args: argparse.Namespace, *, plan: list[faults.Fault] | None = None,
                 hooks: ChaosHooks | None = None):
        super().__init__(args)
        self.plan = plan if plan is not None else [
            faults.Fault(kind, step) for kind, step in
            (("kill", args.kill_at), ("hang", args.hang_at), ("push", args.fail_push_at),
             *(getattr(args, "fault", None) or [])) if step]
        self.report = ChaosReport(faults=self.plan)
        self.hooks = hooks or ChaosHooks()
        self.fault: faults.Fault | None = None  # the fault of the step in progress
        self.step_no = 0

    def run(self) -> ChaosReport:
        super().run()
        return self.report

    def due(self, step: int) -> faults.Fault | None:
        """The first fault not yet injected whose step has come."""
        return next((f for f in self.plan if f.fired_step is None and f.step <= step), None)

    def fault_now(self, *kinds: str) -> faults.Fault | None:
        """This step's fault, if it is of one of these kinds and not injected yet."""
        f = self.fault
        return f if f is not None and f.kind in kinds and f.fired_step is None else None

    # -- hook points -----------------------------------------------------------------------

    async def before_round(self, step: int) -> None:
        self.step_no = step
        fault = self.due(step)
        self.fault = fault if fault is not None and await self._ready_for(fault) else None

    async def during_round(self, step: int, rnd: int, gather: asyncio.Future) -> None:
        fault = self.fault_now(*faults.IN_ROUND)
        if fault is None:
            return
        try:
            await self._inject_later(fault, step, gather)
        except Exception as e:  # noqa: BLE001 - a fault that could not be injected is a note
            fault.note = f"injection failed: {type(e).__name__}: {e}"
            self.log(f"{fault.kind} fault: {fault.note}")

    async def rollout_round(self, step: int) -> tuple[int, Rollouts]:
        fault = self.fault_now("disconnect")
        if fault is None:
            return await super().rollout_round(step)
        rnd = self.next_round
        self.next_round += 1
        try:
            return await self._disconnect_mid_round(fault, step, rnd)
        except Exception as e:  # noqa: BLE001 - the round is lost; it is counted (and may stop the run)
            return rnd, Rollouts([], [], 0, True, f"{type(e).__name__}: {e}")

    async def after_round(self, step: int, rnd: int | None) -> None:
        fault = self.fault_now("kill-gap")
        if fault is not None:
            await asyncio.to_thread(self._inject, fault, step, "in the gap")

    def push_all(self, engines: list[dict[str, Any]], tensors, version: int) -> dict[str, str]:
        """The push fault's engine gets its own failing push (push_into); the others the
        step's broadcast. A mid-push fault acts inside the step's broadcast."""
        mid = self.fault_now(*faults.MID_PUSH)
        if mid is not None and any(e["name"] == mid.engine for e in engines):
            if self.pusher.backend != "gloo":  # Pusher.push_many broadcasts with gloo only
                mid.note = f"not injected: backend {self.pusher.backend} pushes one engine after the other"
            elif mid.kind == "trainer-dies-mid-push":
                return self._trainer_dies(mid, engines, tensors, version)
            else:
                return self._fault_mid_broadcast(mid, engines, tensors, version)
        fault = self.fault_now("push")
        victim = next((e for e in engines if fault is not None and e["name"] == fault.engine), None)
        if victim is None:
            return super().push_all(engines, tensors, version)
        out = super().push_all([e for e in engines if e is not victim], tensors, version)
        out[victim["name"]] = self.push_into(victim, tensors, version)
        return out

    def push_into(self, engine: dict[str, Any], tensors, version: int) -> str:
        fault = self.fault_now("push")
        if fault is None or engine["name"] != fault.engine:
            return super().push_into(engine, tensors, version)
        from vime.weight_sync.sender import WeightSender

        fault.fired_step, fault.injected_at = self.step_no, time.time()
        st: Mapping[str, Any] = next((e for e in self.view.engines() if e["name"] == engine["name"]), {})
        fault.pid, fault.incarnation = st.get("pid"), st.get("incarnation")
        url = engine["url"]
        self.pusher.drop(url)
        # Its own sender, in small buckets, so "halfway" is inside the transfer.
        sender = WeightSender(url, backend=self.pusher.backend, bucket_bytes=256 << 10, solo_bytes=None,
                              progress=faults.FailHalfway())
        try:
            outcome = self.pusher.push_with(sender, url, tensors, version)
        finally:
            sender.close()
        fault.confirmed = outcome.startswith("poisoned")
        return outcome

    def _engine_status(self, name: str) -> Mapping[str, Any]:
        return next((e for e in self.view.engines() if e["name"] == name), {})

    def _fault_mid_broadcast(self, fault: faults.Fault, engines: list[dict[str, Any]], tensors,
                             version: int) -> dict[str, str]:
        """kill -9 / SIGSTOP of the victim's process group once half the step's broadcast is on
        the wire (its progress "bucket_sent"): the push fails for it, the survivors are redone."""
        from vime.weight_sync.broadcast import FleetSender

        st = self._engine_status(fault.engine or "")
        pid, incarnation = st.get("pid"), st.get("incarnation")
        assert pid is not None  # a spawned engine of the fleet
        act = faults.kill_group if fault.kind == "kill-mid-push" else faults.stop_group
        what = "kill -9" if fault.kind == "kill-mid-push" else "SIGSTOP"

        def fire(sent: int, of: int) -> None:
            fault.fired_step, fault.injected_at = self.step_no, time.time()
            fault.pid, fault.incarnation = pid, incarnation
            act(pid)
            self.log(f"FAULT {what} {fault.engine} (process group {pid}) after {sent} of {of} buckets "
                     f"of the broadcast of v{version}, step {self.step_no}")

        if self.pusher.fleet is None:  # as Pusher.push_many makes it, so the hook can be set
            self.pusher.fleet = FleetSender(master_address=self.pusher.master_address)
        fleet = self.pusher.fleet
        saved = fleet.progress, fleet.bucket_bytes, fleet.solo_bytes
        # Small buckets, so "halfway" is inside the transfer of even a tiny model.
        fleet.progress = faults.AfterBucket(fire)
        fleet.bucket_bytes, fleet.solo_bytes = 256 << 10, None
        try:
            out = super().push_all(engines, tensors, version)
        finally:
            fleet.progress, fleet.bucket_bytes, fleet.solo_bytes = saved
        mine = out.get(fault.engine or "")
        others = {n: o for n, o in out.items() if n != fault.engine}
        # Confirmed: it was injected inside the push, the push failed for the victim only, and
        # every survivor ended the step at the version (redone over them).
        fault.confirmed = (fault.injected_at is not None and mine is not None and mine != "ok"
                           and all(o == "ok" for o in others.values()))
        fault.note = (f"push of v{version}: {fault.engine} {(mine or 'no outcome')[:100]}; survivors "
                      + (", ".join(f"{n} {o[:60]}" for n, o in sorted(others.items())) or "none"))
        if fault.injected_at is None:
            fault.note = f"not injected: the broadcast of v{version} ended before half its buckets; " + fault.note
        return out

    def _trainer_dies(self, fault: faults.Fault, engines: list[dict[str, Any]], tensors,
                      version: int) -> dict[str, str]:
        """The step's broadcast runs in a child process, announced here and never ended: the
        child is killed -9 after half its buckets, as a trainer that dies. Every receiver is
        left paused mid-session; the daemon's announced-push deadline condemns each (paused
        past it), and restarts it. Waits (bounded) until each receiver is condemned."""
        from vime.weight_sync.broadcast import push_bound
        from vime.weight_sync.sender import named_tensor_list, push_deadline

        names = [e["name"] for e in engines]
        urls = [e["url"].rstrip("/") for e in engines]
        for url in urls:  # the child's group replaces the loop's in every receiver
            self.pusher.drop(url)
        if self.pusher.fleet is not None:
            self.pusher.fleet.drop_group()
        pairs = named_tensor_list(tensors)
        nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
        deadline = push_deadline(nbytes)  # FleetSender's bound for these bytes
        path = faults.save_tensors(pairs, self.out / "mid-push" / f"v{version}.pt")
        st = {n: self._engine_status(n) for n in names}
        bound = push_bound(deadline, redo=False)  # as FleetSender announces the child's push
        push_id = None
        if hasattr(self.client, "push_begin"):
            try:
                push_id = self.client.push_begin(version, names, nbytes, bound)
            except SupervisorError as e:
                self.log(f"could not announce the push of v{version}: {e}")
        cmd = faults.child_push_command(path, urls, version, deadline)
        killed, what = faults.kill_child_after(cmd, timeout=bound)
        fault.fired_step = self.step_no
        failed = {n: f"failed: the trainer's push died mid-transfer ({what})" for n in names}
        if not killed:  # not injected (the soak counts it so); the receivers' fate is the daemon's
            fault.note = f"not injected: the child push of v{version}: {what}"
            return failed
        fault.injected_at = time.time()
        self.log(f"FAULT the trainer's push of v{version} into {', '.join(names)} (push {push_id}, not ended): "
                 f"{what}")
        # Each receiver must be condemned by the daemon itself: paused past the push's deadline
        # (or, were it to happen, gone). Bounded: the push's bound, its grace, a few probes.
        seen: dict[str, str] = {}
        until = time.monotonic() + bound + self.args.fault_wait
        since = fault.injected_at
        for n in names:
            def condemned(e: dict[str, Any], n: str = n) -> bool:
                return (e.get("event") == "transition" and e.get("engine") == n
                        and e.get("to_state") in ("UNHEALTHY", "EXITED") and e.get("ts", 0) >= since)
            ev = self.recorder.wait_for(condemned, max(0.0, until - time.monotonic()), raise_on_timeout=False)
            seen[n] = "not condemned" if ev is None else f"{ev.get('to_state')} ({ev.get('cause')})"
        want = f"({faults.DETECTED_AS[fault.kind].value})"
        note = (f"child push {what}; announced as {push_id} ({bound:.1f}s), not ended; receivers: "
                + ", ".join(f"{n} {s}" for n, s in seen.items()))
        # Every receiver is a victim: one Fault each (the others added to the plan beside this
        # one, already injected), so each is timed, checked and matched to its own restart.
        at = self.plan.index(fault) + 1
        for n in names:
            f = fault if n == fault.engine else faults.Fault(fault.kind, fault.step, engine=n)
            if f is not fault:
                self.plan.insert(at, f)
                at += 1
            f.fired_step, f.injected_at = fault.fired_step, fault.injected_at
            f.pid, f.incarnation = st[n].get("pid"), st[n].get("incarnation")
            f.confirmed = push_id is not None and seen[n].endswith(want)
            f.note = note
        return failed

    def train_and_push(self, step: int, samples):
        fault = self.fault_now("poison-reload")
        if fault is None:
            dies = self.fault_now("trainer-dies-mid-push")
            out = super().train_and_push(step, samples)
            if dies is not None and dies.injected_at is not None:
                # Every engine was condemned: wait (bounded) for them RUNNING at the version, or
                # the next round would open with none to route to.
                view = self.view
                whole = view.wait(lambda: view.whole(self.published), self.args.fault_wait)
                self.log(f"after the trainer died mid-push: fleet whole again at v{self.published}: {whole}")
            return out
        self.stop_agent()  # before taking the lock: the agent may be waiting for it
        with self.policy.lock:
            stats = self.policy.train_step(samples)
            pushed = self._poisoned_reload(step, fault)
        self.view.settle_syncs(self.args.sync_wait)
        return stats, pushed

    async def generate(self, step: int, prompts: list[str]):
        tail = self.fault_now("kill") is not None or step == self.args.long_tail_at
        n = min(self.args.long_tail, len(prompts)) if tail else 0
        if not n:
            return await super().generate(step, prompts)
        assert self.rollout is not None
        # The long ones first, so each engine gets some (fewest outstanding, ties round robin).
        long = asyncio.ensure_future(self.rollout.gather(
            prompts[:n], **{**self.sampling(), "max_tokens": self.args.long_tail_tokens, "ignore_eos": True}))
        short = asyncio.ensure_future(self.rollout.gather(prompts[n:], **self.sampling()))
        try:
            return [*await long, *await short]
        finally:
            for t in (long, short):
                t.cancel()
            await asyncio.gather(long, short, return_exceptions=True)

    def after_run(self) -> None:
        for f in self.plan:
            faults.timeline(f, self.recorder.events)

    # -- waiting for a whole fleet ---------------------------------------------------------

    async def _ready_for(self, fault: faults.Fault) -> bool:
        """A fault is injected on a whole fleet: wait for it in the gap (bounded)."""
        view = self.view
        if not await asyncio.to_thread(view.whole, self.published):
            self.log(f"{fault.kind} fault due: waiting (gap) for every engine to be RUNNING on v{self.published}")
            ok = await asyncio.to_thread(view.wait, lambda: view.whole(self.published), self.args.fault_wait)
            if not ok:
                fault.note = f"postponed: fleet not whole within {self.args.fault_wait:g}s"
                return False
        if fault.kind in faults.NO_ENGINE:
            fault.engine = fault.kind
            return True
        engines = sorted(e["name"] for e in await asyncio.to_thread(view.engines) if e["state"] in WHOLE_STATES)
        last = [f.engine for f in self.plan if f.engine is not None and f.kind not in faults.NO_ENGINE]
        fresh = [n for n in engines if not last or n != last[-1]]
        fault.engine = (fresh or engines)[0]
        return True

    async def _in_flight(self, gather: asyncio.Future, engine: str | None = None) -> None:
        """Wait (at most fault_delay) until this round has requests in flight (on `engine`)."""
        deadline = time.monotonic() + self.args.fault_delay
        while not gather.done() and time.monotonic() < deadline:
            assert self.rollout is not None  # connected for the round
            out = self.rollout.outstanding()
            if (out.get(engine) if engine else out):
                return
            await asyncio.sleep(0.005)

    # -- injections ------------------------------------------------------------------------

    async def _streamed(self, gather: asyncio.Future, engine: str, tokens: int) -> bool:
        """Wait (at most fault_delay) until the client has read `tokens` output tokens of a
        request on `engine`: a kill then cuts it mid-stream."""
        assert self.rollout is not None
        deadline = time.monotonic() + self.args.fault_delay
        while not gather.done() and time.monotonic() < deadline:
            if any(p.engine == engine and p.tokens >= tokens for p in self.rollout.progress().values()):
                return True
            await asyncio.sleep(0.005)
        return False

    async def _inject_later(self, fault: faults.Fault, step: int, gather: asyncio.Future) -> None:
        if fault.kind == "kill" and self.args.long_tail:
            # The pid first: from the read to the kill nothing waits, the long request streams on.
            engines = [dict(e) for e in await asyncio.to_thread(self.view.engines)]
            if fault.engine is None or not await self._streamed(gather, fault.engine, self.args.kill_after_tokens):
                fault.engine = None
                fault.note = (f"no request on the engine streamed {self.args.kill_after_tokens} tokens within "
                              f"--fault-delay {self.args.fault_delay:g}s of step {step}; postponed")
                return
            fault.confirmed = True  # a request was mid-stream on it
            self._inject(fault, step, "during the round (a long request mid-stream)", engines)
            return
        core, snapshot = None, None
        if fault.kind == "hang":
            # The EngineCore is looked up first (a daemon call and a /proc scan): done between
            # seeing a request in flight and the SIGSTOP, they let a short round end first and
            # the hang land in the gap. The stop then goes from this thread, at once.
            snapshot = [dict(e) for e in await asyncio.to_thread(self.view.engines)]
            pid = next((e.get("pid") for e in snapshot if e["name"] == fault.engine), None)
            try:
                core = await asyncio.to_thread(faults.engine_core_pid, pid) if isinstance(pid, int) else None
            except LookupError:  # _inject looks again and reports it as before
                core = None
        await self._in_flight(gather, None if fault.kind in faults.NO_ENGINE else fault.engine)
        if gather.done():  # the round finished first: try again at the next step
            fault.engine = None
            fault.note = f"round of step {step} ended before the injection; postponed"
            return
        fault.confirmed = True  # injected with the round's requests in flight
        if core is not None:
            self._inject(fault, step, "during the round", snapshot, core)
        else:
            await asyncio.to_thread(self._inject, fault, step, "during the round")

    def _inject(self, fault: faults.Fault, step: int, when: str, engines: list[dict[str, Any]] | None = None,
                core: int | None = None) -> None:
        engines = [dict(e) for e in self.view.engines()] if engines is None else engines
        fault.fired_step, fault.injected_at = step, time.time()
        if fault.kind == "daemon":
            fault.note = "pids before: " + ", ".join(f"{e['name']}={e.get('pid')}" for e in engines)
            self.hooks.kill_daemon()
            self.log(f"FAULT kill -9 of the daemon {when} of step {step}")
            return
        eng = next(e for e in engines if e["name"] == fault.engine)
        fault.pid, fault.incarnation = eng.get("pid"), eng.get("incarnation")
        assert fault.engine is not None and fault.pid is not None  # a spawned engine of the fleet
        if fault.kind == "hang":
            core = faults.hang_core(fault.pid, core)
            fault.note = f"EngineCore pid {core}"
            self.log(f"FAULT SIGSTOP {fault.engine}'s EngineCore (pid {core}) {when} of step {step}")
            return
        if fault.kind == "crash-start":
            self.hooks.break_model(fault.engine)
            threading.Thread(target=self._mend_after_crash, args=(fault,), daemon=True).start()
        faults.kill_server(fault.pid)
        self.log(f"FAULT kill -9 {fault.engine} (pid {fault.pid}) {when} of step {step}"
                 + (" with its model broken: the restart will crash" if fault.kind == "crash-start" else ""))

    def _mend_after_crash(self, fault: faults.Fault) -> None:
        """Once the restart has crashed (BACKOFF), mend the model so the next attempt boots."""
        assert fault.engine is not None  # _inject chose it
        ev = self.recorder.wait_for(lambda e: e.get("event") == "transition" and e.get("engine") == fault.engine
                                    and e.get("to_state") in ("BACKOFF", "FATAL")
                                    and e.get("ts", 0) >= fault.injected_at, self.args.fault_wait,
                                    raise_on_timeout=False)
        self.hooks.fix_model(fault.engine)
        fault.confirmed = ev is not None  # the restart really crashed
        fault.note = f"start crashed ({(ev or {}).get('reason', 'not seen')[:120]}); model mended"
        if ev is not None and ev["to_state"] == "FATAL":
            SupervisorClient(self.args.socket).start(fault.engine)  # what an operator would do

    async def _disconnect_mid_round(self, fault: faults.Fault, step: int, rnd: int) -> tuple[int, Rollouts]:
        """The trainer goes away mid-round (its rollout client and resync agent drop their
        connections, its requests are abandoned); a trainer that connects again finds the round
        open, ends it, and runs the step again in a new round."""
        client = self.client
        await asyncio.to_thread(client.start_round, rnd)
        assert self.rollout is not None  # connected for the round
        await self.rollout.refresh(force=True)
        gather = asyncio.ensure_future(self.rollout.gather(self.prompts(), **self.sampling()))
        await self._in_flight(gather)
        fault.fired_step, fault.injected_at = step, time.time()
        fault.confirmed = not gather.done()  # requests were in flight when it went
        gather.cancel()
        await asyncio.gather(gather, return_exceptions=True)
        await self.disconnect()
        self.log(f"FAULT the trainer disconnected in round {rnd} of step {step}")
        await asyncio.sleep(1.0)
        await self.connect()
        status = await asyncio.to_thread(client.status)
        if status["round_open"] and status["round"] == rnd:
            await asyncio.to_thread(client.end_round, rnd)
            fault.detected_as = f"reconnected: round {rnd} was still open; ended it, step {step} runs again"
        else:
            fault.confirmed = False
            fault.detected_as = (f"reconnected: round {rnd} was not open ({status.get('round')}, "
                                 f"open {status.get('round_open')})")
        fault.detected_at = fault.ready_at = time.time()
        self.tracer.add_round(rnd, fault.injected_at, time.time(), step=step, abandoned=True)
        rnd2, out = await super().rollout_round(step)
        fault.resynced_at = time.time()
        fault.resync_reason = f"step {step} completed in round {rnd2}"
        return rnd2, out

    def _poisoned_reload(self, step: int, fault: faults.Fault) -> dict[str, str]:
        """No agent, a checkpoint that breaks while being reloaded: the daemon's reload
        fallback poisons the engine, which is restarted; mended, the next sync succeeds."""
        from vime.weight_sync.checkpoint import save_checkpoint

        version = self.base + self.policy.version
        ckpt = self.out / "checkpoints" / f"v{version}"
        save_checkpoint(self.policy.model, self.args.model, ckpt)
        # The trainer's agent is away (stopped by the caller): the checkpoint is all the daemon has.
        pushed = self.push_and_publish(checkpoint=ckpt)
        weights = ckpt / "model.safetensors"
        good = weights.read_bytes()
        _replace_bytes(weights, good[: len(good) // 2])  # truncated after it was validated
        eng = next(e for e in self.view.engines() if e["name"] == fault.engine)
        fault.pid, fault.incarnation, fault.fired_step = eng.get("pid"), eng.get("incarnation"), step
        fault.injected_at = time.time()
        assert fault.pid is not None  # a spawned engine of the fleet
        faults.kill_server(fault.pid)
        self.log(f"FAULT kill -9 {fault.engine} in the gap of step {step}, no agent, checkpoint {ckpt} truncated")
        ev = self.recorder.wait_for(lambda e: e.get("event") == "sync_failed" and e.get("engine") == fault.engine
                                    and e.get("ts", 0) >= fault.injected_at, self.args.fault_wait,
                                    raise_on_timeout=False)
        fault.confirmed = ev is not None  # the daemon's reload really failed
        fault.note = f"reload failed: {(ev or {}).get('reason', 'not seen')[:150]}"
        _replace_bytes(weights, good)
        self.start_agent()
        self.log(f"checkpoint mended and the agent back after: {fault.note}")
        return pushed


def _replace_bytes(path: Path, data: bytes) -> None:
    """Rewrite a file atomically: a concurrent reader sees the old bytes or the new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# -- output --------------------------------------------------------------------------------


def fmt_seconds(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s" if v < 10 else f"{v:.1f}s"


def format_faults(plan: list[faults.Fault]) -> list[str]:
    if not plan:
        return []
    lines = ["", "faults", f"  {'fault':<30}{'engine':<11}{'step':>5}{'detected':>10}{'back up':>10}"
             f"{'resynced':>10}  how it was seen"]
    for f in plan:
        if f.injected_at is None:
            lines.append(f"  {faults.WHAT[f.kind]:<30}{'-':<11}{f.step:>5}  not injected: {f.note or 'run too short'}")
            continue
        lines.append(f"  {faults.WHAT[f.kind]:<30}{f.engine:<11}{f.fired_step:>5}"
                     f"{fmt_seconds(f.after(f.detected_at)):>10}{fmt_seconds(f.after(f.ready_at)):>10}"
                     f"{fmt_seconds(f.after(f.resynced_at)):>10}  {(f.detected_as or 'not detected')[:90]}")
    for f in plan:
        if f.spare is not None:
            gap = "the round ended" if f.kind in faults.IN_ROUND else "the fault"
            when = (f"{fmt_seconds(f.after(f.full_at))} after the fault, inside the round" if f.filled_in_round()
                    else f"{fmt_seconds(f.full_after_gap())} after {gap}")
            lines.append(f"  {faults.WHAT[f.kind]} of {f.engine}: warm spare {f.spare} promoted, full strength "
                         f"{when}; {f.engine}'s own restart was ready "
                         f"{fmt_seconds(f.after(f.ready_at))} after the fault (without a spare, the fleet is short "
                         "at least that long)")
    return lines


def format_report(rep: Report) -> str:
    """The loop's report with the faults table between the steps and the end."""
    return "\n".join(rl_loop.format_steps(rep) + format_faults(getattr(rep, "faults", []))
                     + rl_loop.format_end(rep))


# -- command line --------------------------------------------------------------------------


# The kinds the loop injects without a harness's hooks (ChaosHooks): crash-start and the
# daemon faults need harness/soak.py's Keeper.
CLI_KINDS = ("kill", "hang", "push", "kill-gap", "poison-reload", "disconnect", *faults.MID_PUSH)


# With DaemonKeeper's hooks (the demo's): the daemon killed -9 mid-round and started again.
KEEPER_KINDS = (*CLI_KINDS, "daemon")


def parse_fault(text: str, kinds: tuple[str, ...] = CLI_KINDS) -> tuple[str, int]:
    """KIND@STEP, e.g. kill-mid-push@5: (kind, step)."""
    kind, sep, step = text.rpartition("@")
    if not sep or kind not in kinds or not step.isdigit() or int(step) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want KIND@STEP, KIND one of {', '.join(kinds)}, STEP >= 1")
    return kind, int(step)


def build_parser(kinds: tuple[str, ...] = CLI_KINDS) -> argparse.ArgumentParser:
    """The loop's flags; `kinds` are the fault kinds --fault takes (KEEPER_KINDS where the
    caller lends DaemonKeeper's hooks)."""
    ap = rl_loop.build_parser(prog="python -m vime.harness.chaos", description=__doc__)
    g = ap.add_argument_group("faults on demand (each waits in the gap until every engine is RUNNING)")
    g.add_argument("--kill-at", type=int, default=0, metavar="STEP", help="kill -9 an engine's server during that round")
    g.add_argument("--hang-at", type=int, default=0, metavar="STEP", help="SIGSTOP an engine's EngineCore during that round")
    g.add_argument("--fail-push-at", type=int, default=0, metavar="STEP", help="fail the push into one engine midway")
    g.add_argument("--fault", type=lambda text: parse_fault(text, kinds), action="append", metavar="KIND@STEP",
                   help="a fault by its harness/faults.py name (repeatable): "
                        f"{', '.join(k for k in faults.KINDS if k in kinds)}")
    g.add_argument("--fault-delay", type=float, default=2.0,
                   help="longest wait into a round for requests in flight before kill/hang (else postponed)")
    g.add_argument("--fault-wait", type=float, default=300.0, help="longest wait for a whole fleet before a fault")
    g.add_argument("--long-tail", type=int, default=0, metavar="N",
                   help="in the round of a kill (--kill-at, --fault kill@STEP), N samples run to "
                        "--long-tail-tokens (ignore_eos), and the kill waits until one on its engine has streamed "
                        "--kill-after-tokens: it is cut mid-stream and continued elsewhere (or, with "
                        "--no-continue-partial, sent again whole)")
    g.add_argument("--long-tail-at", type=int, default=0, metavar="STEP",
                   help="give that step's round the --long-tail too, fault or not (a fault-free baseline then "
                        "does the same work as a run whose kill is at that step)")
    g.add_argument("--long-tail-tokens", type=int, default=200, metavar="T")
    g.add_argument("--kill-after-tokens", type=int, default=16, metavar="K")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    return rl_loop.run_and_report(ChaosLoop, args, "chaos", format_report)


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """rl_loop's checks, and what the chaos loop cannot do (argparse's exit status 2). Its
    parser is rl_loop's, so it lists --async and --serving-fraction; ChaosLoop runs rounds
    (sync mode) only, so it refuses --async (rl_loop refuses --serving-fraction without it)."""
    rl_loop.check_args(ap, args)
    if args.async_:
        ap.error("--async: the chaos loop injects its faults around rounds (sync mode) only; for an async run use "
                 "python -m vime.trainer.rl_loop --async (or the demo: python -m vime.harness.demo --async)")
    if args.load_debug_rollout_data and (args.kill_at or args.hang_at or args.fail_push_at or args.fault):
        ap.error("faults need live rollouts: drop --load-debug-rollout-data")


if __name__ == "__main__":
    sys.exit(main())
