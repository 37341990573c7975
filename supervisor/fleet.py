"""The fleet: every engine's runner, rounds, the current weight version, routing membership.

Decisions that span engines live here: whether a dead engine may restart now (only in a
round gap, unless restart_immediately), which engines are routable (RUNNING or SUSPECT at the
current version), the membership epoch, and the min_healthy floor.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, Callable

import structlog

from .config import Config
from .errors import BadRequest, Conflict
from .fsm import ProbeOutcome, Transition
from .states import Cause, State

S = State
log = structlog.get_logger("vime.fleet")


class Subscription:
    """One reader of the event stream. `lost` is set if it fell too far behind."""

    def __init__(self, maxsize: int):
        self.queue: asyncio.Queue = asyncio.Queue(maxsize)
        self.lost = False


class Fleet:
    def __init__(self, cfg: Config, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock
        self.runners: dict[str, Any] = {}  # name -> EngineRunner (engine.py imports us)
        self.current_version: int | None = None
        self.checkpoint: str | None = None
        self.round: int | None = None  # last round started
        self.round_open = False
        self.epoch = 0
        self._routable: frozenset[str] = frozenset()
        self._floor_armed = False  # the floor counts once the fleet first reached it
        self._below_floor = False
        self.floor_breaches = 0
        self.detections: dict[tuple[str, str], int] = {}  # (engine, kind: see detection_kind) -> count
        from .metrics import PROBE_BUCKETS, RECOVERY_BUCKETS, SYNC_BUCKETS, Histogram

        self.probe_latency = Histogram(PROBE_BUCKETS)
        self.recovery_time = Histogram(RECOVERY_BUCKETS)
        self.sync_time = Histogram(SYNC_BUCKETS)
        self.syncs: dict[str, int] = {}  # "verified" | "failed" -> count
        self._detected_at: dict[str, float] = {}  # engine -> when its last failure was seen
        self._sync_began: dict[str, float] = {}
        self._subscribers: set[Subscription] = set()
        self.started_at = time.time()
        self.pid = os.getpid()
        # Called after a change the trainer was told about (round, version, a new pid): the
        # daemon's journal is written before the answer, so a kill -9 right after loses nothing.
        self.persist: Callable[[], None] = lambda: None
        from .sync import SyncCoordinator  # it needs the fleet; the fleet owns it

        self.sync = SyncCoordinator(self, cfg.sync_timeout)

    @property
    def below_floor(self) -> bool:
        return self._below_floor

    # -- events ----------------------------------------------------------------------------

    def subscribe(self, maxsize: int = 10000) -> "Subscription":
        sub = Subscription(maxsize)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: "Subscription") -> None:
        self._subscribers.discard(sub)

    def emit(self, name: str, /, **fields: Any) -> None:
        event = {"event": name, "ts": time.time(), **fields}
        for sub in list(self._subscribers):
            try:
                sub.queue.put_nowait(event)
            except asyncio.QueueFull:  # a stalled reader loses its stream, not our memory
                sub.lost = True
                self._subscribers.discard(sub)

    def on_transition(self, t: Transition) -> None:
        kind = detection_kind(t)
        if kind:
            self.detections[(t.engine, kind)] = self.detections.get((t.engine, kind), 0) + 1
            self._detected_at.setdefault(t.engine, t.at)
            self.emit("detection", engine=t.engine, kind=kind, reason=t.reason)
        if t.to_state in (S.STOPPED, S.FATAL):
            self._detected_at.pop(t.engine, None)  # no recovery to time: it was stopped or gave up
        if t.to_state is S.SYNCING:
            self._sync_began[t.engine] = t.at
        elif t.from_state is S.SYNCING:
            outcome = "failed" if t.to_state in (S.UNHEALTHY, S.STOPPING, S.EXITED) else "verified"
            self.syncs[outcome] = self.syncs.get(outcome, 0) + 1
            if outcome == "verified" and t.engine in self._sync_began:
                self.sync_time.observe(t.at - self._sync_began.pop(t.engine))
        level = log.warning if t.to_state in (S.UNHEALTHY, S.FATAL, S.EXITED) else log.info
        level("engine.transition", engine=t.engine, from_state=t.from_state.value,
              to_state=t.to_state.value, reason=t.reason, cause=t.cause.value, incarnation=t.incarnation)
        self.emit("transition", engine=t.engine, from_state=t.from_state.value,
                  to_state=t.to_state.value, reason=t.reason, cause=t.cause.value, incarnation=t.incarnation)
        self._membership_changed()
        if t.to_state is S.STALE and t.engine in self.runners:
            # After the transition has settled: consider() may annotate or start a reload.
            asyncio.get_running_loop().call_soon(self.sync.consider, self.runners[t.engine])

    def on_probe(self, runner: Any, outcome: ProbeOutcome) -> None:
        if outcome.ok and outcome.latency is not None:
            self.probe_latency.observe(outcome.latency)
        if not outcome.ok:
            log.info("engine.probe_failed", engine=runner.name, detail=outcome.detail)
        elif outcome.excuse is not None:  # late, and judged busy or paused: not a failure
            log.info("engine.probe_excused", engine=runner.name, excuse=outcome.excuse, detail=outcome.detail)

    # -- routing ---------------------------------------------------------------------------

    def is_routable(self, runner: Any) -> bool:
        fsm = runner.fsm
        return (fsm.routable and not runner.retired
                and (self.current_version is None or fsm.weight_version == self.current_version))

    def routable(self) -> list[Any]:
        return [r for r in self.runners.values() if self.is_routable(r)]

    def _membership_changed(self) -> None:
        now = frozenset(r.name for r in self.routable())
        for name in now - self._routable:
            if name in self._detected_at:  # back in routing after a failure: time to recover
                self.recovery_time.observe(self.clock() - self._detected_at.pop(name))
        if now != self._routable:
            self._routable = now
            self.epoch += 1
            self.emit("membership", epoch=self.epoch, routable=sorted(now))
        self._check_floor(len(now))

    def _check_floor(self, n: int) -> None:
        floor = self.cfg.min_healthy
        if n >= floor:
            self._floor_armed = True
            if self._below_floor:
                self._below_floor = False
                log.info("fleet.floor_restored", routable=n, min_healthy=floor)
                self.emit("floor_restored", routable=n, min_healthy=floor)
        elif self._floor_armed and not self._below_floor:
            self._below_floor = True
            self.floor_breaches += 1
            log.error("fleet.below_min_healthy", routable=n, min_healthy=floor,
                      engines={r.name: r.fsm.state.value for r in self.runners.values()})
            self.emit("floor_breach", routable=n, min_healthy=floor)

    # -- restarts --------------------------------------------------------------------------

    def may_restart(self, runner: Any) -> tuple[bool, str | None]:
        """A dead engine restarts in a round gap; during round N it waits for its end."""
        if not self.cfg.use_fault_tolerance:
            return False, "fault tolerance off: not restarted"
        if self.round_open and not self.cfg.restart_immediately:
            return False, f"restart after round {self.round}"
        return True, None

    def wake_all(self) -> None:
        for r in self.runners.values():
            r.wake()

    # -- rounds ----------------------------------------------------------------------------

    def hold_reason(self) -> str | None:
        """An engine that becomes ready during a round waits for the gap to join routing."""
        if self.round_open:
            return f"held out of routing until round {self.round} ends"
        return None

    def start_round(self, n: int) -> tuple[bool, str]:
        if self.round_open:
            if n == self.round:
                return False, f"round {n} is already open"
            raise Conflict(f"round {self.round} is still open: end it (POST /v1/rounds/{self.round}/end) "
                           f"before starting round {n}")
        if self.round is not None and n <= self.round:
            raise Conflict(f"round {n} is stale: round {self.round} already ran; start a round greater than {self.round}")
        self.round, self.round_open = n, True
        self.sync.round_started()
        self.persist()
        log.info("round.start", round=n, routable=len(self._routable))
        self.emit("round_start", round=n, epoch=self.epoch)
        return True, f"round {n} open"

    def end_round(self, n: int) -> tuple[bool, str]:
        if not self.round_open:
            if n == self.round:
                return False, f"round {n} already ended"
            expected = "no round has started" if self.round is None else f"the last round was {self.round}"
            raise Conflict(f"round {n} is not open ({expected}); start it first")
        if n != self.round:
            raise Conflict(f"round {self.round} is open, not round {n}: end round {self.round}")
        self.round_open = False
        self.persist()
        log.info("round.end", round=n)
        self.emit("round_end", round=n, epoch=self.epoch)
        for r in self.runners.values():
            r.round_ended(n)
        self.sync.kick()
        return True, f"round {n} ended; restarts and syncs may run until the next round starts"

    # -- weights ---------------------------------------------------------------------------

    async def publish_weights(self, version: int, checkpoint: str | None) -> tuple[bool, str]:
        """Record version V as current. Engines that do not report V (vLLM /weight_info) go STALE."""
        check_version("version", version)
        if checkpoint is not None:
            models = [r.spec.model for r in self.runners.values() if r.spec.spawned]
            checkpoint = await validate_checkpoint_off_loop(checkpoint, models[0] if models else None)
        cur = self.current_version
        if cur is not None and version < cur:
            raise Conflict(f"weight version {version} is stale: the current version is {cur}; versions must increase")
        if version == cur:
            if checkpoint is None or checkpoint == self.checkpoint:
                return False, f"version {version} is already current"
            raise Conflict(f"version {version} was already published with checkpoint {self.checkpoint}; "
                           "publish a new version for a new checkpoint")
        self.current_version, self.checkpoint = version, checkpoint
        runners = list(self.runners.values())
        await asyncio.gather(*(r.refresh_version() for r in runners))
        behind = [r.name for r in runners if r.fsm.routable and r.fsm.weight_version != version]
        for r in runners:
            if r.name in behind:
                r.fsm.version_behind(version)
        self._membership_changed()
        self.persist()
        log.info("weights.published", version=version, checkpoint=checkpoint, stale=behind)
        self.emit("weights_published", version=version, checkpoint=checkpoint, stale=behind, epoch=self.epoch)
        self.sync.kick()
        msg = f"version {version} is current"
        return True, msg + (f"; stale (not routable until synced): {', '.join(behind)}" if behind else "")

    # -- engines ---------------------------------------------------------------------------

    def report_failure(self, runner: Any, detail: str, poisoned: bool = False,
                       incarnation: int | None = None) -> dict[str, Any]:
        """A failure the trainer saw. `poisoned`: a weight push into this engine failed between
        start and finish, so it holds half-loaded weights behind a 200 /health; no threshold
        applies, it is stopped (post-mortem first) and restarted now. `incarnation`, when the
        trainer says which one it saw fail: a late report about an earlier one is ignored."""
        fsm = runner.fsm
        if incarnation is not None and incarnation != fsm.incarnation:
            self.emit("failure_reported", engine=runner.name, detail=detail, counted=False, poisoned=poisoned,
                      incarnation=incarnation)
            return {"counted": False, "state": fsm.state.value, "incarnation": fsm.incarnation,
                    "message": f"report about incarnation {incarnation} ignored: {runner.name} is now at "
                               f"incarnation {fsm.incarnation}"}
        if not fsm.probed:  # e.g. the daemon saw the death first: on the stream, not counted
            self.emit("failure_reported", engine=runner.name, detail=detail, counted=False, poisoned=poisoned)
            return {"counted": False, "state": fsm.state.value,
                    "message": f"{runner.name} is {fsm.state.value}; failures count only while it serves"}
        self.emit("failure_reported", engine=runner.name, detail=detail, counted=True, poisoned=poisoned)
        if poisoned:
            log.warning("engine.poisoned_reported", engine=runner.name, detail=detail)
            fsm.mark_unusable(f"poisoned: {detail} (reported by the trainer)", Cause.POISONED)
            runner.condemn()
        elif fsm.report_failure(detail):
            runner.condemn()
        return {"counted": True, "state": fsm.state.value, "consecutive_failures": fsm.consecutive_failures,
                "failure_threshold": self.cfg.probe.failure_threshold}

    async def engine_action(self, runner: Any, action: str) -> str:
        if not runner.spec.spawned and action != "retire":
            raise Conflict(f"{runner.name} is attached ({runner.spec.base_url}): the daemon did not start it "
                           f"and cannot {action} it; only retire it")
        if runner.retired and action != "retire":
            raise Conflict(f"{runner.name} is retired, and stays retired across daemon restarts (the journal "
                           f"keeps it); to use it again, stop the daemon and delete {self.cfg.state_dir}/journal.json")
        if action == "stop":
            return await runner.stop("stopped by request")
        if action == "start":
            return runner.request_start("started by request")
        if action == "restart":
            await runner.stop("stopped by request (restart)")
            return runner.request_start("restarted by request")
        runner.retired = True
        msg = await runner.stop("retired by request") if runner.spec.spawned else "retired"
        self._membership_changed()
        self.emit("retired", engine=runner.name)
        return msg


def detection_kind(t: Transition) -> str | None:
    """How an engine was found unusable, for vime_detections_total{kind}, from the transition's
    cause: "exit" (it died), "poisoned" (a weight sync failed midway, or the trainer said so),
    "reported" (the trainer's failure reports crossed the threshold), "hang" (probes: failed,
    or excused as busy or paused for too long). None: not a detection."""
    if t.to_state is S.EXITED:
        return "exit" if t.from_state is not S.STOPPING else None
    if t.to_state is not S.UNHEALTHY:
        return None
    if t.cause in (Cause.POISONED, Cause.SYNC_FAILED):
        return "poisoned"
    if t.cause is Cause.REPORTED:
        return "reported"
    return "hang"


# Versions and incarnations are kept as int64 by every consumer (Prometheus floats, vLLM's
# weight_version string, the journal): a 401-digit version made /v1/metrics answer 500.
MAX_VERSION = 2 ** 63 - 1


def check_version(name: str, value: int) -> int:
    if not 0 <= value <= MAX_VERSION:
        shown = str(value) if len(str(value)) <= 30 else f"a {len(str(abs(value)))}-digit number"
        raise BadRequest(f"{name} must be >= 0 and < 2**63 (an int64), got {shown}")
    return value


# Reading a checkpoint the trainer names must never hold the event loop: the files are read in
# a thread of their own (a daemon thread: a read stuck on a dead NFS mount must not hang the
# daemon's exit either), within this bound.
CHECKPOINT_READ_TIMEOUT = 60.0


async def validate_checkpoint_off_loop(path: str, reference_model: str | None = None) -> str:
    from vime.weight_sync._http import run_in_thread

    fut = run_in_thread(validate_checkpoint, path, reference_model, name="validate-checkpoint")
    try:
        return await asyncio.wait_for(asyncio.wrap_future(fut), CHECKPOINT_READ_TIMEOUT)
    except asyncio.TimeoutError:
        raise BadRequest(f"checkpoint {path[:300]} could not be read within {CHECKPOINT_READ_TIMEOUT:g}s; "
                         "check the file system it is on") from None


def validate_checkpoint(path: str, reference_model: str | None = None) -> str:
    """Refuse a checkpoint vLLM could not load, before anything uses it: vLLM's reload of a bad
    path fails halfway and leaves the engine poisoned. `reference_model` (an engine's model
    directory) must have the same architecture and shapes."""
    from vime.weight_sync.checkpoint import validate_checkpoint as check
    from vime.weight_sync.errors import CheckpointError

    p = Path(path)
    if not p.is_absolute():
        raise BadRequest(f"checkpoint must be an absolute path, got {path[:300]!r}")
    if "\0" in path:
        raise BadRequest("checkpoint path contains a NUL byte")
    try:
        check(p, expect_config=reference_model)
    except CheckpointError as e:
        raise BadRequest(f"{e}; publish a directory saved with vime.weight_sync.checkpoint.save_checkpoint") from None
    except (OSError, ValueError) as e:  # what the validator does not name itself: still the path's fault
        raise BadRequest(f"checkpoint {path[:300]} cannot be read: {e}") from None
    return str(p)
