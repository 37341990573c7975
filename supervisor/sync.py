"""Bringing a STALE engine to the current weights, verified, in a round gap.

The tensors live in the trainer, so the daemon asks: a `sync_request` event goes to the
trainer agents on the event stream (trainer/resync_agent.py), and one of them pushes into that engine
alone over its own small process group, between `sync/begin` and `sync/end` calls. With no
agent connected, a checkpoint published with the version is the fallback: the daemon reloads
the engine from it. Either way the daemon then checks `/weight_info` and a deep probe before
the engine is RUNNING. A failed or timed-out sync leaves vLLM half-loaded (meta tensors
behind a 200 /health): the engine is poisoned and restarted, never routed.

The trainer's every-step push into the routable engines is not a sync: it is announced
(POST /v1/pushes) and ended, and while it is in flight its receivers, paused, are excused until
its deadline instead of sync_timeout (PushBook, pure; PushCoordinator, its I/O; the verdict is
the engine FSM's, through its PushWindow).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import structlog

from .engine.runner import EngineRunner
from .errors import BadRequest, Conflict
from .events import Listener
from .fleet import Fleet, validate_checkpoint_off_loop
from .engine.fsm import vlabel
from .states import Transition
from .protocol import Event, to_deadline
from .states import ACTIVE, Cause, State, VersionRule
from .tasks import TaskSet, sleep_until, within

S = State
log = structlog.get_logger("vime.sync")

# An agent that takes a sync_request answers with sync/begin at once (the push itself is bounded
# by sync_timeout): one silent for this long is passed over for the checkpoint, if there is one.
AGENT_ANSWER_TIMEOUT = 60.0


def _why(e: BaseException, timeout: float) -> str:
    """A failure's reason, never empty (a TimeoutError's str() is "")."""
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)) and not str(e):
        return f"not finished within sync_timeout ({timeout:g}s)"
    return str(e) or type(e).__name__


def _when(fleet: Fleet) -> str:
    """When membership may grow now, as a transition's reason says it."""
    if fleet.round_open and not fleet.policy.gated:
        return "async mode: no round gap to wait for"
    if fleet.round is None:
        return "no round yet"
    if fleet.round_open:
        return f"admitted inside round {fleet.round}"
    return f"round {fleet.round} ended"


