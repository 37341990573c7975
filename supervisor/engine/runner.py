"""One engine's lifecycle: the I/O around its pure state machine.

A spawned engine's task loops: start (wait for its port, spawn, wait until ready inside
first_wait), heartbeat until it dies or must be stopped, then wait for the fleet policy's
permission to restart (round gaps) or for its backoff to pass. An attached engine is only
probed.

The runner alone drives its state machine: the fleet and the sync coordinator call its verbs
(one per intent: `report_failure`, `condemn_and_stop`, `mark_outdated`, `begin_sync`,
`finish_sync`, `release`, `note`, `stop`, `request_start`), never `runner.fsm`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable, Protocol

import aiohttp
import structlog
from tenacity import AsyncRetrying, RetryError, retry_if_result, stop_after_delay, wait_exponential_jitter

from . import postmortem, retention
from .activity import sample_group
from ..config import Config, EngineSpec
from ..events import EventBus
from .adoption import Adoption
from .fingerprint import Verdict, relabel, unverified
from .fsm import EngineFSM, PushWindow, vlabel
from .heartbeat import HeartbeatSchedule
from .probes import Prober
from .process import (
    ChildProcess,
    classify_failure,
    describe_returncode,
    engine_command,
    engine_env,
    make_engine_caches,
    port_is_free,
    process_start_time,
    read_tail,
)
from ..protocol import Event
from ..states import DAEMON_LIMIT, PROCESS_STATES, Cause, ProbeOutcome, State, Transition, VersionRule, detection_kind
from ..tasks import TaskSet, cancel_and_wait, wait_event, within
from .warmup import WarmupFailed, warm_up

S = State
log = structlog.get_logger("vime.engine")


class StartFailed(Exception):
    """A start that failed before the engine ran; `permanent`: retrying cannot help."""

    def __init__(self, error: str, permanent: bool = False):
        super().__init__(error)
        self.error = error
        self.permanent = permanent


@dataclass(frozen=True)
class VersionRead:
    """One engine's /weight_info read at a publish, with the incarnation and state it was read
    in (read_version, then take_version: the fleet reads every engine, then applies them all
    at once with the version they are judged against)."""

    incarnation: int
    state: State
    held: int | str | None  # the label when it was read: a label moved since (a push's end) stands
    version: int | str | None


class RestartGate(Protocol):
    """What a runner asks of the fleet's policy (policy.FleetPolicy is the one the daemon
    hands in): the engine group owns the question, the fleet group answers it."""

    target: int | None
    current_version: int | None
    rule: VersionRule  # which versions may serve (states.VersionRule)

    def may_restart(self, *, spare: bool = False) -> tuple[bool, str | None]: ...
    def hold_reason(self) -> str | None: ...
    def spare_reason(self) -> str | None: ...


async def _nothing() -> None:
    """No journal (tests, tools): nothing to persist."""


async def label_alone(runner: EngineRunner, version: int | str | None) -> Verdict:
    """No fingerprint to run: the engine holds what /weight_info says."""
    return Verdict(version)


class EngineRunner:
    def __init__(self, spec: EngineSpec, cfg: Config, policy: RestartGate, bus: EventBus,
                 session: aiohttp.ClientSession, *, phase: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, persist: Callable[[], Awaitable[None]] = _nothing):
        self.spec = spec
        self.cfg = cfg
        self.policy = policy  # may it restart now, is it held out of routing, the current version
        self.bus = bus
        # Awaited once a new process is spawned: its pid is on disk before this runner goes on
        # (the journal's writer thread does the fsyncs; other runners run meanwhile).
        self.persist = persist
        self.clock = clock
        self.phase = phase  # offset inside the interval, to spread probes across the fleet
        self.fsm = EngineFSM(spec.name, cfg.probe, cfg.restart, clock, on_transition=self._transition)
        # Set (and replaced) at every transition and whenever the process is let go: what
        # stop() waits on instead of polling.
        self._changed = asyncio.Event()
        self._proc: ChildProcess | None = None
        self.prober = Prober(session, spec.base_url, spec.model_name, cfg.probe.timeout,
                             group=lambda: self.proc.pid if self.proc is not None else None,
                             api_key=cfg.api_key or api_key(cfg.engine_args + spec.args,
                                                                {**cfg.engine_env, **spec.env}))
        self.log_path: Path | None = None
        # This incarnation's heartbeats only (a post-mortem is about the process being stopped).
        self.probe_history: deque[tuple[float, ProbeOutcome]] = deque(maxlen=64)
        self.probes = self.probe_failures = 0  # heartbeats, for status and bench/
        self.heartbeat = HeartbeatSchedule(cfg.probe, clock)  # when the next probe is due; late ones
        self._retired = False  # never restarted again, never routed
        self._wake = asyncio.Event()
        self._stop_now: asyncio.Event = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stop_reason: str | None = None  # set by an operator's stop: ends in STOPPED
        self.adoption = Adoption()  # what a previous daemon image left of it (adopt, restore)
        self._lost_as_spare = False  # it left STANDBY dead, hung or stopping: restarts at once
        # A spare kept current: taken out of STANDBY by a publish to be synced, still a spare
        # (not active: a failed engine's place goes to a ready spare meanwhile).
        self._syncing_as_spare = False
        self._fatal: str | None = None  # FATAL before a reload, under the same config: stays FATAL
        # restart_load = "dummy": whether a restart may boot on dummy weights now (the daemon
        # wires it: a trainer agent connected and a version published), whether this
        # incarnation did, and whether the next must read the model (a dummy one found nobody
        # to push its weights).
        self.may_load_dummy: Callable[[], bool] = lambda: False
        self.dummy_weights = False
        self._read_weights_next = False
        # What an engine answering (ready, recovered) with a weight version holds, once that
        # version's fingerprint, if one was published, was run on it (the daemon wires
        # Fleet.verify_content): it is not routable at the version before that.
        self.verify_content: Callable[[EngineRunner, int | str | None], Awaitable[Verdict]] = label_alone
        self._restored = False  # a previous daemon's journal named it
        self._recheck_pending = False  # attached and restored: its first check has not concluded
        self.start_stopped = False  # the journal says an operator stopped it: stay stopped
        self._start_pending: str | None = None  # a start asked for while a dead group is cleaned up
        self.first_start_begun = False  # this daemon has begun its first start (READY waits)
        self.stopped_by_shutdown = False  # set by shutdown(): the journal tells it from an operator's stop

    # -- what others read ------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc and self.proc.returncode is None else None

    @property
    def proc(self) -> ChildProcess | None:
        return self._proc

    @proc.setter
    def proc(self, proc: ChildProcess | None) -> None:
        self._proc = proc
        self._poke()

    @property
    def retired(self) -> bool:
        """Never restarted again, never routed (and so across daemon restarts)."""
        return self._retired

    @retired.setter
    def retired(self, retired: bool) -> None:
        self._retired = retired
        self._poke()

    @property
    def state(self) -> State:
        return self.fsm.state

    @property
    def reason(self) -> str:
        return self.fsm.reason

    @property
    def incarnation(self) -> int:
        return self.fsm.incarnation

    @property
    def weight_version(self) -> int | str | None:
        return self.fsm.weight_version

    @property
    def serving(self) -> bool:
        """In a state that takes traffic (RUNNING, SUSPECT), whatever its weights."""
        return self.fsm.routable

    @property
    def syncing_as_spare(self) -> bool:
        """A spare a publish left behind (spares_sync = "publish"), being brought to a version
        the rule allows (STALE, SYNCING): not serving, nor on its way to serve. It ends a spare
        again, or serving if a place is still empty when it is verified."""
        return self._syncing_as_spare and self.fsm.state in (S.STALE, S.SYNCING)

    @property
    def booted_behind(self) -> bool:
        """STALE since its boot ended (a restart, on older weights than the current version),
        not marked behind by a publish: it takes a place in the fleet and needs a sync first."""
        return self.fsm.state is S.STALE and self.fsm.cause is Cause.READY

    @property
    def journal_state(self) -> State:
        """What the journal records: while a re-adopted engine is being checked again (STARTING
        for a moment), the state it was adopted in, so a daemon killed in that moment hands the
        next one the same engine (a spare stays a spare, a serving one keeps serving)."""
        if self.readopting and self.adoption.state is not None and self.spec.spawned:
            return self.adoption.state
        return self.fsm.state

    @property
    def readopting(self) -> bool:
        """An engine a previous daemon image left running (adopted, or attached), taken over
        but not yet checked again."""
        if not self.spec.spawned:  # pending from the journal's word until its first check ends
            return self._recheck_pending
        if not self.adoption.up:  # it was still starting: nothing to wait for
            return False
        return self.adoption.proc is not None or (self.fsm.state is S.STARTING and self.proc is not None
                                             and self.proc.adopted)

    @property
    def probed(self) -> bool:
        return self.fsm.probed

    @property
    def consecutive_failures(self) -> int:
        return self.fsm.consecutive_failures

    # -- the task --------------------------------------------------------------------------

    def start(self, tasks: TaskSet | None = None) -> None:
        """Begin supervising, in a task of `tasks` (the daemon's) if given; shutdown() ends it."""
        body = self._run_spawned() if self.spec.spawned else self._run_attached()
        name = f"engine:{self.name}"
        self._task = tasks.spawn(body, name=name) if tasks is not None else asyncio.create_task(body, name=name)
        self._task.add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        self._poke()
        if not task.cancelled() and task.exception() is not None:
            # Supervision of this engine has stopped: say so as loudly as we can.
            log.error("engine.supervision_failed", engine=self.name, state=self.fsm.state.value,
                      error=repr(task.exception()))
            self.bus.emit(Event.SUPERVISION_FAILED, engine=self.name, error=repr(task.exception()))

    def _transition(self, t: Transition) -> None:
        if t.from_state is S.STANDBY or t.to_state in (S.STARTING, S.STALE, S.SYNCING, S.RUNNING):
            self._lost_as_spare = t.from_state is S.STANDBY and t.to_state in (S.UNHEALTHY, S.STOPPING, S.EXITED)
        if t.from_state is S.STANDBY and t.to_state is S.STALE and t.cause is Cause.OUTDATED:
            self._syncing_as_spare = True
        elif t.to_state not in (S.STALE, S.SYNCING):
            self._syncing_as_spare = False
        self._poke()
        kind = detection_kind(t)
        if kind:  # decided here, with the transition: on the stream before the transition itself
            self.bus.emit(Event.DETECTION, engine=t.engine, kind=kind, reason=t.reason, cause=t.cause.value)
        self.bus.transition(t)

    def _poke(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def next_change(self) -> asyncio.Event:
        """Set at this runner's next transition, process change, end of its task, or when its
        first start has begun. Take it before checking what you wait for."""
        return self._changed

    async def _until(self, done: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait until `done()` (checked at every transition and process change); False if
        `timeout` passed first."""
        deadline = None if timeout is None else self.clock() + timeout
        while not done():
            left = None if deadline is None else deadline - self.clock()
            if left is not None and left <= 0:
                return False
            await wait_event(self._changed, left)
        return True

    def wake(self) -> None:
        """Re-evaluate now (a round ended, an operator asked for something)."""
        self._wake.set()

    async def _sleep_or_wake(self, seconds: float | None) -> None:
        self._wake.clear()
        await wait_event(self._wake, seconds)

    # -- spawned engines -------------------------------------------------------------------

    def adopt(self, proc: ChildProcess, entry: dict, after: str = "a daemon restart") -> None:
        """Take over this engine's process from a previous daemon's journal `entry`: `proc`,
        judged ours and wanted (adoption.verdict) and taken over (adoption.take_over), in a
        state worth keeping. Call before start()."""
        spawned_at = entry.get("spawned_at")
        self.adoption = Adoption.of(proc, str(entry.get("state")), after=after,  # a kept state's value
                                    age=max(0.0, time.time() - spawned_at) if spawned_at else 0.0,
                                    spares=self.policy.target is not None)
        self.fsm.incarnation = max(0, int(entry.get("incarnation", 1)) - 1)
        self.fsm.restarts = int(entry.get("restarts", 0))

    async def _run_spawned(self) -> None:
        fsm = self.fsm
        if self._fatal is not None:
            fsm.carry(S.FATAL, self._fatal)
        elif self.adoption.proc is not None:
            fsm.begin_start(f"re-adopting pid {self.adoption.proc.pid} after {self.adoption.after}", restart=False,
                            cause=Cause.RESTORED)
            fsm.spawned_at = self.clock() - self.adoption.age  # first_wait counts from its spawn
        elif self.start_stopped:
            fsm.annotate("stopped by request (before a daemon restart)")
        else:  # this daemon's first start of it (a daemon restart is no engine restart)
            fsm.begin_start("start", restart=False)
        self.first_start_begun = True
        self._poke()
        while True:
            if self._start_pending is not None and self.proc is None and fsm.state in (
                    S.STOPPED, S.EXITED, S.BACKOFF, S.FATAL):
                reason, self._start_pending = self._start_pending, None
                self.start_stopped = False
                fsm.reset_budget()
                fsm.begin_start(reason, cause=Cause.OPERATOR)
            if fsm.state is S.STARTING:
                # The deep probe's kept-alive connection belongs to one process: dropped before
                # and after each incarnation (also when cancelled at shutdown), so a new process
                # is never probed over a connection to the old one.
                self.prober.close()
                try:
                    await self._incarnation()
                finally:
                    self.prober.close()
            elif fsm.state is S.BACKOFF:
                await self._sleep_or_wake(max(0.0, (fsm.backoff_until or 0) - self.clock()))
                if fsm.state is S.BACKOFF and self.clock() >= (fsm.backoff_until or 0):
                    fsm.begin_start(f"retry after start failure {fsm.failed_starts}", cause=Cause.RETRY)
            elif fsm.state is S.EXITED and not self.retired:
                allowed, why_not = self.policy.may_restart(spare=self._lost_as_spare)
                if allowed:
                    fsm.begin_start(f"restart #{fsm.restarts + 1}: {fsm.reason}")
                else:
                    if why_not and why_not not in fsm.reason:
                        fsm.annotate(f"{fsm.reason}; {why_not}")
                    await self._sleep_or_wake(None)
            else:  # STOPPED, FATAL: until an operator acts
                await self._sleep_or_wake(None)

    async def _incarnation(self) -> None:
        fsm = self.fsm
        self._stop_reason = None  # a stop that raced the last incarnation's end is spent
        self.probe_history.clear()
        proc = await self._take_process()
        if proc is None:  # the start failed (fsm says why)
            return
        exited = asyncio.ensure_future(proc.wait())
        warm = not proc.adopted or self.adoption.unwarmed
        self.adoption.unwarmed = False
        ready = asyncio.ensure_future(self._wait_ready_and_warm() if warm else self._wait_ready())
        budget = self.cfg.probe.first_wait  # 0: none; an adopted start goes on with what it had left
        if budget and proc.adopted:
            budget = max(0.1, budget - (self.clock() - (fsm.spawned_at or self.clock())))
        try:
            done, _ = await asyncio.wait({exited, ready}, timeout=budget or None, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        not_ready = ready.exception() if ready in done else None
        if ready in done and not_ready is None and not exited.done():
            verdict = await self.verify_content(self, await self.prober.weight_version())
            # The awaits above leave room for an operator's stop or a death: check again.
            if fsm.state is S.STARTING and self._stop_reason is None and not exited.done():
                # A re-adopted engine was serving in this round before the daemon died: it
                # goes on serving if its version checks out. A new one waits for the gap.
                hold = None if proc.adopted and self.adoption.routable else self.policy.hold_reason()
                # A re-adopted spare stays a spare whatever its version (promotion mode keeps
                # spares behind: it is synced if it is ever promoted).
                keep = proc.adopted and self.adoption.standby and self.cfg.spares_sync == "promotion"
                fsm.became_ready(verdict.version, self.policy.current_version, hold=hold, spare=self._spare(),
                                 behind_ok=keep, rule=self.policy.rule)
                await self._supervise(proc, exited, condemn=verdict.condemn)
                return
        if self._stop_reason is not None:  # an operator stopped it while it was starting
            await proc.stop(self.cfg.stop_timeout)
            fsm.stopped(self._stop_reason, Cause.OPERATOR)
            self._stop_reason = self.proc = None
            exited.cancel()
            return
        await self._start_failed(proc, exited, not_ready)
        exited.cancel()
        self.proc = None

    async def _take_process(self) -> ChildProcess | None:
        """This incarnation's process: the one adopted from a previous daemon, or a new one
        spawned (its pid journaled at once). None if the spawn failed (fsm.start_failed)."""
        fsm = self.fsm
        adopted = self.adoption.take()
        if adopted is not None:
            self.proc = adopted
            self.log_path = adopted.log_path
            self.dummy_weights = False  # not known across a daemon restart: its version says what it holds
            log.info("engine.adopted", engine=self.name, pid=adopted.pid, incarnation=fsm.incarnation)
            return adopted
        try:
            await self._wait_port_free()
            self.log_path = Path(self.cfg.log_dir) / f"{self.name}.{fsm.incarnation}.log"
            # restart_load = "dummy": a restart skips reading the checkpoint when the trainer's
            # agent will push every tensor anyway (STALE until that push is verified).
            self.dummy_weights = (fsm.incarnation > 1 and not self._read_weights_next
                                  and self.may_load_dummy())
            self._read_weights_next = False
            cmd = engine_command(self.spec, self.cfg) + (["--load-format", "dummy"] if self.dummy_weights else [])
            env = engine_env(self.spec, self.cfg)
            if (problem := make_engine_caches(self.spec, self.cfg, env)) is not None:
                raise StartFailed(problem, permanent=True)
            proc = self.proc = await ChildProcess.spawn(cmd, env, self.log_path)
        except StartFailed as e:
            fsm.start_failed(e.error, permanent=e.permanent)
            return None
        except OSError as e:
            fsm.start_failed(f"spawn failed: {e}")
            return None
        await self.persist()  # the pid is on disk before this engine goes on
        log.info("engine.spawned", engine=self.name, pid=proc.pid, incarnation=fsm.incarnation,
                 log=str(self.log_path), load="dummy" if self.dummy_weights else "model")
        # A new log is open: this engine's oldest beyond log_keep(_bytes) go, never this one
        # (an OSError is logged there, never raised into supervision).
        await asyncio.to_thread(retention.prune_logs, self.cfg.log_dir, self.name, self.log_path,
                                retention.log_rule(self.cfg))
        return proc

    async def _start_failed(self, proc: ChildProcess, exited: asyncio.Future, not_ready: BaseException | None) -> None:
        """A start that did not become ready: it exited, its readiness check or warm-up failed,
        or first_wait ran out (then stopped, with a post-mortem first)."""
        fsm = self.fsm
        if exited.done():
            permanent, summary = classify_failure(read_tail(proc.log_path), self.spec.model)
            how = describe_returncode(proc.returncode, proc.status_unknown)
            await self._stop_process(proc)  # leftover children of the group
            # Only an exit of its own says something about the config: one killed by a
            # signal (an OOM killer, an operator's kill) may well start next time.
            permanent = permanent and not proc.adopted and (proc.returncode or 0) > 0
            fsm.start_failed(f"{how} while starting: {summary}", permanent=permanent)
        elif not_ready is not None:
            why = (f"warm-up failed: {not_ready}" if isinstance(not_ready, WarmupFailed)
                   else f"readiness check failed: {not_ready!r}")
            fsm.stopping(why, Cause.START_FAILED)
            how = await self._stop_process(proc)
            fsm.start_failed(f"{why}; stopped ({how})")
        else:
            # What the processes were doing says why (a compile, a starved API server, a
            # download): into the reason, and the whole picture into an incident folder.
            doing = await self._activity(proc)
            why = f"not ready within first_wait ({self.cfg.probe.first_wait:g}s); processes: {doing}"
            await self._post_mortem(why)
            fsm.stopping(why, Cause.SLOW_START)
            how = await self._stop_process(proc)
            fsm.start_failed(f"{why}; stopped ({how})", cause=Cause.SLOW_START)

    async def _activity(self, proc: ChildProcess) -> str:
        try:
            return (await asyncio.to_thread(sample_group, proc.pid)).describe()
        except OSError as e:
            return f"unreadable ({e})"

    async def _post_mortem(self, reason: str) -> None:
        """Keep the evidence, but nothing in the capture (a full disk) may keep a hung engine
        running: failures are logged and the stop goes on."""
        try:
            await postmortem.capture(self, reason)
        except Exception as e:
            log.error("postmortem.failed", engine=self.name, error=repr(e))

    async def _stop_process(self, proc: ChildProcess, timeout: float | None = None) -> str:
        """Stop the group; a group that outlives SIGTERM's grace gets a post-mortem first."""
        grace = self.cfg.stop_timeout if timeout is None else timeout

        async def overdue() -> None:
            doing = await self._activity(proc)
            log.warning("engine.stop_overdue", engine=self.name, pid=proc.pid, grace=grace, processes=doing)
            await self._post_mortem(f"still running {grace:g}s after SIGTERM; processes: {doing}")

        return await proc.stop(grace, on_overdue=overdue)

    async def _supervise(self, proc: ChildProcess, exited: asyncio.Future, condemn: str | None = None) -> None:
        """Heartbeat until the process exits, the probes condemn it, or a stop is asked for.
        `condemn`: poisoned as it became ready (its fingerprint did not match): stopped at once."""
        fsm = self.fsm
        self._stop_now.clear()
        if condemn is not None:
            self.condemn_and_stop(condemn, Cause.FINGERPRINT)
        beat = asyncio.ensure_future(self._heartbeat())
        stop_asked = asyncio.ensure_future(self._stop_now.wait())
        try:
            done, _ = await asyncio.wait({exited, beat, stop_asked}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when the daemon shuts down and cancels us
            beat.cancel()
            stop_asked.cancel()
        if beat in done and beat.exception() is not None:  # a bug of ours, not the engine's
            log.error("engine.heartbeat_failed", engine=self.name, error=repr(beat.exception()))
        if exited in done:
            fsm.exited(describe_returncode(proc.returncode, proc.status_unknown))
            # The server is gone: its EngineCore/Worker have nothing left to drain, so a short
            # grace before SIGKILL keeps the restart quick.
            await self._stop_process(proc, min(1.0, self.cfg.stop_timeout))
            if self._stop_reason is not None and fsm.state is S.EXITED:
                # An operator's stop raced the death: it still stands (no automatic restart).
                fsm.stopped(self._stop_reason)
        else:
            if self._stop_reason is None and fsm.state is not S.STOPPING:
                # Condemned (hung, poisoned, failures reported): keep the evidence first.
                await self._post_mortem(fsm.reason)
            if fsm.state is not S.STOPPING:
                if self._stop_reason is not None:
                    fsm.stopping(self._stop_reason, Cause.OPERATOR)
                else:  # condemned: the stop keeps the condemnation's cause
                    fsm.stopping(fsm.reason)
            how = await self._stop_process(proc)
            if self._stop_reason is not None:
                fsm.stopped(self._stop_reason)
            else:
                fsm.exited(how)
        self._stop_reason = None
        self.proc = None

    async def _heartbeat(self) -> None:
        """Probe every `interval`; after a failure, re-probe one `timeout` after the last start.

        So a hang is confirmed back to back: UNHEALTHY at most interval + timeout x threshold
        after it began. Returns when the engine must be stopped.
        """
        await asyncio.sleep(self.phase)
        if not self.cfg.use_fault_tolerance:
            await asyncio.Future()  # deaths are still seen by waiting on the process
        schedule = self.heartbeat.restart()
        while True:
            started = schedule.begin()
            if self.fsm.probed or self.fsm.unobserved:
                outcome = await self._probe_once(started)
                if not outcome.ok and outcome.kind != DAEMON_LIMIT and self.server_gone():
                    # Refused because the server died: its exit is seen (and named) by the wait
                    # on the process in a moment; this is not a hang. (Out of descriptors, /proc
                    # cannot be read either: that says nothing of the server.)
                    await asyncio.Future()
                if self.fsm.unobserved and outcome.ok and outcome.excuse is None:
                    # Out of routing only because the daemon could not probe it: back, as an
                    # attached engine that answers again (held until the gap inside a round).
                    # The process never stopped, so its weights are the ones it had: a read
                    # that fails must not cost it a resync. One that answers is believed, base
                    # weights included (then it is STALE, not routable at the remembered version).
                    read = await self.prober.read_weight_version()
                    version = read.or_remembered(self.fsm.weight_version)
                    if not read.readable:
                        log.info("engine.weight_version_kept", engine=self.name, version=version,
                                 why=f"{read.detail}; the process never stopped, so it holds what it had")
                    verdict = await self.verify_content(self, version)
                    if self.fsm.unobserved:  # nothing else moved it meanwhile
                        self._recovered(verdict)
                elif self.fsm.probe_result(outcome):
                    return
            await schedule.wait_next(started, failing=bool(self.fsm.consecutive_failures))

    @property
    def late_probes(self) -> int:
        """Heartbeats that started more than one interval behind their schedule."""
        return self.heartbeat.late

    async def _probe_once(self, started: float) -> ProbeOutcome:
        outcome = await self.prober.check()
        self.probes += 1
        self.probe_failures += not outcome.ok and outcome.kind != DAEMON_LIMIT
        self.probe_history.append((started, outcome))
        self.bus.probed(self.name, outcome)
        return outcome

    async def _wait_port_free(self) -> None:
        """A previous incarnation (or anything else) may hold the port for a moment: retry."""
        port = self.spec.port
        assert port is not None  # a spawned engine's, which the config requires
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_result(lambda free: not free),
                stop=stop_after_delay(self.cfg.stop_timeout + 5),
                wait=wait_exponential_jitter(initial=0.1, max=1.0),
            ):
                with attempt:
                    free = port_is_free(self.spec.host, port)
                if attempt.retry_state.outcome is not None and not attempt.retry_state.outcome.failed:
                    attempt.retry_state.set_result(free)
        except RetryError:
            raise StartFailed(f"port {self.spec.port} still in use by another process", permanent=False) from None

    async def _wait_ready_and_warm(self) -> None:
        """Ready, then the warm-up (WarmupFailed if it fails), all inside the caller's bound."""
        await self._wait_ready()
        policy = self.cfg.warmup
        if policy.requests > 0:
            self.fsm.annotate(f"warming up: {policy.requests} requests down the rollout's sampling path")
            log.info("engine.warmup", engine=self.name, requests=policy.requests)
            done = await warm_up(self.spec.base_url, self.spec.model_name, policy, self.prober.auth)
            log.info("engine.warmed_up", engine=self.name, summary=done)

    async def _wait_ready(self) -> None:
        """Ready = /health 200 and one deep probe answered. Connection refused while vLLM
        boots is transient: retried with jittered backoff until first_wait (the caller's bound).
        """
        async for attempt in AsyncRetrying(
            retry=retry_if_result(lambda ok: not ok),
            wait=wait_exponential_jitter(initial=0.25, max=2.0),
        ):
            with attempt:
                outcome = await self.prober.health(timeout=self.cfg.probe.timeout)
                if outcome.ok:
                    outcome = await self.prober.generate()
            if attempt.retry_state.outcome is not None and not attempt.retry_state.outcome.failed:
                # Ready means an answer (or tokens counted): an excused late probe (paused,
                # busy) proves no engine loop.
                attempt.retry_state.set_result(outcome.ok and outcome.excuse is None)

    # -- verbs: the fleet's, the sync coordinator's and the control socket's --------------

    def _stop_incarnation(self) -> None:
        """The supervising task stops the current incarnation now (post-mortem first). An
        attached engine has no incarnation of ours: it stays UNHEALTHY, probed, never routed."""
        self._stop_now.set()

    def restart_reading_the_model(self, reason: str) -> None:
        """A dummy-weight incarnation nobody will push weights into: stopped, and the next
        start reads the model from disk (a normal restart)."""
        self._read_weights_next = True
        self.condemn_and_stop(reason, Cause.SYNC_FAILED)

    def condemn_and_stop(self, reason: str, cause: Cause) -> None:
        """Unusable now (poisoned: a failed sync, or the trainer says so): UNHEALTHY at once,
        never routed, and stopped (a spawned engine is then restarted)."""
        self.fsm.mark_unusable(reason, cause)
        self._stop_incarnation()

    def server_gone(self) -> bool:
        """The engine's server process has exited (a zombie or gone), whether or not the
        event loop has handled its SIGCHLD yet: a failure seen now is its death, not a hang."""
        proc = self.proc
        return proc is not None and (proc.returncode is not None or process_start_time(proc.pid) is None)

    def report_failure(self, detail: str, *, poisoned: bool = False) -> None:
        """A failure the trainer saw while the engine served. It counts like a failed probe
        (stopped at the threshold); a poisoned engine is condemned at once."""
        if poisoned:
            self.condemn_and_stop(f"poisoned: {detail} (reported by the trainer)", Cause.POISONED)
        elif self.fsm.report_failure(detail):
            self._stop_incarnation()

    def mark_outdated(self, current_version: int) -> None:
        """A newer version was published: STALE (out of routing) until synced."""
        self.fsm.version_behind(current_version)

    def fingerprint_mismatch(self, version: int, reason: str) -> None:
        """/weight_info says `version` but the outputs do not match its fingerprint: STALE, its
        version an unpublished label, so that it is synced again (fingerprint_mismatch = "resync")."""
        self.fsm.fingerprint_mismatch(unverified(version), reason)

    def _recovered(self, verdict: Verdict) -> None:
        """Answering again (attached, or probed again after unobserved): back at what
        verify_content found it holds; poisoned at once if its fingerprint did not match."""
        self.fsm.recovered(verdict.version, self.policy.current_version, hold=self.policy.hold_reason(),
                           spare=self._spare(), rule=self.policy.rule)
        if verdict.condemn is not None:
            self.condemn_and_stop(verdict.condemn, Cause.FINGERPRINT)

    def push_announced(self, push: str, deadline_s: float) -> None:
        """It receives an announced push (POST /v1/pushes): paused, excused until its deadline."""
        self.fsm.push_announced(PushWindow(push, self.clock() + deadline_s, deadline_s))

    def push_ended(self, push: str) -> None:
        self.fsm.push_ended(push)

    def relabelled(self, verdict: Verdict, reason: str) -> None:
        """Read again after a push (checked as verify_content checks a ready engine): it holds
        verdict.version; out of routing if the rule does not allow it, poisoned if its
        fingerprint did not match."""
        self.fsm.relabelled(verdict.version, self.policy.current_version, reason, rule=self.policy.rule)
        if verdict.condemn is not None:
            self.condemn_and_stop(verdict.condemn, Cause.FINGERPRINT)

    def begin_sync(self, reason: str) -> None:
        self.fsm.sync_started(reason)

    async def reload_weights(self, checkpoint: str, version: int, timeout: float) -> None:
        """Load `checkpoint` into the engine through vLLM's reload route (the disk fallback of a
        sync). Raises on any failure; the caller holds the overall bound."""
        from vime.weight_sync.checkpoint import reload_from_checkpoint_async

        await reload_from_checkpoint_async(self.prober.session, self.spec.base_url, checkpoint, version,
                                           reload_timeout=timeout)

    async def verify_weights(self, version: int, incarnation: int) -> tuple[bool, str | None]:
        """After a sync: does the engine report `version` (/weight_info) and answer the deep
        probe? (False, None) if this sync is no longer current (the engine died or was stopped,
        or another incarnation runs); else (True, None) or (True, what failed). A read that
        answers another version fails it at once. One that got no answer (a loaded host, a
        503) says nothing of the weights: it is tried again as the heartbeat re-probes, one
        timeout after the last try began, failure_threshold in a row before the sync fails
        (at most failure_threshold x timeout of reads)."""

        def still_this_sync() -> bool:
            return self.fsm.state is S.SYNCING and self.fsm.incarnation == incarnation

        tries, timeout = max(1, self.cfg.probe.failure_threshold), self.cfg.probe.timeout
        for attempt in range(tries):
            began = time.monotonic()
            read = await self.prober.read_weight_version()
            if not still_this_sync():
                return False, None
            if read.readable:
                break
            if attempt + 1 < tries:
                await asyncio.sleep(max(0.0, began + timeout - time.monotonic()))
                if not still_this_sync():
                    return False, None
        else:
            return True, f"no answer could be read: {read.detail}"
        if read.version != version:
            return True, f"/weight_info says {vlabel(read.version)}, not {vlabel(version)}"
        probe = await self.prober.generate()
        if not still_this_sync():
            return False, None
        if not probe.ok:
            return True, f"the deep probe failed: {probe.detail}"
        return True, None

    def finish_sync(self, version: int, hold: str | None = None) -> None:
        self.dummy_weights = False  # every tensor pushed and verified: real weights from here on
        self.fsm.sync_finished(version, hold=hold, spare=self._spare())

    def sync_overtaken(self, label: int | str, current_version: int | None, how: str) -> None:
        """Verified at `label` by a sync, which a publish meanwhile left outside the rule: STALE."""
        self.fsm.sync_overtaken(label, current_version, how)

    def release(self, why: str, current_version: int | None) -> None:
        """A held STALE engine joins routing (in a round gap) if it holds `current_version`,
        or becomes a spare if the fleet does not need it."""
        self.fsm.release(why, current_version, spare=self._spare(), rule=self.policy.rule)

    def park(self, why: str) -> None:
        """STANDBY now, weights as they are (synced when promoted)."""
        self.fsm.park(why)

    def promote(self, why: str, current_version: int | None) -> None:
        self.fsm.promote(why, current_version, rule=self.policy.rule)

    def _spare(self) -> str | None:
        """Why this engine, ready now, would be a spare: None if the fleet needs it (or has
        no spares configured). After a reload or a daemon restart a re-adopted engine keeps
        its role: a spare stays one, a serving one serves."""
        if self.proc is not None and self.proc.adopted and self.fsm.state is S.STARTING:
            if self.adoption.standby:
                return f"a spare before {self.adoption.after}"
            if self.adoption.routable:
                return None
        return self.policy.spare_reason()

    def note(self, reason: str) -> None:
        """Say why it waits, without a state change."""
        self.fsm.annotate(reason)

    def restore(self, *, incarnation: int, restarts: int, retired: bool, operator_stopped: bool,
                routable: bool = False, fatal: str | None = None) -> None:
        """What a previous daemon's journal says of this engine (before start()). `fatal`: it
        was FATAL (why) before a reload, under the same config: it stays so, for an operator."""
        self.retired = retired
        self._restored = True
        self._fatal = fatal
        if not self.spec.spawned:
            # An attached engine outlives the daemon as an adopted process does: it goes on
            # serving the round it was serving (its version is checked when it answers).
            self.adoption.routable = routable
            self._recheck_pending = not retired
        # Incarnations go on counting across daemon restarts: a failure report or a log file
        # names one process, never two.
        self.fsm.incarnation = incarnation
        self.fsm.restarts = restarts
        # Only an operator's stop survives a restart; the daemon's own shutdown does not.
        self.start_stopped = operator_stopped

    def request_start(self, reason: str) -> str:
        fsm = self.fsm
        if fsm.state in (S.STOPPED, S.EXITED, S.BACKOFF, S.FATAL):
            if self.proc is not None:  # a dead incarnation's group is still being cleaned up
                self._start_pending = reason  # the task starts it once the clean-up ends
                self.wake()
                return f"starting once the last incarnation is cleaned up ({fsm.state.value})"
            self.start_stopped = False
            fsm.reset_budget()
            fsm.begin_start(reason, cause=Cause.OPERATOR)
            self.wake()
            return f"starting (incarnation {fsm.incarnation})"
        return f"already {fsm.state.value}"

    async def stop(self, reason: str = "stopped by request") -> str:
        """Stop and keep stopped (STOPPED), whatever the state. Returns what was done."""
        fsm = self.fsm
        if fsm.state is S.STOPPED:
            return "already STOPPED"
        self._start_pending = None  # a stop cancels a start still waiting for a clean-up
        # Wait until there is one thing to stop: a start still waiting for its port (no process
        # yet), or a dead incarnation's group being cleaned up (bounded by that stop's own
        # SIGKILL), after which the task may begin an automatic restart: one loop, so whichever
        # comes last is the state this stop acts on.
        deadline = self.clock() + self.cfg.stop_timeout + 5

        def no_process_yet() -> bool:
            return fsm.state is S.STARTING and self.proc is None

        def cleaning_up() -> bool:
            return self.proc is not None and fsm.state in (S.EXITED, S.BACKOFF, S.FATAL)

        while True:
            if no_process_yet():
                await self._until(lambda: not no_process_yet())
            elif cleaning_up() and self.clock() < deadline:
                await self._until(lambda: not cleaning_up(), deadline - self.clock())
            else:
                break
        if fsm.state is S.STOPPED:  # the clean-up carried out a stop that raced the death
            return "stopped"
        if self.proc is None or fsm.state in (S.EXITED, S.BACKOFF, S.FATAL):
            fsm.stopped(reason)
            self.wake()
            return "stopped (no process was running)"
        self._stop_reason = reason
        incarnation = fsm.incarnation
        if fsm.state is S.STARTING:
            # The starting task owns the process: kill it, and the start ends in STOPPED.
            fsm.stopping(reason, Cause.OPERATOR)
            await self.proc.stop(self.cfg.stop_timeout)
        else:
            self._stop_now.set()
        # The incarnation's task carries the stop out; it ends in STOPPED (or EXITED if the
        # process died on its own meanwhile, which we then mark stopped too). A start asked for
        # meanwhile begins a new incarnation: this stop was carried out, and is answered.
        await self._until(lambda: not (fsm.state in PROCESS_STATES and fsm.incarnation == incarnation
                                       and not (self._task and self._task.done())))
        if fsm.incarnation != incarnation:
            return f"stopped; started again since by a later request (incarnation {fsm.incarnation})"
        if fsm.state is not S.STOPPED and fsm.state not in PROCESS_STATES:
            fsm.stopped(reason)
        self._stop_reason = None
        return "stopped" if fsm.state is S.STOPPED else f"not stopped: {fsm.state.value}"

    async def read_version(self) -> VersionRead | None:
        """Read the engine's weight version (vLLM /weight_info) again if it is up (a publish),
        for take_version to apply; None when there is nothing to read or the answer could not
        be read (it says nothing: the label stands, as at a push's end)."""
        fsm = self.fsm
        if not (fsm.probed or fsm.state is S.SYNCING):
            return None
        incarnation, state, held = fsm.incarnation, fsm.state, fsm.weight_version
        read = await self.prober.read_weight_version()
        return VersionRead(incarnation, state, held, read.version) if read.readable else None

    def take_version(self, read: VersionRead | None, *, checked: int | None = None,
                     fingerprinted: int | None = None) -> None:
        """Apply a read_version. `checked`: the incarnation the published version's fingerprint
        (`fingerprinted`, when it has one) was run on at this publish and that is taken to hold
        it (it matched, or fingerprint_mismatch = "warn"). What is read is taken as
        fingerprint.relabel says (an unverified engine stays unverified), and only by the
        incarnation, in the state and label, it was read for: a read that raced a death, a sync's
        end, a promotion or a push's end says nothing of what came after it."""
        fsm = self.fsm
        if (read is None or fsm.incarnation != read.incarnation or fsm.state is not read.state
                or fsm.weight_version != read.held):
            return
        fsm.weight_version = relabel(fsm.weight_version, read.version, checked=checked == read.incarnation,
                                     fingerprinted=fingerprinted, rule=self.policy.rule)

    def round_ended(self, n: int) -> None:
        """The gap: a dead engine may restart now (held STALE ones are the sync's to release)."""
        self.wake()

    async def detach(self) -> None:
        """A reload: end the task, and leave the process running for the next daemon image
        to adopt from the journal (its pid stays in the snapshot: self.proc is kept)."""
        await cancel_and_wait(self._task)
        self.prober.close()

    async def shutdown(self) -> None:
        """Daemon exit: end the task, stop the process group if one is left."""
        # The journal must tell this stop from an operator's: only the latter survives a
        # restart (journal.snapshot reads this).
        self.stopped_by_shutdown = self.fsm.state is not S.STOPPED
        await cancel_and_wait(self._task)
        self.prober.close()  # an attached engine's probe connection (spawned: closed already)
        adopted = self.adoption.take()
        if adopted is not None:  # a stop that came before the task took it over
            self.proc = adopted
        fsm = self.fsm
        if self.proc is not None:
            if fsm.state in PROCESS_STATES and fsm.state is not S.STOPPING:
                fsm.stopping("supervisor shutting down", Cause.SHUTDOWN)
            how = await self.proc.stop(self.cfg.stop_timeout)
            if fsm.state is S.STOPPING:
                fsm.stopped(f"supervisor shut down; stopped ({how})", Cause.SHUTDOWN)
            self.proc = None
        elif fsm.state is S.STARTING:  # cancelled before its process was there (a port wait, the spawn)
            fsm.stopping("supervisor shutting down", Cause.SHUTDOWN)
            fsm.stopped("supervisor shut down before its process started", Cause.SHUTDOWN)

    # -- attached engines ------------------------------------------------------------------

    async def _run_attached(self) -> None:
        """Probe an engine we did not start. We cannot stop or restart it; we keep it out of
        routing while it fails, and take it back once it answers success_threshold probes."""
        fsm, probe = self.fsm, self.cfg.probe
        if self._restored:
            # The same engine as before the daemon restart: the same incarnation, so failure
            # reports that name it still count.
            fsm.incarnation = max(0, fsm.incarnation - 1)
            fsm.begin_start(f"re-attaching to {self.spec.base_url} after a daemon restart", restart=False,
                            cause=Cause.RESTORED)
        else:
            fsm.begin_start(f"attach to {self.spec.base_url}", restart=False)
        self.first_start_begun = True
        self._poke()
        # Spread over one interval as the heartbeats are: thousands of attached engines' first
        # checks sent in the same instant time out in waves on the daemon's own loop. Engines
        # re-attached after a daemon restart are spread over one second instead: the socket
        # waits for their checks (daemon.py's RELOAD_SETTLE).
        await asyncio.sleep(self.phase / probe.interval if self._recheck_pending and probe.interval else self.phase)
        try:
            await within(self._wait_ready(), probe.first_wait or None)  # 0: no deadline
            hold = None if self.adoption.routable else self.policy.hold_reason()
            verdict = await self.verify_content(self, await self.prober.weight_version())
            fsm.became_ready(verdict.version, self.policy.current_version, hold=hold, spare=self._spare(),
                             rule=self.policy.rule)
            if verdict.condemn is not None:
                self.condemn_and_stop(verdict.condemn, Cause.FINGERPRINT)
        except asyncio.TimeoutError:
            fsm.exited(f"not answering within first_wait ({probe.first_wait:g}s)", Cause.SLOW_START)
        finally:
            if self._recheck_pending:
                self._recheck_pending = False
                self._poke()  # a wait on the re-adoptions (daemon.py) looks again
        await asyncio.sleep(self.phase)
        ok_streak = 0
        schedule = self.heartbeat.restart()
        while True:
            started = schedule.begin()
            if fsm.state in (S.UNHEALTHY, S.EXITED):
                outcome = await self._probe_once(started)
                ok_streak = ok_streak + 1 if outcome.ok and outcome.excuse is None else 0
                if ok_streak >= probe.success_threshold:
                    # Membership grows only in a round gap: held STALE until the round ends.
                    verdict = await self.verify_content(self, await self.prober.weight_version())
                    if fsm.state in (S.UNHEALTHY, S.EXITED):  # an operator's stop meanwhile wins
                        self._recovered(verdict)
                    ok_streak = 0
            elif fsm.probed and self.cfg.use_fault_tolerance:
                fsm.probe_result(await self._probe_once(started))
            await schedule.wait_next(started, failing=bool(fsm.consecutive_failures))


def api_key(args: tuple[str, ...], env: dict[str, str]) -> str | None:
    """The key vLLM guards /v1 with (--api-key or VLLM_API_KEY), which the probe must send."""
    for i, a in enumerate(args):
        if a == "--api-key" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--api-key="):
            return a.split("=", 1)[1]
    return env.get("VLLM_API_KEY") or None
