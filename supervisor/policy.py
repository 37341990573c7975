"""The fleet's decisions, pure: no I/O, no engines, an injected clock (docs/concepts.md).

Rounds, the published weight version, whether a dead engine may restart now, why a ready
engine is held out of routing, who is routable, the membership epoch (it moves whenever the
routable set changes), the min_healthy floor and the spares. `Fleet` (fleet.py) carries the
decisions out: it logs, emits events and calls the engines' runners.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

from .errors import Conflict
from .states import SYNC_RULE, VersionRule, WeightsMode

Clock = Callable[[], float]

# The membership epoch's ceiling, the journal's accepted range: every consumer keeps it as an
# int64, and the wall-clock floor (milliseconds, ~1.8e12 now) is far below it for millions of
# years. The epoch saturates here rather than write a value the next daemon would refuse.
EPOCH_MAX = 2**62


def starting_epoch(journaled: int | None, wall_ms: int) -> int:
    """The first epoch of a daemon started (or reloaded) at wall-clock `wall_ms` (milliseconds
    since 1970) from a journal whose last epoch is `journaled` (None: none, or a bad one dropped).

    Past both the journaled epoch (its routable set starts empty: a change) and the wall clock:
    a daemon starts at its start time in ms and counts one per membership change, so to reach
    the next start's floor its fleet would need more than one change per millisecond on average
    between the two starts. The floor is what holds when the journal is missing, bad, from an
    older daemon without an epoch, or stale because a write failed. If the wall clock steps
    back, the journaled + 1 term still holds as long as the journal was written; only a failed
    write while the clock is behind can lose epochs (journal.write_failed says so)."""
    after = 0 if journaled is None else journaled + 1
    return min(EPOCH_MAX, max(after, wall_ms, 0))


@dataclass(frozen=True)
class Membership:
    """What one recomputation of the routable set changed."""

    routable: frozenset[str]
    joined: frozenset[str]  # routable now, not before
    changed: bool  # the set changed: the epoch moved
    breached: bool = False  # fell below min_healthy just now
    restored: bool = False  # back at min_healthy just now


class FleetPolicy:
    def __init__(self, *, min_healthy: int = 1, use_fault_tolerance: bool = True,
                 restart_immediately: bool = False, clock: Clock = time.monotonic,
                 target: int | None = None, admit_mid_round: bool = False, strength: int | None = None,
                 rule: VersionRule = SYNC_RULE):
        self.min_healthy = min_healthy
        # Which versions may serve: the current one (sync), or up to max_staleness behind (async).
        self.rule = rule
        # The routing target with warm spares (engines - spares): an engine that is ready
        # once this many are active is kept in STANDBY. None: no spares, every engine serves.
        self.target = target
        self.active = 0  # engines serving or on their way to it (states.ACTIVE): the fleet keeps it
        self.serving = 0  # engines RUNNING or SUSPECT: the fleet keeps it
        self.use_fault_tolerance = use_fault_tolerance
        self.restart_immediately = restart_immediately
        # Membership may grow inside a round: only engines at the current version (the round's
        # rollouts stay at one version), and only those verified (is_routable).
        self.admit_mid_round = admit_mid_round
        self.clock = clock
        self.round: int | None = None  # last round started
        self.round_open = False
        self.round_since: float | None = None  # when the last round started or ended
        self.current_version: int | None = None
        self.checkpoint: str | None = None
        self.epoch = 0
        self.routable: frozenset[str] = frozenset()
        self.below_floor = False
        self.below_floor_since: float | None = None
        self.floor_breaches = 0
        self._floor_armed = False  # the floor counts once the fleet first reached it
        # Full strength: the routable engines the fleet is configured to serve with (engines
        # less spares). The time below it, once first reached, is goodput lost to faults.
        self.strength = strength
        self.short_since: float | None = None
        self.short_seconds = 0.0  # closed stretches below strength
        self._strength_armed = False

    def restore(self, *, round_number: int | None, round_open: bool, version: int | None,
                checkpoint: str | None) -> None:
        """What a previous daemon's journal says (journal.validate has checked it)."""
        self.round, self.round_open = round_number, bool(round_open)
        self.current_version, self.checkpoint = version, checkpoint

    def resume_epoch(self, journaled: int | None, wall_ms: int) -> None:
        """The daemon's first epoch (starting_epoch): past the previous daemon's last one and
        the wall clock at start, never below what this policy already counted."""
        self.epoch = max(self.epoch, starting_epoch(journaled, wall_ms))

    # -- rounds ----------------------------------------------------------------------------

    def start_round(self, n: int) -> tuple[bool, str]:
        """(changed, message); Conflict for a round out of order."""
        if self.round_open:
            if n == self.round:
                return False, f"round {n} is already open"
            raise Conflict(f"round {self.round} is still open: end it (POST /v1/rounds/{self.round}/end) "
                           f"before starting round {n}")
        if self.round is not None and n <= self.round:
            raise Conflict(f"round {n} is stale: round {self.round} already ran; start a round greater than {self.round}")
        self.round, self.round_open, self.round_since = n, True, self.clock()
        return True, f"round {n} open"

    def end_round(self, n: int) -> tuple[bool, str]:
        if not self.round_open:
            if n == self.round:
                return False, f"round {n} already ended"
            expected = "no round has started" if self.round is None else f"the last round was {self.round}"
            raise Conflict(f"round {n} is not open ({expected}); start it first")
        if n != self.round:
            raise Conflict(f"round {self.round} is open, not round {n}: end round {self.round}")
        self.round_open, self.round_since = False, self.clock()
        return True, f"round {n} ended; restarts and syncs may run until the next round starts"

    @property
    def gated(self) -> bool:
        """Membership waits for the round's end: a round is open, in sync mode. In async mode
        nothing waits for a gap (there is none to wait for; each sample carries the versions
        that made it): a restart, a promotion and a sync happen at once, and an engine joins
        routing as soon as it is verified at a version the rule allows, whether or not the
        trainer still opens rounds."""
        return self.round_open and self.rule.mode is WeightsMode.SYNC

    def hold_reason(self) -> str | None:
        """An engine that becomes ready during a round waits for the gap to join routing,
        unless engines may be admitted mid-round (it joins if it is at the current version)."""
        if self.gated and not self.admit_mid_round:
            return f"held out of routing until round {self.round} ends"
        return None

    def spare_reason(self) -> str | None:
        """Why an engine ready to serve (current weights, verified) becomes a spare (STANDBY)
        instead: the serving engines already make the routing target. Whichever is ready
        first serves, so the fleet fills its places as early as it can (after a publish with
        spares kept current, the slowest sync ends as the spare)."""
        if self.target is not None and self.serving >= self.target:
            return f"a spare: {self.serving}/{self.target} engines serving"
        return None

    def park_reason(self, *, counted: bool = True) -> str | None:
        """Why a ready engine behind the current version is parked as a spare instead of being
        synced: the other active engines (serving, or being synced to serve) already make
        the target. `counted`: the engine asking is itself counted active (STALE; not a spare
        being kept current)."""
        others = self.active - counted
        if self.target is not None and others >= self.target:
            return f"a spare: {others}/{self.target} engines active"
        return None

    def spares_wanted(self, *, current_spares: int = 0, behind: int = 0) -> int:
        """How many spares to promote now: in a round gap (membership changes there; in async
        mode at any time, `gated`), or inside a round with admit_mid_round, where only spares
        at the current version may serve (one behind would need a sync, which waits for the
        gap). The places of engines that failed; and, in a gap, while spares at the current
        version are left, one for each active engine that booted `behind` it (a restart during
        the round): a current spare serves at once, where the engine behind would need a sync
        first (it is parked, or synced as a spare, instead). Engines a publish left behind are
        not counted: spares kept current are synced with them."""
        if self.target is None:
            return 0
        short = max(0, self.target - self.active)
        if self.gated:
            return min(short, current_spares) if self.admit_mid_round else 0
        return max(short, min(short + behind, current_spares))

    def may_restart(self, *, spare: bool = False) -> tuple[bool, str | None]:
        """A dead engine restarts in a round gap (in async mode at once: `gated`); during round
        N it waits for its end. A spare lost in STANDBY restarts at once: it served nothing, so its restart leaves the round's
        membership alone, and waiting would leave the fleet without a spare for a whole round
        (were it needed before the gap, it joins in the gap like any restart: `hold_reason`)."""
        if not self.use_fault_tolerance:
            return False, "fault tolerance off: not restarted"
        if self.gated and not self.restart_immediately and not spare:
            return False, f"restart after round {self.round}"
        return True, None

    # -- weights ---------------------------------------------------------------------------

    def check_publish(self, version: int, checkpoint: str | None) -> str | None:
        """None if `version` (with `checkpoint`) may become current; the message if it already
        is (nothing to do); Conflict if it is stale or names another checkpoint."""
        cur = self.current_version
        if cur is not None and version < cur:
            raise Conflict(f"weight version {version} is stale: the current version is {cur}; versions must increase")
        if version == cur:
            if checkpoint is None or checkpoint == self.checkpoint:
                return f"version {version} is already current"
            raise Conflict(f"version {version} was already published with checkpoint {self.checkpoint}; "
                           "publish a new version for a new checkpoint")
        return None

    def publish(self, version: int, checkpoint: str | None) -> None:
        self.current_version, self.checkpoint = version, checkpoint

    # -- routing ---------------------------------------------------------------------------

    def allows(self, weight_version: int | str | None) -> bool:
        """The mode allows an engine verified at `weight_version` to serve now (states.VersionRule)."""
        return self.rule.allows(weight_version, self.current_version)

    def lag(self, weight_version: int | str | None) -> int | None:
        """Versions `weight_version` is behind the current one (None: not comparable)."""
        return self.rule.lag(weight_version, self.current_version)

    def is_routable(self, *, serving: bool, retired: bool, weight_version: int | str | None) -> bool:
        """`serving`: the engine's state takes traffic (RUNNING or SUSPECT)."""
        return serving and not retired and self.allows(weight_version)

    def set_routable(self, names: Iterable[str]) -> Membership:
        """The routable set now; the epoch moves if it changed, the floor is checked."""
        now = frozenset(names)
        joined = now - self.routable
        changed = now != self.routable
        if changed:
            self.routable = now
            self.epoch = min(self.epoch + 1, EPOCH_MAX)  # saturates: a journal past it is refused
        breached = restored = False
        if len(now) >= self.min_healthy:
            self._floor_armed = True
            if self.below_floor:
                self.below_floor, self.below_floor_since, restored = False, None, True
        elif self._floor_armed and not self.below_floor:
            self.below_floor, self.below_floor_since, breached = True, self.clock(), True
            self.floor_breaches += 1
        self._track_strength(len(now))
        return Membership(now, joined, changed, breached, restored)

    def _track_strength(self, serving: int) -> None:
        if self.strength is None:
            return
        if serving >= self.strength:
            self._strength_armed = True
            if self.short_since is not None:
                self.short_seconds += self.clock() - self.short_since
                self.short_since = None
        elif self._strength_armed and self.short_since is None:
            self.short_since = self.clock()

    def seconds_below_strength(self) -> float:
        """Seconds the routable engines were fewer than `strength`, the open stretch included."""
        open_s = 0.0 if self.short_since is None else self.clock() - self.short_since
        return self.short_seconds + open_s