class SyncCoordinator(Listener):
    """Built by the daemon's start-up and added to the bus: it hears of STALE engines, round
    starts and ends and new versions, and drives engines through their runners' verbs."""

    def __init__(self, fleet: Fleet, sync_timeout: float = 300.0):
        self.fleet = fleet
        self.sync_timeout = sync_timeout
        self.agents = 0
        self._asked: dict[str, int] = {}  # engine -> version requested from the agents
        self._silent: dict[str, int] = {}  # engine -> version the agents never answered for
        self.agent_timeout = min(AGENT_ANSWER_TIMEOUT, sync_timeout)
        self._watchdogs: dict[str, asyncio.Task[None]] = {}  # engine -> its push's deadline (in _tasks)
        # engine -> ((incarnation, the version it holds ahead of the current one), wait until)
        self._ahead: dict[str, tuple[tuple[int, int | str | None], float]] = {}
        self._tasks = TaskSet("sync")

    # -- what the bus tells it -------------------------------------------------------------

    def on_transition(self, t: Transition) -> None:
        runner = self.fleet.runners.get(t.engine)
        if t.to_state is S.STALE and runner is not None:
            # After the transition has settled: consider() may annotate or start a reload.
            asyncio.get_running_loop().call_soon(self.consider, runner)
        elif (t.from_state in ACTIVE and t.to_state not in ACTIVE or t.from_state is S.STARTING
              or t.to_state is S.STANDBY):
            # One fewer engine serving, a start that ended (a re-adopted engine checked, or
            # not), or a spare that is back: in a gap, promote if the fleet is short.
            asyncio.get_running_loop().call_soon(self.promote_spares)

    def on_round_started(self, n: int) -> None:
        self.round_started()

    def on_round_ended(self, n: int) -> None:
        self.kick()

    def on_weights_published(self, version: int) -> None:
        self.kick()

    # -- when to sync ----------------------------------------------------------------------

    def agent_connected(self) -> None:
        self.agents += 1
        self._asked.clear()  # a new agent may not have seen earlier requests: ask again
        self._silent.clear()
        self.kick()

    def agent_disconnected(self) -> None:
        self.agents = max(0, self.agents - 1)
        self.kick()

    def round_started(self) -> None:
        self._asked.clear()  # requests refused during the round are asked again in the gap

    def kick(self) -> None:
        self.promote_spares()
        self.sync_spares()
        for runner in list(self.fleet.runners.values()):
            self.consider(runner)

    def promote_spares(self) -> None:
        """In a round gap (in async mode at once), spares take the places of engines that
        failed: those already at the current version first (RUNNING at once), then the others
        (STALE: synced, verified).
        Inside a round with admit_mid_round, only those at the current version. "Current": at
        a version the mode allows (FleetPolicy.allows)."""
        fleet = self.fleet
        version = fleet.current_version
        allows = fleet.policy.allows
        runners = [r for r in fleet.runners.values() if not r.retired]
        spares = sorted((r for r in runners if r.state is S.STANDBY),
                        key=lambda r: (not allows(r.weight_version), r.name))
        wanted = fleet.policy.spares_wanted(
            current_spares=sum(allows(r.weight_version) for r in spares),
            behind=0 if version is None else sum(r.booted_behind and not allows(r.weight_version) for r in runners))
        if not wanted or any(r.readopting for r in fleet.runners.values()):
            return  # after a daemon restart, the re-adopted engines are checked first: they may serve
        gap = _when(fleet)
        for runner in spares[:wanted]:
            why = f"{fleet.policy.active}/{fleet.policy.target} engines active, {gap}"
            log.info("spare.promoted", engine=runner.name, active=fleet.policy.active, target=fleet.policy.target,
                     weight_version=runner.weight_version, version=version)
            runner.promote(why, version)

    def sync_spares(self) -> None:
        """With spares kept current (spares_sync = "publish"), in a gap (in async mode at any
        time): spares behind the current version (restarted inside a round, parked there) go
        STALE to be synced as serving engines are. After promote_spares: a current spare is
        promoted first."""
        fleet = self.fleet
        version = fleet.current_version
        if fleet.cfg.spares_sync != "publish" or fleet.policy.gated or version is None:
            return
        for runner in list(fleet.runners.values()):
            if runner.state is S.STANDBY and not runner.retired and not fleet.policy.allows(runner.weight_version):
                runner.mark_outdated(version)

    def consider(self, runner: EngineRunner) -> None:
        """A STALE engine in a gap (in async mode at any time): release it if it already holds a
        version the mode allows (the current one in sync mode), otherwise ask the agents for a
        push of the current version, or reload it from the checkpoint."""
        fleet = self.fleet
        version = fleet.current_version
        if runner.state is not S.STALE:
            return
        have = runner.weight_version
        allowed = fleet.policy.allows(have)
        spare = fleet.policy.park_reason(counted=not runner.syncing_as_spare) if not allowed else None
        if spare is not None and (fleet.cfg.spares_sync == "promotion" or fleet.policy.gated):
            # Not needed now: kept warm as it is, synced only if it is ever promoted; or, with
            # spares kept current, in the next gap (sync_spares). Inside a round too (a spare
            # restarted there): STANDBY is never routed, and left STALE it would count as an
            # active engine in the gap and keep a current spare from being promoted.
            when = "when promoted" if fleet.cfg.spares_sync == "promotion" else f"after round {fleet.round}"
            runner.park(f"weights {vlabel(have)}, current {vlabel(version)}: synced {when}; {spare}")
            return
        if fleet.policy.gated and not fleet.policy.admit_mid_round:
            if not allowed:
                runner.note(f"weights {vlabel(have)}, current {vlabel(version)}; sync after round {fleet.round}")
            return
        if allowed or version is None:  # nothing published: every version is allowed
            runner.release(_when(fleet), version)
            return
        if self._awaits_its_publish(runner, have, version):
            return
        if fleet.policy.gated:
            # Admitted mid-round once verified at the round's version. A checkpoint reload is
            # exactly that version; the trainer agent's push waits for the gap, as the tensors
            # it would read may already be past the round's version in a pipelined loop.
            if fleet.checkpoint is None:
                runner.note(f"weights {vlabel(have)}, current {vlabel(version)}; sync after round {fleet.round} "
                            "(no checkpoint published to reload from inside the round)")
                return
            runner.begin_sync(f"reloading {vlabel(version)} from checkpoint {fleet.checkpoint} inside round {fleet.round}")
            self._tasks.spawn(self._reload(runner, runner.incarnation, version, fleet.checkpoint))
            return
        if self.agents and self._silent.get(runner.name) != version:
            if self._asked.get(runner.name) == version:
                return
            self._asked[runner.name] = version
            runner.note(f"weights {vlabel(have)}, current {vlabel(version)}; sync requested from the trainer agent")
            log.info("sync.requested", engine=runner.name, version=version)
            fleet.emit(Event.SYNC_REQUEST, engine=runner.name, url=runner.spec.base_url,
                       model=runner.spec.model_name, version=version)
            self._tasks.spawn(self._agent_deadline(runner, runner.incarnation, version))
        elif fleet.checkpoint is not None:
            # SYNCING now, synchronously: a second consider() must not start a second reload.
            runner.begin_sync(f"reloading {vlabel(version)} from checkpoint {fleet.checkpoint}")
            self._tasks.spawn(self._reload(runner, runner.incarnation, version, fleet.checkpoint))
        elif runner.dummy_weights:
            # Booted on dummy weights for a push that is not coming: never served, restarted
            # reading the model (slower, but real weights).
            why = (f"the trainer agent did not answer within {self.agent_timeout:g}s" if self.agents
                   else "the trainer agent went away")
            log.warning("sync.dummy_fallback", engine=runner.name, version=version, why=why)
            runner.restart_reading_the_model(f"dummy weights (restart_load = \"dummy\") and nothing to sync them: "
                                             f"{why} and no checkpoint was published; restarting reading the model")
        elif self.agents:
            runner.note(f"weights {vlabel(have)}, current {vlabel(version)}; the trainer agent "
                        f"did not answer within {self.agent_timeout:g}s and no checkpoint was published "
                        "to reload from")
        else:
            runner.note(f"weights {vlabel(have)}, current {vlabel(version)}; waiting for a "
                        "trainer agent (no checkpoint published to reload from)")

    def _awaits_its_publish(self, runner: EngineRunner, have: int | str | None, version: int) -> bool:
        """An engine verified at a version ahead of the current one holds a push whose publish
        this daemon has not heard: it was killed between the trainer's push and its publish, and
        the trainer publishes again once it reconnects. Kept STALE (never routed) for
        agent_timeout instead of synced back to the older version and forward again at the
        publish, which left the next round with no engine at all."""
        lag = VersionRule.lag(have, version)
        if lag is None or lag >= 0:
            self._ahead.pop(runner.name, None)
            return False
        held = self._ahead.get(runner.name)
        if held is None or held[0] != (runner.incarnation, have):
            held = self._ahead[runner.name] = ((runner.incarnation, have), time.monotonic() + self.agent_timeout)
            self._tasks.spawn(self._look_again(runner, held[1]))
        if time.monotonic() >= held[1]:
            return False
        runner.note(f"weights {vlabel(have)}, ahead of current {vlabel(version)}: pushed before a publish this "
                    f"daemon has not heard; waiting up to {self.agent_timeout:g}s for it before syncing back")
        return True

    async def _look_again(self, runner: EngineRunner, at: float) -> None:
        # sleep_until, not one sleep: ending a moment early would find the wait not yet over,
        # with no timer left to look again.
        await sleep_until(at, time.monotonic)
        self.consider(runner)

    async def _agent_deadline(self, runner: EngineRunner, incarnation: int, version: int) -> None:
        """A connected agent that never calls sync/begin must not hold the engine STALE for
        ever: past agent_timeout it is passed over (the checkpoint, if any, is used)."""
        await asyncio.sleep(self.agent_timeout)
        if (runner.state is S.STALE and runner.incarnation == incarnation and self.fleet.current_version == version
                and self._asked.get(runner.name) == version):
            self._asked.pop(runner.name, None)
            self._silent[runner.name] = version
            log.warning("sync.agent_silent", engine=runner.name, version=version, timeout=self.agent_timeout)
            self.consider(runner)

    async def close(self) -> None:
        await self._tasks.aclose()
        self._watchdogs.clear()

    # -- the trainer agent's push ----------------------------------------------------------

    def begin(self, runner: EngineRunner, version: int) -> dict[str, Any]:
        fleet = self.fleet
        if version != fleet.current_version:
            raise Conflict(f"version {version} is not current ({vlabel(fleet.current_version)}); push the current version")
        if runner.state is not S.STALE:
            raise Conflict(f"{runner.name} is {runner.state.value}, not STALE: nothing to sync")
        if fleet.policy.gated:
            raise Conflict(f"round {fleet.round} is open; syncs run in the gap after it")
        runner.begin_sync(f"trainer agent pushing {vlabel(version)}")  # SYNCING is never probed
        self._asked.pop(runner.name, None)
        old = self._watchdogs.pop(runner.name, None)
        if old is not None:
            old.cancel()
        self._watchdogs[runner.name] = self._tasks.spawn(self._watchdog(runner, runner.incarnation, version),
                                                         name=f"sync-watchdog:{runner.name}")
        return {"engine": runner.name, "url": runner.spec.base_url, "version": version}

    async def end(self, runner: EngineRunner, version: int, ok: bool, error: str | None) -> dict[str, Any]:
        dog = self._watchdogs.pop(runner.name, None)
        if dog is not None:
            dog.cancel()
        if runner.state is not S.SYNCING:
            raise Conflict(f"{runner.name} is {runner.state.value}, not SYNCING: call sync/begin first")
        if not ok:
            self._poisoned(runner, f"push of {vlabel(version)} failed: {error or 'no detail'}")
        else:
            await self._verify(runner, runner.incarnation, version, "pushed by the trainer agent")
        return {"engine": runner.name, "state": runner.state.value, "reason": runner.reason}

    async def _watchdog(self, runner: EngineRunner, incarnation: int, version: int) -> None:
        await asyncio.sleep(self.sync_timeout)
        self._watchdogs.pop(runner.name, None)
        if runner.state is S.SYNCING and runner.incarnation == incarnation:
            self._poisoned(runner, f"push of {vlabel(version)} not finished within {self.sync_timeout:g}s")

    # -- the disk fallback -----------------------------------------------------------------

    async def _reload(self, runner: EngineRunner, incarnation: int, version: int, checkpoint: str) -> None:
        try:
            # Checked again (the files may have changed since publishing), off the loop, before
            # the engine is touched. Then the engine's work alone runs under sync_timeout: the
            # reload is async, so no engine waits for a thread with its clock running.
            await validate_checkpoint_off_loop(checkpoint)
            await within(runner.reload_weights(checkpoint, version, self.sync_timeout), self.sync_timeout)
        except Exception as e:  # any failure mid-reload leaves meta tensors behind
            if runner.state is S.SYNCING and runner.incarnation == incarnation:
                self._poisoned(runner, f"reload of {vlabel(version)} from {checkpoint} failed: "
                                       f"{_why(e, self.sync_timeout)}")
            return
        await self._verify(runner, incarnation, version, f"reloaded from {checkpoint}")

    # -- verification and poison -----------------------------------------------------------

    async def _verify(self, runner: EngineRunner, incarnation: int, version: int, how: str) -> None:
        ours, problem = await runner.verify_weights(version, incarnation)
        if not ours:  # the engine died or was stopped meanwhile
            return
        if problem is not None:
            self._poisoned(runner, f"{how}, but {problem}")
            return
        extra: dict[str, Any] = {}
        fp = self.fleet.fingerprint_of(version)
        if fp is not None:  # the label says the version: do the outputs? (docs/weights.md#fingerprints)
            began = time.monotonic()
            mismatch, _ = await self.fleet.check_fingerprint(runner, fp)  # not computed: not verified either
            extra["fingerprint_s"] = round(time.monotonic() - began, 4)
            if not (runner.state is S.SYNCING and runner.incarnation == incarnation):
                return
            if mismatch is not None:
                self.fleet.stats.fingerprint_mismatch("sync")
                log.warning("fingerprint.mismatch", engine=runner.name, version=version, why=mismatch,
                            action=self.fleet.cfg.fingerprint_mismatch)
                if self.fleet.cfg.fingerprint_mismatch != "warn":  # a resync that did not match: poisoned
                    self._poisoned(runner, f"{how}, /weight_info says {vlabel(version)}, but {mismatch}",
                                   Cause.FINGERPRINT)
                    return
        # Judged now, with the version current now: a publish that landed during the sync (the
        # push, the reload, the checks above all await) may leave `version` outside the rule,
        # or not routable on its label alone (a newer version's fingerprint is in force). Then
        # it never serves in between: STALE, and synced again.
        label = self.fleet.label_after_sync(version)
        if not self.fleet.policy.allows(label):
            current = self.fleet.current_version
            runner.sync_overtaken(label, current, how)
            log.info("sync.overtaken", engine=runner.name, version=version, label=label, current=current, how=how,
                     **extra)
            self.consider(runner)
            return
        runner.finish_sync(version, hold=self.fleet.hold_reason())
        log.info("sync.verified", engine=runner.name, version=version, how=how, **extra)
        self.fleet.emit(Event.SYNC_VERIFIED, engine=runner.name, version=version, how=how, **extra)

    def _poisoned(self, runner: EngineRunner, why: str, cause: Cause = Cause.SYNC_FAILED) -> None:
        log.warning("sync.poisoned", engine=runner.name, why=why)
        self.fleet.emit(Event.SYNC_FAILED, engine=runner.name, reason=why)
        # A spawned engine is stopped (post-mortem first) and restarted; an attached one stays
        # UNHEALTHY, probed, never routed, until it answers again on the current version.
        runner.condemn_and_stop(f"poisoned: {why}", cause)


