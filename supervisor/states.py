"""Engine states: supervisord's process words, plus freshness of weights (STALE, SYNCING) and
warm spares (STANDBY)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class State(StrEnum):
    STOPPED = "STOPPED"  # not started, or stopped on request
    STARTING = "STARTING"  # spawned, inside its first_wait startup budget
    STALE = "STALE"  # up and answering, weights behind the current version
    SYNCING = "SYNCING"  # weights being brought to the current version
    RUNNING = "RUNNING"  # healthy, current weights
    STANDBY = "STANDBY"  # a warm spare: up, probed, verified at its version, never routed
    SUSPECT = "SUSPECT"  # fewer than failure_threshold consecutive probe failures
    UNHEALTHY = "UNHEALTHY"  # threshold reached: being stopped now
    STOPPING = "STOPPING"  # SIGTERM sent to the group, SIGKILL after stop_timeout
    EXITED = "EXITED"  # died or was stopped as unhealthy: restart pending
    BACKOFF = "BACKOFF"  # a start failed; waiting before the next attempt
    FATAL = "FATAL"  # start budget or flapping window exhausted: needs an operator


S = State

# Only these may take traffic (and only at the current weight version).
ROUTABLE = frozenset({S.RUNNING, S.SUSPECT})
# States in which the heartbeat probes the engine.
PROBED = frozenset({S.STALE, S.RUNNING, S.SUSPECT, S.STANDBY})
# supervisorctl exits 0 only if every listed engine is in one of these.
RUNNING_STATES = frozenset({S.RUNNING, S.SUSPECT})
# A process of this incarnation may exist.
PROCESS_STATES = frozenset({S.STARTING, S.STALE, S.SYNCING, S.RUNNING, S.SUSPECT, S.STANDBY, S.UNHEALTHY,
                            S.STOPPING})
# Serving, or on the way to serving (a sync, a promotion): what counts toward the routing
# target when deciding whether a ready engine is needed or becomes a spare.
ACTIVE = frozenset({S.RUNNING, S.SUSPECT, S.STALE, S.SYNCING})

# Every legal edge. Anything else is a bug in the caller, raised as IllegalTransition.
TRANSITIONS: dict[State, frozenset[State]] = {
    S.STOPPED: frozenset({S.STARTING}),
    S.STARTING: frozenset({S.STALE, S.RUNNING, S.STANDBY, S.STOPPING, S.BACKOFF, S.FATAL, S.EXITED}),
    S.STALE: frozenset({S.SYNCING, S.RUNNING, S.STANDBY, S.UNHEALTHY, S.STOPPING, S.EXITED}),
    S.SYNCING: frozenset({S.RUNNING, S.STANDBY, S.STALE, S.UNHEALTHY, S.STOPPING, S.EXITED}),
    S.RUNNING: frozenset({S.SUSPECT, S.UNHEALTHY, S.STALE, S.SYNCING, S.STOPPING, S.EXITED}),
    S.SUSPECT: frozenset({S.RUNNING, S.UNHEALTHY, S.STALE, S.SYNCING, S.STOPPING, S.EXITED}),
    # Promoted in a gap: RUNNING at the current version, else STALE to be synced first.
    S.STANDBY: frozenset({S.RUNNING, S.STALE, S.UNHEALTHY, S.STOPPING, S.EXITED}),
    # An attached engine cannot be stopped by us; it may recover by itself.
    S.UNHEALTHY: frozenset({S.STOPPING, S.EXITED, S.RUNNING, S.STALE, S.STANDBY}),
    S.STOPPING: frozenset({S.EXITED, S.STOPPED, S.BACKOFF, S.FATAL}),
    S.EXITED: frozenset({S.STARTING, S.STOPPED, S.FATAL, S.RUNNING, S.STALE, S.STANDBY}),
    S.BACKOFF: frozenset({S.STARTING, S.STOPPED, S.FATAL}),
    S.FATAL: frozenset({S.STARTING, S.STOPPED}),
}


class Cause(StrEnum):
    """Why a transition happened, for machines (metrics labels, the soak's verdicts); the
    transition's `reason` says the same for people. On the event stream as "cause"."""

    START = "start"  # the daemon's first start of an engine, or its attach
    RESTORED = "restored"  # re-adopted from the journal after a daemon restart
    RESTART = "restart"  # an automatic restart after the engine died or was stopped
    RETRY = "retry"  # the next attempt after a failed start's backoff
    OPERATOR = "operator"  # a start, stop, restart or retire asked for on the control socket
    READY = "ready"  # the first healthy answer (and warm-up) inside first_wait
    RELEASED = "released"  # a held engine joins routing (in a round gap, or verified inside one)
    SPARE = "spare"  # ready, but the fleet is at its routing target: kept warm in STANDBY
    PROMOTED = "promoted"  # a spare takes a failed engine's place (in a round gap, or inside one)
    START_FAILED = "start_failed"  # the process died, the port stayed busy, or the warm-up failed
    SLOW_START = "slow_start"  # not ready within first_wait
    PROBE = "probe"  # probe failures below the failure threshold (SUSPECT)
    RECOVERED = "recovered"  # answering probes again after SUSPECT or UNHEALTHY
    HANG = "hang"  # failure_threshold consecutive probe failures
    # Unobserved: the daemon could not make its probes (out of descriptors) for as long as a
    # hang takes to confirm; out of routing, never stopped for it (the daemon's fault).
    DAEMON_LIMIT = "daemon_limit"
    BUSY = "busy"  # busy (CPU, no progress) for longer than max_busy
    PAUSED = "paused"  # paused (generation held) for longer than sync_timeout
    REPORTED = "reported"  # the trainer's failure reports crossed the threshold
    POISONED = "poisoned"  # the trainer reported a weight push that failed midway
    SYNC = "sync"  # a weight sync began (the trainer agent's push, or a checkpoint reload)
    VERIFIED = "verified"  # a sync finished and the engine's weights were verified
    SYNC_FAILED = "sync_failed"  # a sync failed, timed out or did not verify: poisoned
    # What the engine computes does not match the version's published fingerprint, while its
    # /weight_info says that version (docs/weights.md#fingerprints).
    FINGERPRINT = "fingerprint_mismatch"
    OUTDATED = "outdated"  # a newer weight version was published
    EXIT = "exit"  # the process exited (or an attached engine stopped answering)
    FLAPPING = "flapping"  # too many restarts inside the flapping window
    SHUTDOWN = "shutdown"  # the daemon is stopping its engines on its way out


# The records the engine group hands up (through the event bus) to the fleet: base-level types,
# so that the bus and the fleet need not import the state machine.
@dataclass(frozen=True)
class Transition:
    engine: str
    from_state: State
    to_state: State
    reason: str
    at: float
    incarnation: int
    cause: Cause


# ProbeOutcome.kind of a probe the daemon could not make (out of descriptors: EMFILE, ENFILE):
# neither a success nor a failure of the engine, never counted towards its stop.
DAEMON_LIMIT = "daemon_limit"


@dataclass(frozen=True)
class ProbeOutcome:
    ok: bool
    detail: str  # "ok", "timeout after 5.0s", "health 503", "busy: 12 tokens generated", ...
    latency: float | None = None
    # A late probe that is not a failure, but not proof of progress either: "busy" (CPU
    # advancing, vLLM's counters still) or "paused" (generation held by /pause). Bounded by
    # ProbePolicy.max_busy / max_paused.
    excuse: str | None = None
    # What the heartbeat saw, one of probes.PROBE_KINDS (vime_probes_total{outcome}); None:
    # read as "ok" or "error" by its `ok`.
    kind: str | None = None


# vime_detections_total{kind}: see detection_kind.
DETECTION_KINDS = ("exit", "hang", "poisoned", "reported")


def detection_kind(t: Transition) -> str | None:
    """How an engine was found unusable, for vime_detections_total{kind}, from the transition's
    cause: "exit" (it died), "poisoned" (a weight sync failed midway, or the trainer said so),
    "reported" (the trainer's failure reports crossed the threshold), "hang" (probes: failed,
    or excused as busy or paused for too long). None: not a detection."""
    if t.to_state is State.EXITED:
        return "exit" if t.from_state is not State.STOPPING else None
    if t.to_state is not State.UNHEALTHY or t.cause is Cause.DAEMON_LIMIT:  # the daemon's shortage
        return None
    if t.cause in (Cause.POISONED, Cause.SYNC_FAILED, Cause.FINGERPRINT):
        return "poisoned"
    if t.cause is Cause.REPORTED:
        return "reported"
    return "hang"


# -- which weight versions may take traffic: the one rule ---------------------------------------


class WeightsMode(StrEnum):
    """[weights] mode: "sync" (rounds: only the current version serves) or "async" (round-free
    RL: versions up to `max_staleness` behind the current one keep serving)."""

    SYNC = "sync"
    ASYNC = "async"


@dataclass(frozen=True)
class VersionRule:
    """Routable = serving and verified at a version the mode allows. The daemon's fleet policy,
    its publish, the router feed (through the fleet), the cluster view and the rollout client
    all ask this one rule; none compares versions its own way (tests/unit/test_layout.py).

    Versions are the trainer's published integers, ordered by publication (a publish must
    increase them: FleetPolicy.check_publish). An engine's label that is not one (None: base
    weights, a str: its own label) is never at an allowed version once one is published."""

    mode: WeightsMode = WeightsMode.SYNC
    max_staleness: int = 0  # read in async mode only: versions behind the current one still allowed

    def __post_init__(self) -> None:
        if not isinstance(self.mode, WeightsMode):
            try:
                object.__setattr__(self, "mode", WeightsMode(self.mode))
            except ValueError:
                raise ValueError(f"weights mode must be one of {', '.join(m.value for m in WeightsMode)}, "
                                 f"got {self.mode!r}") from None
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0 (versions behind the current one), "
                             f"got {self.max_staleness!r}")

    @property
    def bound(self) -> int:
        """The most versions behind the current one that may serve: 0 in sync mode."""
        return self.max_staleness if self.mode is WeightsMode.ASYNC else 0

    @staticmethod
    def lag(version: int | str | None, current: int | None) -> int | None:
        """How many versions `version` is behind `current` (0: at it; negative: ahead, pushed
        before its publish); None when they cannot be compared (nothing published, or a label
        that is not a published version)."""
        if current is None or isinstance(version, bool) or not isinstance(version, int):
            return None
        return current - version

    def too_old(self, version: int | str | None, current: int | None) -> bool:
        """Is `version` more versions behind `current` than the mode allows (a sample's token,
        an engine)? A label that is not a published version is, once one is published; a
        version ahead of the current one is not (it is newer, only not yet published)."""
        if current is None:
            return False
        lag = self.lag(version, current)
        return lag is None or lag > self.bound

    def allows(self, version: int | str | None, current: int | None) -> bool:
        """May an engine verified at `version` serve while `current` is the published version?
        Nothing published yet: any version (the engines' base weights). Never a version ahead
        of the current one (not published yet)."""
        if current is None:
            return True
        lag = self.lag(version, current)
        return lag is not None and lag >= 0 and not self.too_old(version, current)

    def as_dict(self) -> dict[str, str | int]:
        """As the daemon's answers carry it (status, routable): the bound in force (0 in sync
        mode, whatever max_staleness was set to)."""
        return {"mode": self.mode.value, "max_staleness": self.bound}

    @classmethod
    def from_answer(cls, answer: object) -> "VersionRule":
        """The rule a daemon's answer carries (its "weights" object); the sync rule when it
        carries none (a daemon before modes) or one that does not parse."""
        if isinstance(answer, Mapping):
            w = answer.get("weights")
            if isinstance(w, Mapping):
                try:
                    return cls(WeightsMode(str(w.get("mode"))), w.get("max_staleness", 0))
                except ValueError:
                    pass
        return SYNC_RULE

    @staticmethod
    def strictest(rules: "list[VersionRule]") -> "VersionRule":
        """The rule several daemons' rules all agree to (a cluster whose nodes differ): sync if
        any is, else the smallest bound; sync for none."""
        if not rules or any(r.mode is WeightsMode.SYNC for r in rules):
            return SYNC_RULE
        return VersionRule(WeightsMode.ASYNC, min(r.max_staleness for r in rules))


SYNC_RULE = VersionRule()
