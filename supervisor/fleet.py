"""The fleet: every engine's runner, and the fleet-wide verbs the control socket calls.

The decisions that span engines are policy.py's (pure): rounds, the current weight version,
whether a dead engine may restart now, who is routable, the membership epoch, the min_healthy
floor. `Fleet` carries them out: it logs, emits events on the bus (events.py) and calls the
runners' verbs (engine/runner.py); it never drives an engine's state machine itself. The daemon's
start-up (daemon.py) builds the policy, the bus, the statistics (metrics.py) and the sync
coordinator (sync.py), and wires them as listeners of the bus.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import aiohttp
import structlog

from .config import Config
from .engine import fingerprint as fingerprints
from .engine.fingerprint import Fingerprint, Verdict
from .engine.fsm import vlabel
from .engine.runner import EngineRunner, VersionRead
from .errors import BadRequest, Conflict
from .tasks import within
from .events import EventBus, Listener, Subscription
from .logs import exit_fields
from .metrics import FleetStats
from .policy import FleetPolicy
from .protocol import Event
from .states import ACTIVE, DAEMON_LIMIT, Cause, ProbeOutcome, State, Transition, detection_kind

__all__ = ["Fleet", "RouterGate", "BadRequest", "Conflict", "check_version", "validate_checkpoint",
           "validate_checkpoint_off_loop", "MAX_VERSION"]

log = structlog.get_logger("vime.fleet")

# A fingerprint is one small completion request (4 prompts of 48 tokens: 0.03 s on the tiny
# model here, 2.6 s for an engine's first, while vLLM compiles its logprobs path); bounded at
# least this long so that a loaded host does not fail a healthy engine.
FINGERPRINT_TIMEOUT = 30.0


class RouterGate(Protocol):
    """What the fleet asks of the router in front of the engines (router.link.RouterLink is
    the one the daemon hands in), as a runner asks the policy through RestartGate."""

    @property
    def remove_timeout(self) -> float: ...

    def drains(self) -> bool:
        """A planned stop takes an engine out of the router first (a feed runs, not observe-only)."""
        ...

    async def settle(self) -> list[str]:
        """The engines whose removal from the router is still unconfirmed, once the removals
        under way are answered (at most remove_timeout)."""
        ...

    async def drain(self, runner: EngineRunner) -> str: ...

    def release(self, runner: EngineRunner) -> None: ...


class Fleet(Listener):
    def __init__(self, cfg: Config, *, policy: FleetPolicy | None = None, bus: EventBus | None = None,
                 stats: FleetStats | None = None, router: RouterGate | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock
        self.policy = policy or FleetPolicy(min_healthy=cfg.min_healthy,
                                            use_fault_tolerance=cfg.use_fault_tolerance,
                                            restart_immediately=cfg.restart_immediately,
                                            admit_mid_round=cfg.admit_mid_round, clock=clock,
                                            rule=cfg.weights.rule)
        self.bus = bus or EventBus()
        self.stats = stats or FleetStats(self.bus)
        self.runners: dict[str, EngineRunner] = {}
        self.started_at = time.time()
        self.pid = os.getpid()
        self.reloads = 0  # set by the daemon: reloads this process has been through
        # Called after a change the trainer was told about (round, version, a new pid): the
        # daemon's journal is written before the answer, so a kill -9 right after loses nothing.
        self.persist: Callable[[], None] = lambda: None
        self.router = router  # with [router]: the router the daemon feeds (a planned stop drains through it)
        # Membership kept incrementally: each engine's part (active, serving, routable) as last
        # counted, the totals, and the routable names (a set, and sorted for the event). A
        # transition recounts its own engine only: recounting the whole fleet on each one was
        # O(N^2) while N engines came up (4,096 never all became routable). A publish (the
        # current version moves) and a retire recount every engine.
        self._parts: dict[str, tuple[bool, bool, bool]] = {}
        self._active = self._serving = 0
        self._routable: set[str] = set()
        self._routable_sorted: list[str] = []
        self._routable_moved = False  # changed since the policy was last told
        self._counted_version: int | None = None  # the current version the parts were counted at
        self._publishing = asyncio.Lock()
        # The current version's fingerprint, when it was published with one (journaled: a
        # restarted daemon still checks engines by what they compute).
        self.fingerprint: tuple[int, Fingerprint] | None = None

    # -- what the policy knows, as the control socket, status and the journal read it ------

    @property
    def round(self) -> int | None:
        return self.policy.round

    @property
    def round_open(self) -> bool:
        return self.policy.round_open

    @property
    def current_version(self) -> int | None:
        return self.policy.current_version

    @property
    def checkpoint(self) -> str | None:
        return self.policy.checkpoint

    @property
    def epoch(self) -> int:
        return self.policy.epoch

    @property
    def below_floor(self) -> bool:
        return self.policy.below_floor

    @property
    def floor_breaches(self) -> int:
        return self.policy.floor_breaches

    def hold_reason(self) -> str | None:
        return self.policy.hold_reason()

    # -- events ----------------------------------------------------------------------------

    def subscribe(self, maxsize: int = 10000) -> Subscription:
        return self.bus.subscribe(maxsize)

    def unsubscribe(self, sub: Subscription) -> None:
        self.bus.unsubscribe(sub)

    def emit(self, name: str, /, **fields: Any) -> None:
        self.bus.emit(name, **fields)

    def on_transition(self, t: Transition) -> None:
        # The level is the journal's priority: FATAL waits for an operator, a detection is a
        # warning, the rest is the supervision's routine.
        level = log.error if t.to_state is State.FATAL else log.warning if detection_kind(t) else log.info
        level("engine.transition", engine=t.engine, from_state=t.from_state.value,
              to_state=t.to_state.value, reason=t.reason, cause=t.cause.value, incarnation=t.incarnation,
              **self._log_fields(t.engine))
        self.emit(Event.TRANSITION, engine=t.engine, from_state=t.from_state.value,
                  to_state=t.to_state.value, reason=t.reason, cause=t.cause.value, incarnation=t.incarnation)
        runner = self.runners.get(t.engine)
        self._membership_changed(None if runner is None else [runner])

    def on_probe(self, engine: str, outcome: ProbeOutcome) -> None:
        if outcome.kind == DAEMON_LIMIT:  # the daemon's shortage, not the engine's: once per run of them
            runner = self.runners.get(engine)
            last = runner.fsm.last_probe if runner is not None else None
            if last is None or last.kind != DAEMON_LIMIT:
                log.error("engine.probe_not_made", engine=engine, detail=outcome.detail)
        elif not outcome.ok:
            log.info("engine.probe_failed", engine=engine, detail=outcome.detail)
        elif outcome.excuse is not None:  # late, and judged busy or paused: not a failure
            log.info("engine.probe_excused", engine=engine, excuse=outcome.excuse, detail=outcome.detail)

    def _log_fields(self, engine: str | None = None) -> dict[str, Any]:
        """What an operator filters log lines on: the open round; the engine's process (pid)
        and, once it is gone, how it ended (exit_code or signal; unknown for a previous daemon's)."""
        out: dict[str, Any] = {"round": self.round} if self.round_open else {}
        runner = self.runners.get(engine) if engine is not None else None
        proc = runner.proc if runner is not None else None
        if proc is not None:
            out["pid"] = proc.pid
            if not proc.status_unknown and proc.returncode is not None:
                out.update(exit_fields(proc.returncode))
        return out

    # -- routing ---------------------------------------------------------------------------

    def is_routable(self, runner: EngineRunner) -> bool:
        return self.policy.is_routable(serving=runner.serving, retired=runner.retired,
                                       weight_version=runner.weight_version)

    def routable(self) -> list[EngineRunner]:
        return [r for r in self.runners.values() if self.is_routable(r)]

    def _count(self, runner: EngineRunner) -> None:
        """Bring `runner`'s part of the membership up to date: O(1), or O(log N) when it joins
        or leaves the routable set."""
        live = not runner.retired
        # A spare being kept current is no place's holder: the place of an engine that fails
        # meanwhile goes to a ready spare at once.
        part = (live and runner.state in ACTIVE and not runner.syncing_as_spare, live and runner.serving,
                self.is_routable(runner))
        was = self._parts.get(runner.name, (False, False, False))
        if part == was:
            return
        self._parts[runner.name] = part
        self._active += part[0] - was[0]
        self._serving += part[1] - was[1]
        if part[2] != was[2]:
            self._routable_moved = True
            i = bisect.bisect_left(self._routable_sorted, runner.name)
            if part[2]:
                self._routable.add(runner.name)
                self._routable_sorted.insert(i, runner.name)
            else:
                self._routable.discard(runner.name)
                del self._routable_sorted[i]

    def _membership_changed(self, changed: list[EngineRunner] | None = None) -> None:
        """After a change to the engines in `changed` (None: any engine, or the current
        version): the counts the policy decides spares with, the routable set and its epoch,
        the floor. Told in the same turn, as a full recount would."""
        if changed is None or self.policy.current_version != self._counted_version:
            self._counted_version = self.policy.current_version
            changed = list(self.runners.values())
            self._routable_moved = True  # the policy is told even if nothing moved, as before
        for runner in changed:
            self._count(runner)
        self.policy.active, self.policy.serving = self._active, self._serving
        if not self._routable_moved:  # the same set: no epoch, floor or strength change to find
            return
        self._routable_moved = False
        m = self.policy.set_routable(self._routable)
        if m.joined:
            self.bus.joined_routing(m.joined, self.clock())
        if m.changed:
            self.emit(Event.MEMBERSHIP, epoch=self.epoch, routable=list(self._routable_sorted))
            self.bus.membership(m.routable)
        floor = self.cfg.min_healthy
        if m.restored:
            log.info("fleet.floor_restored", routable=len(m.routable), min_healthy=floor)
            self.emit(Event.FLOOR_RESTORED, routable=len(m.routable), min_healthy=floor)
        elif m.breached:
            log.error("fleet.below_min_healthy", routable=len(m.routable), min_healthy=floor,
                      engines={r.name: r.state.value for r in self.runners.values()}, **self._log_fields())
            self.emit(Event.FLOOR_BREACH, routable=len(m.routable), min_healthy=floor)

    # -- rounds ----------------------------------------------------------------------------

    def restore(self, *, round_number: int | None, round_open: bool, version: int | None,
                checkpoint: str | None, fingerprint: Fingerprint | None = None) -> None:
        """Where a previous daemon's journal left the fleet (`fingerprint`: the current version's)."""
        self.policy.restore(round_number=round_number, round_open=round_open, version=version,
                            checkpoint=checkpoint)
        self.fingerprint = None if fingerprint is None or version is None else (version, fingerprint)

    def start_round(self, n: int) -> tuple[bool, str]:
        changed, message = self.policy.start_round(n)
        if not changed:
            return changed, message
        self.bus.round_started(n)
        self.persist()
        log.info("round.start", round=n, routable=len(self.policy.routable))
        self.emit(Event.ROUND_START, round=n, epoch=self.epoch)
        return changed, message

    def end_round(self, n: int) -> tuple[bool, str]:
        changed, message = self.policy.end_round(n)
        if not changed:
            return changed, message
        self.persist()
        log.info("round.end", round=n)
        self.emit(Event.ROUND_END, round=n, epoch=self.epoch)
        for r in self.runners.values():
            r.round_ended(n)
        self.bus.round_ended(n)
        return changed, message

    # -- weights ---------------------------------------------------------------------------

    async def publish_weights(self, version: int, checkpoint: str | None,
                              fingerprint: Fingerprint | None = None) -> tuple[bool, str]:
        """Record version V as current. Engines that do not report V (vLLM /weight_info) go STALE.
        With a fingerprint, engines that report V are checked first: one whose outputs do not
        match is handled as `fingerprint_mismatch` says (it never joins routing at V)."""
        # One publish at a time: each awaits (the checkpoint's check, the fingerprint's, the
        # engines' reads) between finding that V may become current and making it so, and two
        # side by side could leave the older version current.
        async with self._publishing:
            return await self._publish_weights(version, checkpoint, fingerprint)

    async def _publish_weights(self, version: int, checkpoint: str | None,
                               fingerprint: Fingerprint | None) -> tuple[bool, str]:
        check_version("version", version)
        if checkpoint is not None:
            models = [r.spec.model for r in self.runners.values() if r.spec.spawned]
            checkpoint = await validate_checkpoint_off_loop(checkpoint, models[0] if models else None)
        already = self.policy.check_publish(version, checkpoint)
        if already is not None:
            in_force = self.fingerprint_of(version)
            kept = fingerprints.republished(version, in_force, fingerprint)  # Conflict: another one
            if kept is not in_force and kept is not None:  # none was in force: kept for the checks to come
                self.fingerprint = (version, kept)
                self.persist()
            return False, already
        runners = list(self.runners.values())
        keep = self.cfg.spares_sync == "publish"
        # Checked before V is current: no engine is routable at V while its check runs.
        mismatched, unchecked, taken = (await self._check_at_publish(runners, version, fingerprint) if fingerprint
                                        else ({}, {}, {}))
        # Every engine's version read again before V is current, and applied with V, no await
        # between: a reader (status, /routable, the router's feed) sees the old routable set
        # or the new one, never every engine out while its read is on the way.
        reads = await asyncio.gather(*(r.read_version() for r in runners))
        self.policy.publish(version, checkpoint)
        self.fingerprint = None if fingerprint is None else (version, fingerprint)
        # Never believed further than a read goes: an unverified engine stays so, and a label
        # at V counts only where V's fingerprint, if it has one, was run on it (relabel).
        fingerprinted = None if fingerprint is None else version

        def take(rs: list[EngineRunner], reads: list[VersionRead | None]) -> None:
            for r, read in zip(rs, reads):
                r.take_version(read, checked=taken.get(r.name), fingerprinted=fingerprinted)

        # Those at a version the mode no longer allows (sync: any but V; async: more than
        # max_staleness behind V); spares too when they are kept current (spares_sync =
        # "publish"), otherwise a spare is synced only if it is ever promoted.
        def left_behind(r: EngineRunner) -> bool:
            return (r.serving or keep and r.state is State.STANDBY) and not self.policy.allows(r.weight_version)

        take(runners, reads)
        # Those V leaves behind are read once more: a read answered before a push that ended
        # meanwhile (the push's end leaves the label as it was while V is not yet published).
        # The others stay routable through it.
        again = [r for r in runners if left_behind(r)]
        if again:
            take(again, await asyncio.gather(*(r.read_version() for r in again)))
        # The fingerprint's verdicts first: an engine that failed the check is handled as
        # fingerprint_mismatch says (its cause), not as merely behind V.
        acted = self._fingerprint_mismatched(runners, version, mismatched)
        for r in runners:  # not verified, not condemned: synced again, and checked then
            if r.name in unchecked and r.probed:
                r.fingerprint_mismatch(version, f"/weight_info says {vlabel(version)}, but {unchecked[r.name]}; "
                                                "synced again")
                acted.append(r.name)
        # In async mode the engines within the bound keep serving (`lagging`).
        behind = [r.name for r in runners if left_behind(r)]
        lagging = [r.name for r in runners if r.serving and r.name not in behind and (self.policy.lag(r.weight_version) or 0) > 0]
        for r in runners:
            if r.name in behind:
                r.mark_outdated(version)
        self._membership_changed()
        self.persist()
        log.info("weights.published", version=version, checkpoint=checkpoint, stale=behind, lagging=lagging,
                 mode=self.policy.rule.mode.value, fingerprint=fingerprint is not None)
        fields: dict[str, Any] = {"version": version, "checkpoint": checkpoint, "stale": behind, "epoch": self.epoch}
        if lagging:
            fields["lagging"] = lagging
        if fingerprint is not None:
            fields["mismatched"] = {name: why for name, why in mismatched.items()}
            if unchecked:
                fields["unchecked"] = dict(unchecked)
        self.emit(Event.WEIGHTS_PUBLISHED, **fields)
        self.bus.weights_published(version)
        listed: list[str] = []
        if (behind or acted) and self.router is not None:
            listed = await self.router.settle()  # answered once the stale engines are out of the router
        msg = f"version {version} is current"
        if behind:
            msg += f"; stale (not routable until synced): {', '.join(behind)}"
        if lagging:
            msg += (f"; serving behind it, within max_staleness ({self.policy.rule.max_staleness}): "
                    f"{', '.join(lagging)}")
        if mismatched:
            msg += (f"; outputs not matching the fingerprint ({self.cfg.fingerprint_mismatch}): "
                    + "; ".join(f"{n}: {why}" for n, why in sorted(mismatched.items())))
        if unchecked:
            msg += ("; fingerprint not computed (not routable until synced and checked): "
                    + "; ".join(f"{n}: {why}" for n, why in sorted(unchecked.items())))
        if listed and self.router is not None:
            msg += (f"; the router has not confirmed their removal within remove_timeout "
                    f"({self.router.remove_timeout:g}s), still retried: {', '.join(listed)}")
        return True, msg

    # -- fingerprints (docs/weights.md#fingerprints) ------------------------------------------

    def fingerprint_of(self, version: int) -> Fingerprint | None:
        return self.fingerprint[1] if self.fingerprint is not None and self.fingerprint[0] == version else None

    async def check_fingerprint(self, runner: EngineRunner, fp: Fingerprint) -> tuple[str | None, bool]:
        """Run `fp` on the engine: (None, True) if its outputs match; (why, True) if they do not,
        or it answered without them (it could not show what it holds); (why, False) if it was not
        computed (no answer in time, no connection): that says nothing of its weights, and the
        heartbeat judges a dead or hung engine."""
        p = runner.prober
        began = time.monotonic()
        try:
            got = await fingerprints.probe(p.session, p.base_url, p.model, fp, p.auth,
                                           max(FINGERPRINT_TIMEOUT, self.cfg.probe.timeout))
        except (asyncio.TimeoutError, aiohttp.ClientConnectionError, OSError) as e:
            why = f"fingerprint not computed: {str(e) or type(e).__name__}"
            log.warning("fingerprint.failed", engine=runner.name, why=why)
            return why, False
        except Exception as e:
            why = f"fingerprint not computed: {str(e) or type(e).__name__}"
            log.warning("fingerprint.failed", engine=runner.name, why=why)
            return why, True
        seconds = time.monotonic() - began
        (log.info if got.matches else log.warning)("fingerprint.checked", engine=runner.name, matches=got.matches,
                                                   max_diff=got.max_diff, tolerance=got.tolerance,
                                                   seconds=round(seconds, 4))
        return (None if got.matches else got.describe()), True

    async def verify_content(self, runner: EngineRunner, label: int | str | None, at: str = "ready") -> Verdict:
        """An engine answering (ready, recovered) with /weight_info saying `label`: when that is
        the current version and it has a fingerprint, the fingerprint is run on it before the
        engine can be routable, and a mismatch is handled as `fingerprint_mismatch` says
        (fingerprints.judge decides); another version, which no fingerprint known here can
        check, is not routable on its label (fingerprints.unchecked decides).
        EngineRunner.verify_content is wired to this."""
        current = self.policy.current_version
        fp = None if current is None else self.fingerprint_of(current)
        unchecked = fingerprints.unchecked(label, None if fp is None else current, self.policy.rule)
        if unchecked is not None:
            return unchecked
        assert fp is not None and isinstance(label, int)  # unchecked: None only for the fingerprinted version
        why, computed = await self.check_fingerprint(runner, fp)
        verdict = fingerprints.judge(label, why, computed, self.cfg.fingerprint_mismatch)
        if verdict.mismatch is not None:
            self.stats.fingerprint_mismatch(at)
            log.warning("fingerprint.mismatch", engine=runner.name, version=label, why=verdict.mismatch,
                        action=self.cfg.fingerprint_mismatch, at=at)
        return verdict

    def label_after_sync(self, version: int) -> int | str:
        """What an engine synced to `version` and verified is taken to hold now: `version`, or
        unverified(version) when another version became current meanwhile with a fingerprint
        (only its outputs can be checked: an older version is not routable on a label alone,
        fingerprints.unchecked)."""
        current = self.policy.current_version
        fingerprinted = None if current is None or self.fingerprint_of(current) is None else current
        verdict = fingerprints.unchecked(version, fingerprinted, self.policy.rule)
        return version if verdict is None or verdict.version is None else verdict.version

    async def _check_at_publish(self, runners: list[EngineRunner], version: int,
                                fp: Fingerprint) -> tuple[dict[str, str], dict[str, str], dict[str, int]]:
        """The engines up (probed: serving, STALE or spares) whose /weight_info says `version`:
        those whose outputs do not match `fp` and those whose check was not computed, each
        name -> why; and those taken to hold `version` (their outputs matched, or
        fingerprint_mismatch = "warn": routed as the label says), name -> the incarnation
        checked. Read concurrently."""
        up = [r for r in runners if r.probed]
        warn = self.cfg.fingerprint_mismatch == "warn"

        async def one(r: EngineRunner) -> tuple[str, int, str | None, bool, bool]:
            incarnation = r.incarnation
            if await r.prober.weight_version() != version:
                return r.name, incarnation, None, True, False  # behind: goes STALE, synced and checked then
            why, computed = await self.check_fingerprint(r, fp)
            return r.name, incarnation, why, computed, why is None or computed and warn

        found = await asyncio.gather(*(one(r) for r in up))
        # Only about the incarnation checked: one that died meanwhile is a new engine.
        failed = [(name, why, computed) for name, inc, why, computed, _ in found
                  if why is not None and self.runners[name].incarnation == inc]
        return ({name: why for name, why, computed in failed if computed},
                {name: why for name, why, computed in failed if not computed},
                {name: inc for name, inc, _, _, ok in found if ok})

    def _fingerprint_mismatched(self, runners: list[EngineRunner], version: int,
                                mismatched: dict[str, str]) -> list[str]:
        """Carry out `fingerprint_mismatch` on the engines that failed the check at publish;
        the names taken out of routing."""
        action = self.cfg.fingerprint_mismatch
        acted = []
        for r in runners:
            why = mismatched.get(r.name)
            if why is None:
                continue
            self.stats.fingerprint_mismatch("publish")
            log.warning("fingerprint.mismatch", engine=r.name, version=version, why=why, action=action)
            if action == "warn" or not r.probed:  # warn, or it went down meanwhile
                continue
            acted.append(r.name)
            reason = f"/weight_info says {vlabel(version)}, but {why}"
            if action == "resync":
                r.fingerprint_mismatch(version, f"{reason}; synced again")
            else:
                r.condemn_and_stop(f"poisoned: {reason}", Cause.FINGERPRINT)
        return acted

    # -- engines ---------------------------------------------------------------------------

    async def _drain(self, runner: EngineRunner) -> str:
        """With a router: out of it first, then the engine's requests in flight end (bounded).
        Observe-only changes nothing: the engine stays listed, so it is not paused either."""
        if self.router is None or not self.router.drains() or not (runner.serving or self.is_routable(runner)):
            return ""
        return f" ({await self.router.drain(runner)})"

    def report_failure(self, runner: EngineRunner, detail: str, poisoned: bool = False,
                       incarnation: int | None = None) -> dict[str, Any]:
        """A failure the trainer saw. `poisoned`: a weight push into this engine failed between
        start and finish, so it holds half-loaded weights behind a 200 /health; no threshold
        applies, it is stopped (post-mortem first) and restarted now. `incarnation`, when the
        trainer says which one it saw fail: a late report about an earlier one is ignored."""
        if incarnation is not None and incarnation != runner.incarnation:
            self.emit(Event.FAILURE_REPORTED, engine=runner.name, detail=detail, counted=False, poisoned=poisoned,
                      incarnation=incarnation)
            return {"counted": False, "state": runner.state.value, "incarnation": runner.incarnation,
                    "message": f"report about incarnation {incarnation} ignored: {runner.name} is now at "
                               f"incarnation {runner.incarnation}"}
        if not runner.probed or runner.state is State.STANDBY or (not poisoned and runner.server_gone()):
            # The daemon saw the death first, or is about to (the server has exited: its exit
            # names it, not a count of failures), or a spare (never routed: nothing of the
            # trainer's reached it): on the stream, not counted.
            self.emit(Event.FAILURE_REPORTED, engine=runner.name, detail=detail, counted=False, poisoned=poisoned)
            return {"counted": False, "state": runner.state.value,
                    "message": f"{runner.name} is {runner.state.value}; failures count only while it serves"}
        self.emit(Event.FAILURE_REPORTED, engine=runner.name, detail=detail, counted=True, poisoned=poisoned)
        if poisoned:
            log.warning("engine.poisoned_reported", engine=runner.name, detail=detail)
        runner.report_failure(detail, poisoned=poisoned)
        return {"counted": True, "state": runner.state.value, "consecutive_failures": runner.consecutive_failures,
                "failure_threshold": self.cfg.probe.failure_threshold}

    async def engine_action(self, runner: EngineRunner, action: str) -> str:
        if not runner.spec.spawned and action != "retire":
            raise Conflict(f"{runner.name} is attached ({runner.spec.base_url}): the daemon did not start it "
                           f"and cannot {action} it; only retire it")
        if runner.retired and action != "retire":
            raise Conflict(f"{runner.name} is retired, and stays retired across daemon restarts (the journal "
                           f"keeps it); to use it again, stop the daemon and delete {self.cfg.state_dir}/journal.json")
        if action == "start":
            return runner.request_start("started by request")
        try:
            drained = await self._drain(runner)  # a planned stop: out of the router, requests end
            if action == "stop":
                return await runner.stop("stopped by request") + drained
            if action == "restart":
                await runner.stop("stopped by request (restart)")
                return runner.request_start("restarted by request") + drained
            runner.retired = True
            msg = await runner.stop("retired by request") if runner.spec.spawned else "retired"
        finally:
            if self.router is not None:
                self.router.release(runner)
        msg += drained
        self._membership_changed()
        self.emit(Event.RETIRED, engine=runner.name)
        return msg


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
    from vime.weight_sync.engine_http import run_in_thread

    fut = run_in_thread(validate_checkpoint, path, reference_model, name="validate-checkpoint")
    try:
        return await within(asyncio.wrap_future(fut), CHECKPOINT_READ_TIMEOUT)
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