# -- announced pushes: the trainer's every-step push into the routable engines ------------------

# An announced push never ended is dropped this long after its deadline (a trainer that died
# must not pin a reload or an engine's excuse); its receivers still paused are condemned anyway.
PUSH_GRACE = 5.0
# The longest deadline a push may announce: a day. Past it, a typo (ms for s) would hold a
# reload and excuse a wedged engine for that long.
MAX_PUSH_DEADLINE = 86400.0


@dataclass
class Push:
    """One announced push; times on the book's clock."""

    id: str
    version: int
    engines: tuple[str, ...]
    nbytes: int
    deadline_s: float
    began: float
    grace: float = PUSH_GRACE  # past the deadline, until it expires
    condemned: dict[str, str] = field(default_factory=dict)  # receivers condemned during it: why
    incarnations: dict[str, int] = field(default_factory=dict)  # each receiver's, as announced

    @property
    def deadline(self) -> float:
        return self.began + self.deadline_s

    @property
    def expires(self) -> float:
        return self.deadline + self.grace

    def info(self, now: float) -> dict[str, Any]:
        return {"push": self.id, "version": self.version, "engines": list(self.engines), "bytes": self.nbytes,
                "deadline_s": self.deadline_s, "age_s": round(now - self.began, 3),
                "remaining_s": round(self.deadline - now, 3)}


