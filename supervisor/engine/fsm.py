"""The pure per-engine state machine: no I/O, no sleeping, an injected clock (docs/concepts.md).

The runner (engine/runner.py) feeds it what it saw (spawned, ready, a probe result, the process
exited) and carries out what it decides (stop now, back off for d seconds, give up). Every state
change is one Transition, with a structured `cause` (states.Cause) beside its `reason` for
people, handed to `on_transition`: the runner passes it to the event bus. Only the runner calls
the inputs below.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..config import ProbePolicy, RestartPolicy
from ..states import (DAEMON_LIMIT, PROBED, ROUTABLE, SYNC_RULE, TRANSITIONS, Cause, ProbeOutcome, State, Transition,
                      VersionRule)

S = State
Clock = Callable[[], float]


class IllegalTransition(RuntimeError):
    pass


def vlabel(version: int | str | None) -> str:
    """How a weight version reads in reasons and status: v118, or base (never published)."""
    return "base" if version is None else f"v{version}"


def _weights(current_version: int | None, held: int | str | None = None) -> str:
    """What an engine allowed to serve holds: the current version, or (async mode) one within
    max_staleness behind it (`held`)."""
    if current_version is None:
        return "base weights"
    lag = VersionRule.lag(held, current_version)
    if lag:
        return f"weights {vlabel(held)}, verified, {lag} behind {vlabel(current_version)} (within max_staleness)"
    return f"weights {vlabel(current_version)}, verified"


def backoff_delay(failures: int, policy: RestartPolicy, rng: random.Random) -> float:
    """Exponential backoff with jitter in [d/2, d]: failures=1 -> ~initial, doubling, capped."""
    base = min(policy.backoff_max, policy.backoff_initial * 2 ** max(0, failures - 1))
    return base * rng.uniform(0.5, 1.0)


@dataclass(frozen=True)
class PushWindow:
    """An announced weight push this engine receives (POST /v1/pushes): while it holds, a
    paused engine is excused until `deadline` (on the FSM's clock), not for sync_timeout."""

    push: str  # the push's id
    deadline: float  # the announcement's time + deadline_s, on the FSM's clock
    deadline_s: float  # as announced, for reasons


@dataclass
class EngineFSM:
    name: str
    probe: ProbePolicy
    restart: RestartPolicy
    clock: Clock
    rng: random.Random = field(default_factory=random.Random)
    on_transition: Callable[[Transition], None] | None = None

    state: State = S.STOPPED
    reason: str = "not started"
    since: float = 0.0
    incarnation: int = 0
    failed_starts: int = 0  # consecutive; reset when an incarnation becomes ready
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    last_error: str = ""
    last_probe: ProbeOutcome | None = None
    spawned_at: float | None = None
    ready_at: float | None = None
    backoff_until: float | None = None
    restarts: int = 0  # total restarts after the first start
    weight_version: int | str | None = None
    held: bool = False  # STALE only because a round is open
    excused_since: float | None = None  # first of the unbroken run of probes without progress
    excuse: str | None = None  # what the last of them was excused as
    cause: Cause | None = None  # of the last transition
    limit_since: float | None = None  # first of the unbroken run of probes the daemon could not make
    push: PushWindow | None = None  # the announced push it receives, until ended or answered past it
    _restart_times: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.since = self.clock()

    # -- queries ---------------------------------------------------------------------------

    @property
    def routable(self) -> bool:
        return self.state in ROUTABLE

    @property
    def probed(self) -> bool:
        return self.state in PROBED

    @property
    def unobserved(self) -> bool:
        """Out of routing because the daemon could not probe it (not the engine's fault): it is
        still probed, and back once a probe is made and answered."""
        return self.state is S.UNHEALTHY and self.cause is Cause.DAEMON_LIMIT

    def limit_bound(self) -> float:
        """How long an unbroken run of probes the daemon could not make keeps a serving engine
        routable: as long as a hang takes to confirm (ProbePolicy.hang_bound)."""
        return self.probe.hang_bound()

    def uptime(self) -> float | None:
        return None if self.ready_at is None else self.clock() - self.ready_at

    # -- the one way state changes ---------------------------------------------------------

    def _go(self, to: State, reason: str, cause: Cause) -> Transition:
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.name}: {self.state} -> {to} ({reason})")
        t = Transition(self.name, self.state, to, reason, self.clock(), self.incarnation, Cause(cause))
        self.state, self.reason, self.since, self.cause = to, reason, t.at, t.cause
        if self.on_transition is not None:
            self.on_transition(t)
        return t

    # -- inputs ----------------------------------------------------------------------------

    def begin_start(self, reason: str, *, restart: bool | None = None, cause: Cause | None = None) -> bool:
        """A new incarnation. Returns False (and goes FATAL) if the flapping window is full.

        `restart` defaults to "not the first incarnation"; re-adopting a running engine after
        a daemon restart passes False: the engine itself did not restart. `cause` defaults to
        RESTART for a restart, else START.
        """
        now = self.clock()
        is_restart = self.incarnation > 0 if restart is None else restart
        if is_restart:
            while self._restart_times and now - self._restart_times[0] > self.restart.flapping_window:
                self._restart_times.popleft()
            if len(self._restart_times) >= self.restart.flapping_max_restarts:
                self.last_error = self.last_error or self.reason
                self._go(
                    S.FATAL,
                    f"flapping: {len(self._restart_times)} restarts within "
                    f"{self.restart.flapping_window:g}s; last: {self.reason}",
                    Cause.FLAPPING,
                )
                return False
            self._restart_times.append(now)
            self.restarts += 1
        self.incarnation += 1
        self.spawned_at = now
        self.ready_at = None
        self.backoff_until = None
        self.consecutive_failures = self.consecutive_successes = 0
        self.last_probe = None
        self.weight_version = None
        self.held = False
        self.excused_since = self.excuse = None
        self.limit_since = None
        self.push = None  # a new process is in no push
        self._go(S.STARTING, reason, cause or (Cause.RESTART if is_restart else Cause.START))
        return True

    def became_ready(self, weight_version: int | str | None, current_version: int | None,
                     hold: str | None = None, spare: str | None = None, behind_ok: bool = False,
                     rule: VersionRule = SYNC_RULE) -> Transition:
        """First healthy answer inside first_wait. Nothing reaches RUNNING on old weights, and
        nothing joins routing during a round (`hold` says why it waits): both are STALE.
        `spare`: the fleet is at its routing target (why): a current engine is kept warm in
        STANDBY instead, whether a round is open or not; with `behind_ok` one behind too (a
        re-adopted spare, synced only if promoted). "Current": a version `rule` allows."""
        self.ready_at = self.clock()
        self.failed_starts = 0
        self.weight_version = weight_version
        took = self.ready_at - (self.ready_at if self.spawned_at is None else self.spawned_at)
        current = rule.allows(weight_version, current_version)
        if spare is not None and (current or behind_ok):
            what = _weights(current_version, weight_version) if current else f"weights {vlabel(weight_version)}"
            return self.park(f"ready in {took:.1f}s; {what}; {spare}")
        if current and hold is None:
            return self._go(S.RUNNING, f"ready in {took:.1f}s; {_weights(current_version, weight_version)}",
                            Cause.READY)
        self.held = hold is not None
        why = hold if current else f"weights {vlabel(weight_version)}, current {vlabel(current_version)}"
        return self._go(S.STALE, f"ready in {took:.1f}s; {why}", Cause.READY)

    def release(self, why: str, current_version: int | None, spare: str | None = None,
                rule: VersionRule = SYNC_RULE) -> Transition | None:
        """A held engine at a version `rule` allows joins routing (in a round gap), or becomes
        a spare (`spare`: why the fleet does not need it)."""
        self.held = False
        if rule.allows(self.weight_version, current_version):
            if spare is not None:
                return self.park(f"{why}; {_weights(current_version, self.weight_version)}; {spare}")
            return self._go(S.RUNNING, f"{why}; {_weights(current_version, self.weight_version)}", Cause.RELEASED)
        self.reason = f"{why}; weights {vlabel(self.weight_version)}, current {vlabel(current_version)}"
        return None

    def park(self, reason: str) -> Transition:
        """STANDBY: up, probed and never routed until promoted (its weights may be behind)."""
        self.held = False
        return self._go(S.STANDBY, reason, Cause.SPARE)

    def promote(self, why: str, current_version: int | None, rule: VersionRule = SYNC_RULE) -> Transition:
        """A spare takes a failed engine's place (in a round gap): RUNNING at a version `rule`
        allows, else STALE, to be synced and verified before it serves."""
        if rule.allows(self.weight_version, current_version):
            return self._go(S.RUNNING, f"promoted: {why}; {_weights(current_version, self.weight_version)}",
                            Cause.PROMOTED)
        return self._go(S.STALE, f"promoted: {why}; weights {vlabel(self.weight_version)}, current "
                                 f"{vlabel(current_version)}: synced first", Cause.PROMOTED)

    def reset_budget(self) -> None:
        """An operator's start: a fresh start budget and flapping window (as supervisord)."""
        self.failed_starts = 0
        self._restart_times.clear()

    def start_failed(self, error: str, *, permanent: bool = False,
                     cause: Cause = Cause.START_FAILED) -> float | None:
        """A bring-up failed (STARTING, or STOPPING after a failed start).

        Counts against the start budget. Returns the backoff delay, or None when FATAL.
        `permanent`: starting again cannot help (a bad model path, an argument vLLM refuses):
        FATAL at once, whatever is left of the budget.
        """
        self.failed_starts += 1
        self.last_error = error
        if permanent:
            self._go(S.FATAL, f"start failed, not retried (permanent): {error}", cause)
            return None
        if self.failed_starts >= self.restart.start_retries:
            self._go(S.FATAL, f"start retries exhausted ({self.failed_starts}); last error: {error}", cause)
            return None
        delay = backoff_delay(self.failed_starts, self.restart, self.rng)
        self.backoff_until = self.clock() + delay
        self._go(
            S.BACKOFF,
            f"start failed ({self.failed_starts}/{self.restart.start_retries}): {error}; "
            f"retry in {delay:.1f}s",
            cause,
        )
        return delay

    def probe_result(self, outcome: ProbeOutcome, *, reported: bool = False) -> bool:
        """Feed one heartbeat. Returns True when the engine must be stopped now.

        `reported`: the failure is the trainer's report, not our probe (cause REPORTED).
        """
        if self.state not in PROBED and self.state is not S.UNHEALTHY:
            return False  # a late answer for an engine that has moved on
        self.last_probe = outcome
        if outcome.kind == DAEMON_LIMIT:  # the daemon's own shortage says nothing of the engine
            self._unobserved_for(outcome)
            return False
        self.limit_since = None
        if self._excused_too_long(outcome):
            return True
        if outcome.ok:
            self.consecutive_failures = 0
            self.consecutive_successes += 1
            if self.state is S.SUSPECT and self.consecutive_successes >= self.probe.success_threshold:
                self._go(S.RUNNING, f"recovered: {self.consecutive_successes} probe successes", Cause.RECOVERED)
            return False
        self.consecutive_successes = 0
        self.consecutive_failures += 1
        n, k = self.consecutive_failures, self.probe.failure_threshold
        if n >= k:
            why = f"hung: {n} consecutive probe failures (last: {outcome.detail})"
            if self.state is not S.UNHEALTHY:
                self._go(S.UNHEALTHY, why, Cause.REPORTED if reported else Cause.HANG)
            elif self.cause is Cause.DAEMON_LIMIT:  # probes made again, and failed: the engine's now
                self.reason, self.cause = why, Cause.REPORTED if reported else Cause.HANG
            return True
        if self.state is S.RUNNING:
            self._go(S.SUSPECT, f"{n}/{k} probe failures (last: {outcome.detail})",
                     Cause.REPORTED if reported else Cause.PROBE)
        else:
            self.reason = f"{self.state.value.lower()}; {n}/{k} probe failures (last: {outcome.detail})"
        return False

    def _unobserved_for(self, outcome: ProbeOutcome) -> None:
        """A probe the daemon could not make: counted neither way, but a serving engine is not
        kept routable unobserved for longer than a hang takes to confirm (limit_bound). Past
        it, UNHEALTHY with cause daemon_limit: out of routing, never stopped or restarted for
        it; the next probe made decides (an answer brings it back, failures are a hang)."""
        now = self.clock()
        if self.limit_since is None:
            self.limit_since = now
        lasted = now - self.limit_since
        if self.state in ROUTABLE and lasted >= self.limit_bound():
            self._go(S.UNHEALTHY, f"unobserved: the daemon could not probe it for {lasted:.0f}s "
                                  f"(last: {outcome.detail})", Cause.DAEMON_LIMIT)

    def _excused_too_long(self, outcome: ProbeOutcome) -> bool:
        """Track the unbroken run of probes without progress (excused or failed); an excused
        one past its bound makes the engine hung (UNHEALTHY at once: the excuse has lasted
        longer than any failure threshold would). Only an answer or real progress ends the
        run: neither an excuse that changes (paused, busy, paused, ...) nor a failure between
        two excuses starts the clock again."""
        now = self.clock()
        push = self.push
        if outcome.ok and outcome.excuse is None:
            self.excused_since = self.excuse = None
            if push is not None and now >= push.deadline:
                self.push = None  # answering past the push's deadline: it is over for this engine
            return False
        if self.excused_since is None:
            self.excused_since = now
        self.excuse = outcome.excuse
        if not outcome.ok:
            return False  # failures are the threshold's to count
        lasted = now - self.excused_since
        if outcome.excuse == "paused" and push is not None:
            # In an announced push, the push's own deadline is the excuse, whether shorter or
            # longer than sync_timeout: paused past it, the engine is not coming back by itself.
            if now < push.deadline:
                return False
            what = f"past the deadline of push {push.push} ({push.deadline_s:g}s after it was announced)"
        else:
            limit = self.probe.max_paused if outcome.excuse == "paused" else self.probe.max_busy
            if lasted < limit:
                return False
            what = ("without progress" if outcome.excuse == "busy"
                    else f"(longer than sync_timeout, {limit:g}s)")
        why = f"hung: {outcome.excuse} for {lasted:.0f}s {what} (last: {outcome.detail})"
        cause = Cause.PAUSED if outcome.excuse == "paused" else Cause.BUSY
        if self.state is S.UNHEALTHY:  # out already (daemon_limit): the verdict is the engine's now
            self.reason, self.cause = why, cause
        else:
            self._go(S.UNHEALTHY, why, cause)
        return True

    def push_announced(self, window: PushWindow) -> None:
        """It receives an announced push: paused, it is excused until the push's deadline
        (a later push replaces an earlier one: an engine is in one transfer at a time)."""
        self.push = window

    def push_ended(self, push: str) -> None:
        """That push was ended by the trainer: a pause from now on has sync_timeout again.
        A push that expired unended is not ended here: its receivers still paused past its
        deadline are condemned at their next probe."""
        if self.push is not None and self.push.push == push:
            self.push = None

    def report_failure(self, detail: str) -> bool:
        """A request failure seen by the trainer counts like a failed probe."""
        return self.probe_result(ProbeOutcome(False, f"reported: {detail}"), reported=True)

    def recovered(self, weight_version: int | str | None, current_version: int | None,
                  hold: str | None = None, spare: str | None = None, rule: VersionRule = SYNC_RULE) -> Transition:
        """An attached engine answering again after UNHEALTHY/EXITED. Like a new engine, it
        joins routing only in a round gap (`hold` says why it waits) and at a version `rule`
        allows, or becomes a spare."""
        self.consecutive_failures = 0
        self.limit_since = None
        self.weight_version = weight_version
        current = rule.allows(weight_version, current_version)
        if current and spare is not None:
            return self.park(f"recovered; {_weights(current_version, weight_version)}; {spare}")
        if current and hold is None:
            return self._go(S.RUNNING, "recovered: answering probes again", Cause.RECOVERED)
        self.held = hold is not None
        why = hold if current else f"weights {vlabel(weight_version)}, current {vlabel(current_version)}"
        return self._go(S.STALE, f"recovered; {why}", Cause.RECOVERED)

    def stopping(self, reason: str, cause: Cause | None = None) -> Transition:
        """`cause` defaults to the last transition's: a condemned engine's stop keeps why
        it was condemned (hang, poisoned, reported)."""
        return self._go(S.STOPPING, reason, cause or self.cause or Cause.OPERATOR)

    def exited(self, how: str, cause: Cause = Cause.EXIT) -> Transition:
        """The process is gone (it died, or our stop finished).

        After a stop we made, the reason that caused the stop is kept: it is what an operator
        needs to see ("hung: 3 consecutive probe failures ..."), not "exited with -15"; and
        so is its cause.
        """
        if self.state is S.STOPPING:
            return self._go(S.EXITED, f"{self.reason}; stopped ({how})", self.cause or cause)
        return self._go(S.EXITED, f"exited unexpectedly ({how})", cause)

    def stopped(self, reason: str, cause: Cause = Cause.OPERATOR) -> Transition:
        """An operator's stop finished (or the engine was never started)."""
        return self._go(S.STOPPED, reason, cause)

    def sync_started(self, reason: str) -> Transition:
        return self._go(S.SYNCING, reason, Cause.SYNC)

    def sync_finished(self, weight_version: int | str, hold: str | None = None,
                      spare: str | None = None) -> Transition:
        self.weight_version = weight_version
        if spare is not None:  # verified, not needed: a spare kept current
            return self.park(f"weights {vlabel(weight_version)}, verified; {spare}")
        if hold is not None:  # verified, but a round is open: it joins routing in the gap
            self.held = True
            return self._go(S.STALE, f"weights {vlabel(weight_version)}, verified; {hold}", Cause.VERIFIED)
        return self._go(S.RUNNING, f"weights {vlabel(weight_version)}, verified", Cause.VERIFIED)

    def sync_overtaken(self, weight_version: int | str, current_version: int | None, how: str) -> Transition:
        """A sync verified the engine at `weight_version`, but a version published meanwhile
        makes it one `rule` does not allow (or, unverified, not on its label alone): STALE, out
        of routing, to be synced again; it never serves in between."""
        self.weight_version = weight_version
        self.held = False
        return self._go(S.STALE, f"{how}: weights {vlabel(weight_version)}, verified; {vlabel(current_version)} "
                                 "was published meanwhile: synced again", Cause.OUTDATED)

    def relabelled(self, weight_version: int | str | None, current_version: int | None, reason: str,
                   rule: VersionRule = SYNC_RULE) -> Transition | None:
        """Its /weight_info read again (an announced push's end) says it holds `weight_version`
        (as checked): it goes on as it was at a version `rule` allows; serving or a spare at one
        the rule does not allow, it is STALE (out of routing, synced again)."""
        self.weight_version = weight_version
        if rule.allows(weight_version, current_version) or self.state not in ROUTABLE | {S.STANDBY}:
            return None
        return self._go(S.STALE, f"{reason}: weights {vlabel(weight_version)}, current {vlabel(current_version)}",
                        Cause.OUTDATED)

    def mark_unusable(self, reason: str, cause: Cause) -> Transition:
        """Records the decision only: UNHEALTHY now (poisoned: a failed sync, or the
        trainer's report), never routed. Stopping it is the runner's (EngineRunner.condemn)."""
        return self._go(S.UNHEALTHY, reason, cause)

    def fingerprint_mismatch(self, label: str, reason: str) -> Transition | None:
        """/weight_info said the version, the outputs did not match its fingerprint: STALE (out
        of routing) with `label` (never a published version) as its weight version, so that it
        is synced again and not released as current. Already STALE: relabelled only."""
        self.weight_version = label
        if self.state is S.STALE:
            self.annotate(reason)
            return None
        return self._go(S.STALE, reason, Cause.FINGERPRINT)

    def version_behind(self, current_version: int) -> Transition:
        return self._go(S.STALE, f"weights {vlabel(self.weight_version)}, current {vlabel(current_version)}",
                        Cause.OUTDATED)

    def carry(self, state: State, reason: str) -> None:
        """A state the previous daemon image left (a reload), taken as it is: not a transition,
        nothing happened to the engine."""
        self.state, self.reason, self.since = state, reason, self.clock()

    def annotate(self, reason: str) -> None:
        """Refine the reason without a state change (e.g. 'restart after round 412')."""
        self.reason = reason