def taken_up_after_push(held: int | str | None, read: int | str | None, push_version: int,
                        current: int | None) -> bool:
    """Pure: is what a receiver's /weight_info says at its push's end taken up now (checked as
    a ready engine is, and the engine relabelled: it leaves routing if the rule does not allow
    it)? Not when it says what the engine was taken to hold already; nor when it says the push's
    version before that is published (pushed, then published, as the trainer does): an engine
    is never routable at a version not published yet, and is not taken out of routing for
    holding it early; the publish reads and checks it again."""
    if read == held:
        return False
    lag = VersionRule.lag(read, current)
    return not (read == push_version and lag is not None and lag < 0)


class PushBook:
    """Pure: the announced pushes in flight, checked as announced and ended, with an injected
    clock. I/O (timers, events, engines) is PushCoordinator's."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, grace: float = PUSH_GRACE):
        self.clock = clock
        # At least one probe cycle: a receiver paused past the deadline is judged at its next
        # probe, which must come before the push expires, or its condemnation goes unrecorded.
        self.grace = max(PUSH_GRACE, grace)
        self.pushes: dict[str, Push] = {}
        self._serial = itertools.count(1)
        self._prefix = secrets.token_hex(3)  # ids of an earlier daemon image are never reused

    def check(self, version: int, engines: list[str], nbytes: int, deadline_s: float,
              current_version: int | None) -> None:
        """Raises BadRequest or Conflict (saying what to do); changes nothing."""
        if not engines:
            raise BadRequest("engines must name at least one engine (the push's receivers)")
        dup = sorted({e for e in engines if engines.count(e) > 1})
        if dup:
            raise BadRequest(f"engines names {', '.join(dup)} more than once; name each receiver once")
        if nbytes < 0 or nbytes >= 2**63:
            raise BadRequest(f"bytes must be >= 0 and < 2**63, got {nbytes}")
        if not (math.isfinite(deadline_s) and 0 < deadline_s <= MAX_PUSH_DEADLINE):
            raise BadRequest(f"deadline_s must be a number of seconds > 0 and <= {MAX_PUSH_DEADLINE:g}, "
                             f"got {deadline_s!r}")
        if current_version is not None and version < current_version:
            # As publishing: versions only increase. The current one (a push again) or a later
            # one (about to be published) is fine; an older one would undo the fleet's weights.
            raise Conflict(f"version {version} is stale: the current version is {current_version}; push the current "
                           "version or the one you are about to publish")
        for name in engines:
            held = self.holding(name)
            if held is not None:
                left = held.deadline - self.clock()
                when = to_deadline(left) + (", expiring" if left < 0.5 else "")
                raise Conflict(f"{name} already receives push {held.id} (v{held.version}, {when}); end it "
                               f"first (POST /v1/pushes/{held.id}/end) or wait for it to expire")

    def announce(self, version: int, engines: list[str], nbytes: int, deadline_s: float,
                 current_version: int | None) -> Push:
        self.check(version, engines, nbytes, deadline_s, current_version)
        push = Push(f"{self._prefix}-{next(self._serial)}", version, tuple(engines), nbytes, float(deadline_s),
                    self.clock(), self.grace)
        self.pushes[push.id] = push
        return push

    def get(self, push_id: str) -> Push | None:
        return self.pushes.get(push_id)

    def end(self, push_id: str) -> Push | None:
        return self.pushes.pop(push_id, None)

    def holding(self, engine: str) -> Push | None:
        return next((p for p in self.pushes.values() if engine in p.engines), None)

    def expired(self) -> list[Push]:
        """Pushes past their deadline and the grace, taken out of the book."""
        now = self.clock()
        gone = [p for p in self.pushes.values() if now >= p.expires]
        for p in gone:
            del self.pushes[p.id]
        return gone

    def in_flight(self) -> list[Push]:
        return sorted(self.pushes.values(), key=lambda p: p.began)

    def wait_bound(self) -> float:
        """Seconds until every push in flight now has ended or expired (0 with none)."""
        now = self.clock()
        return max((p.expires - now for p in self.pushes.values()), default=0.0)


class PushCoordinator(Listener):
    """The announced pushes' I/O: each receiver's excuse set and cleared, an expiry timer per
    push, events on the stream, log lines and the statistics. Added to the bus for the
    transitions that condemn a receiver during a push."""

    def __init__(self, fleet: Fleet, clock: Callable[[], float] = time.monotonic, grace: float = PUSH_GRACE):
        self.fleet = fleet
        self.book = PushBook(clock, grace)
        self._tasks = TaskSet("pushes")
        self._timers: dict[str, asyncio.Task[None]] = {}  # push id -> its expiry (in _tasks)

    def on_transition(self, t: Transition) -> None:
        # A receiver lost during the push on the daemon's own evidence: condemned (paused past
        # the deadline, hung, poisoned...) or dead. A stop's EXITED after its UNHEALTHY is the
        # same loss; an operator's stop is none.
        lost = t.to_state is S.UNHEALTHY or (t.to_state is S.EXITED and t.cause is Cause.EXIT)
        if not lost:
            return
        push = self.book.holding(t.engine)
        if push is not None and t.engine not in push.condemned:
            push.condemned[t.engine] = t.reason
            self.fleet.stats.push_receiver_failed("deadline" if t.cause is Cause.PAUSED else "engine")

    def begin(self, version: int, engines: list[str], nbytes: int, deadline_s: float) -> dict[str, Any]:
        push = self.book.announce(version, engines, nbytes, deadline_s, self.fleet.current_version)
        for name in push.engines:
            self.fleet.runners[name].push_announced(push.id, push.deadline_s)
            push.incarnations[name] = self.fleet.runners[name].incarnation
        self._timers[push.id] = self._tasks.spawn(self._expire(push), name=f"push-expiry:{push.id}")
        self.fleet.stats.push_announced(len(push.engines))
        log.info("push.begin", push=push.id, version=version, engines=list(push.engines), bytes=nbytes,
                 deadline_s=push.deadline_s)
        self.fleet.emit(Event.PUSH_BEGIN, push=push.id, version=version, engines=list(push.engines), bytes=nbytes,
                        deadline_s=push.deadline_s)
        return {"push": push.id, "version": version, "deadline_s": push.deadline_s, "engines": list(push.engines)}

    async def end(self, push_id: str, ok: bool, failed: dict[str, str]) -> dict[str, Any] | None:
        """None: no such push in flight. BadRequest for a `failed` that contradicts the push
        (nothing changes). Answered once every receiver's /weight_info was read again: a
        trainer that updates the fleet in waves (trainer/inflight.py) ends each wave's push
        before the next, so the daemon's labels follow the engines, not the trainer's word."""
        push = self.book.get(push_id)
        if push is None:
            return None
        strangers = sorted(set(failed) - set(push.engines))
        if strangers:
            raise BadRequest(f"failed names {', '.join(strangers)}, not receivers of push {push_id} "
                             f"({', '.join(push.engines)})")
        if ok and failed:
            raise BadRequest(f"ok is true but failed names {', '.join(sorted(failed))}; send ok: false")
        self.book.end(push_id)
        timer = self._timers.pop(push_id, None)
        if timer is not None:
            timer.cancel()
        now = self.book.clock()
        for name in push.engines:
            runner = self.fleet.runners.get(name)
            # A receiver that failed keeps the push's deadline as its excuse: still paused past
            # it (its transfer call cut while it answers /health), it is condemned then, not
            # after sync_timeout. An answer or a new incarnation clears it.
            if runner is not None and name not in failed:
                runner.push_ended(push.id)
        outcome = "ok" if ok else "failed"
        seconds = now - push.began
        self.fleet.stats.push_ended(outcome, seconds, push.nbytes, failed=len(failed))
        fields = {"push": push.id, "version": push.version, "outcome": outcome, "seconds": round(seconds, 3),
                  "failed": dict(failed), "condemned": dict(push.condemned)}
        (log.info if ok else log.warning)("push.end", late=now >= push.deadline, **fields)
        self.fleet.emit(Event.PUSH_END, **fields)
        answer = {**fields, "late": now >= push.deadline, "engines": list(push.engines)}
        answer["weight_versions"] = await self._read_again(push)
        return answer

    async def _read_again(self, push: Push) -> dict[str, int | str | None]:
        """Each receiver still of the incarnation announced, serving or a spare: its
        /weight_info read again, what it says taken up as taken_up_after_push decides (checked
        by Fleet.verify_content, relabelled: out of routing if the rule does not allow it). The
        labels the daemon holds after it, by receiver (the ones not read: as they were)."""
        fleet = self.fleet

        def same(runner: EngineRunner, incarnation: int | None) -> bool:
            return runner.incarnation == incarnation and (runner.serving or runner.state is S.STANDBY)

        async def one(name: str) -> None:
            runner = fleet.runners.get(name)
            if runner is None or not same(runner, push.incarnations.get(name)):
                return
            held = runner.weight_version
            read = await runner.prober.read_weight_version()
            if not read.readable or not taken_up_after_push(held, read.version, push.version, fleet.current_version):
                return
            # A fingerprint of the current version is run as on a ready engine (a mismatch:
            # counted at="push", handled as fingerprint_mismatch says).
            verdict = await fleet.verify_content(runner, read.version, at="push")
            if not same(runner, push.incarnations.get(name)) or runner.weight_version is not held:
                return  # moved meanwhile (a death, a publish's read, a sync): that verdict stands
            log.info("push.reread", engine=name, push=push.id, held=held, read=read.version, label=verdict.version,
                     current=fleet.current_version)
            runner.relabelled(verdict, f"/weight_info read after push {push.id} (v{push.version})")

        await asyncio.gather(*(one(n) for n in push.engines))
        return {n: fleet.runners[n].weight_version for n in push.engines if n in fleet.runners}

    async def _expire(self, push: Push) -> None:
        await sleep_until(push.expires, self.book.clock)
        self._timers.pop(push.id, None)
        for gone in self.book.expired():
            # Not cleared from the receivers: one still paused past the deadline is condemned
            # at its next probe (a dead trainer leaves it half-loaded).
            self.fleet.stats.push_ended("expired", None, 0)
            fields = {"push": gone.id, "version": gone.version, "outcome": "expired",
                      "seconds": round(self.book.clock() - gone.began, 3), "failed": {},
                      "condemned": dict(gone.condemned)}
            log.warning("push.expired", engines=list(gone.engines), deadline_s=gone.deadline_s,
                        why=f"not ended within its deadline and {gone.grace:g}s of grace; receivers still paused "
                            "are condemned", **fields)
            self.fleet.emit(Event.PUSH_END, **fields)

    def in_flight(self) -> list[dict[str, Any]]:
        now = self.book.clock()
        return [p.info(now) for p in self.book.in_flight()]

    async def close(self) -> None:
        await self._tasks.aclose()
