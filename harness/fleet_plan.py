"""The emulated fleet's goodput run, its pure part (issue 36): the RL-shaped workload, the
policies, the daemon's timings scaled with the engines', the work each round does, the rule that
marks a run invalid, and the ledger's record made from what was observed. harness/fleet_run.py
does the I/O (the daemon, the emulated engines, the rollout client, the faults).

Durations here are engine time (GPU seconds) unless named wall; a run's time scale turns them
into wall seconds, as the emulated engines' --time-scale does for theirs.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

from .goodput_ledger import Restart, Serving

# The daemon's timings in engine seconds (its defaults, supervisor/settings.py), scaled with the
# engines' into the run's config: [table] key -> seconds.
DAEMON_TIMINGS: dict[tuple[str, str], float] = {
    ("health_check", "interval"): 10.0,
    ("health_check", "timeout"): 5.0,
    ("health_check", "first_wait"): 300.0,
    ("health_check", "max_busy"): 120.0,
    ("restart", "backoff_initial"): 1.0,
    ("restart", "backoff_max"): 60.0,
    ("restart", "flapping_window"): 600.0,
    ("supervisor", "stop_timeout"): 10.0,
    ("supervisor", "sync_timeout"): 300.0,
}
# Scaled below these (wall seconds), a probe's own round trip on a loaded 2-core host would be
# judged, not the engine: the floors the run keeps (and writes into its JSON).
WALL_FLOORS: dict[tuple[str, str], float] = {
    ("health_check", "interval"): 0.5,
    ("health_check", "timeout"): 0.5,
    ("supervisor", "stop_timeout"): 1.0,
    # An engine's Python start-up is not scaled (several seconds on a loaded host): a scaled
    # startup budget would judge it. No fault of the clock is a boot that never ends.
    ("health_check", "first_wait"): 60.0,
}
# A run is invalid (not reported) when the daemon's loop lag or the emulated engines' scheduling
# delay, at their 99th percentile, exceeds this share of the smallest scaled interval.
INVALID_SHARE = 0.1
LAG_QUANTILE = 0.99
WEIGHTS_MODES = ("sync", "async")
# The policies with an async row (policies(): <name>-async).
ASYNC_OF = ("fault-free", "defaults", "everything-on")


@dataclass(frozen=True)
class Workload:
    """One run's work: `rounds` RL steps on `engines` serving engines. Each round sends
    `samples_per_engine` x engines requests: one long-tail sample of `tail_tokens`, the others
    drawn around `median_tokens`; then `train_s` of training; then a push and a publish."""

    engines: int = 64
    rounds: int = 12
    samples_per_engine: int = 2
    median_tokens: int = 24
    tail_tokens: int = 256
    prompt_tokens: int = 8
    seqs_per_request: int = 128      # each request weighs this many GPU sequences (the engines' batch)
    train_s: float = 30.0            # engine seconds of training per step
    scale: float = 0.05              # wall seconds per engine second
    poll_s: float = 0.25             # wall seconds between observations of the fleet
    boot_s: float = 80.0             # the emulated engines' (their timing model's defaults)
    first_batch_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("engines", "rounds", "samples_per_engine", "median_tokens", "tail_tokens", "prompt_tokens",
                     "seqs_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.tail_tokens < self.median_tokens:
            raise ValueError(f"tail_tokens ({self.tail_tokens}) must be at least median_tokens ({self.median_tokens})")
        for name in ("train_s", "scale", "poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, not {getattr(self, name)}")

    def wall(self, engine_s: float) -> float:
        return engine_s * self.scale

    @property
    def restart_s(self) -> float:
        """Engine seconds from a restart to serving again: the boot and the first batch's compile."""
        return self.boot_s + self.first_batch_s


@dataclass(frozen=True)
class Policy:
    name: str
    faults: bool = True                 # fault-free: the same work with no fault injected
    restart_immediately: bool = False
    admit_mid_round: bool = False
    spares: int = 0
    spares_sync: str = "promotion"
    continue_partial: bool = True       # the rollout client's continuation of a cut request
    # The daemon's [weights] mode. "async": generation and training overlap, each version goes
    # into the engines by an in-flight update (trainer/inflight.py, abort + continue, in waves
    # keeping serving_fraction of them serving) while requests stream; a sample's tokens may be
    # up to max_staleness versions behind the current one (the ledger's async rule).
    weights_mode: str = "sync"
    max_staleness: int = 1              # async only: the daemon's [weights] max_staleness
    serving_fraction: float = 0.5       # async only: the share of engines serving during an update

    def __post_init__(self) -> None:
        if self.weights_mode not in WEIGHTS_MODES:
            raise ValueError(f"weights_mode {self.weights_mode!r}: the bench runs {' or '.join(WEIGHTS_MODES)}")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"max_staleness must be a whole number of versions >= 0, not {self.max_staleness!r}")
        if not 0 <= self.serving_fraction < 1:
            raise ValueError(f"serving_fraction must be in [0, 1) (the share of engines serving during an "
                             f"update), not {self.serving_fraction!r}")

    @property
    def is_async(self) -> bool:
        return self.weights_mode == "async"

    def settings(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "name"}


def spares_for(engines: int, mtbf_s: float, restart_s: float) -> int:
    """Warm spares for a fleet: the engines down at once on average (a fault every mtbf_s per
    engine, each down restart_s) plus two standard deviations of that Poisson count; at least 1."""
    down = engines * restart_s / mtbf_s
    return max(1, math.ceil(down + 2 * math.sqrt(down)))


def policies(spares: int, weights: str = "sync") -> dict[str, Policy]:
    """The policies of a weights mode: "sync", "async" (ASYNC_OF's, each named <name>-async)
    or "both" (the sync ones, then the async ones)."""
    if weights not in ("sync", "async", "both"):
        raise ValueError(f"weights must be sync, async or both, not {weights!r}")
    sync = {
        "fault-free": Policy("fault-free", faults=False),
        # slime: a dead engine waits for the round's end, a cut request is sent again whole, no spare
        "slime": Policy("slime", continue_partial=False),
        "defaults": Policy("defaults"),
        "everything-on": Policy("everything-on", restart_immediately=True, admit_mid_round=True, spares=spares,
                                spares_sync="publish"),
    }
    # slime has no async row: it tracks no weight versions (its issue #1800), so no staleness
    # bound or exact spans can be asked of it; its async mode would be another policy.
    asy = {f"{n}-async": replace(sync[n], name=f"{n}-async", weights_mode="async") for n in ASYNC_OF}
    return {**(sync if weights != "async" else {}), **(asy if weights != "sync" else {})}


def baseline_of(policy: Policy) -> str:
    """The fault-free policy of `policy`'s weights mode (its ETTR's baseline)."""
    return "fault-free-async" if policy.is_async else "fault-free"


# -- the work ---------------------------------------------------------------------------------------


def round_lengths(seed: int, rnd: int, w: Workload) -> list[int]:
    """Output tokens of each request of round `rnd` (the same for every policy of a seed): one at
    tail_tokens, the others log-normal around median_tokens, capped at half the tail."""
    rng = random.Random(f"vime-fleet-work/{seed}/{rnd}")
    n = w.engines * w.samples_per_engine
    out = [w.tail_tokens]
    cap = max(1, w.tail_tokens // 2)
    while len(out) < n:
        out.append(max(1, min(cap, round(w.median_tokens * math.exp(rng.gauss(0.0, 0.6))))))
    rng.shuffle(out)
    return out


def prompt_ids(seed: int, rnd: int, i: int, w: Workload, choices: Sequence[int]) -> list[int]:
    rng = random.Random(f"vime-fleet-prompt/{seed}/{rnd}/{i}")
    return [rng.choice(choices) for _ in range(w.prompt_tokens)]


def round_s(w: Workload, step_base_s: float, step_per_seq_s: float) -> float:
    """Engine seconds of a fault-free round: the tail request's tokens, each a decode step of the
    fleet's batch (its requests spread evenly, each weighing seqs_per_request sequences)."""
    running = w.samples_per_engine * w.seqs_per_request
    return w.tail_tokens * (step_base_s + step_per_seq_s * running)


# -- the daemon's config ------------------------------------------------------------------------------


def daemon_tables(w: Workload, policy: Policy, *, overrides: Mapping[tuple[str, str], float] | None = None
                  ) -> dict[str, dict[str, Any]]:
    """The daemon's config tables for this run: its timings scaled (with WALL_FLOORS), the
    policy's switches. `overrides` (wall seconds) replace a scaled timing (a mutation's)."""
    weights: dict[str, Any] = {"mode": policy.weights_mode}
    if policy.is_async:
        weights["max_staleness"] = policy.max_staleness
    tables: dict[str, dict[str, Any]] = {"supervisor": {}, "health_check": {}, "restart": {}, "weights": weights}
    for key, engine_s in DAEMON_TIMINGS.items():
        tables[key[0]][key[1]] = round(max(w.wall(engine_s), WALL_FLOORS.get(key, 0.0)), 4)
    for key, wall in (overrides or {}).items():
        tables.setdefault(key[0], {})[key[1]] = wall
    tables["restart"]["start_retries"] = 5
    tables["restart"]["flapping_max_restarts"] = 1000  # a fault storm is measured, not ended by FATAL
    tables["supervisor"].update(min_healthy=0, restart_immediately=policy.restart_immediately,
                                admit_mid_round=policy.admit_mid_round, spares=policy.spares,
                                spares_sync=policy.spares_sync)
    return tables


def intervals_of(w: Workload, tables: Mapping[str, Mapping[str, Any]], step_base_s: float,
                 step_per_seq_s: float) -> dict[str, float]:
    """The run's scaled intervals (wall seconds) whose timing the figures rest on."""
    return {
        "health_check.interval": float(tables["health_check"]["interval"]),
        "health_check.timeout": float(tables["health_check"]["timeout"]),
        "boot": w.wall(w.boot_s),
        "first_batch": w.wall(w.first_batch_s),
        "train": w.wall(w.train_s),
        "round": w.wall(round_s(w, step_base_s, step_per_seq_s)),
    }


def invalid(intervals: Mapping[str, float], lag_s: float, delay_s: float, share: float = INVALID_SHARE
            ) -> str | None:
    """Why the run is invalid, or None: the daemon's loop lag or the engines' scheduling delay
    (each its LAG_QUANTILE) above `share` of the smallest scaled interval."""
    name, smallest = min(intervals.items(), key=lambda kv: kv[1])
    bound = share * smallest
    why = [f"{what} p{LAG_QUANTILE * 100:g} {v * 1000:.0f} ms" for what, v in
           (("the daemon's loop lag", lag_s), ("the emulated engines' scheduling delay", delay_s)) if v > bound]
    if not why:
        return None
    return (f"{' and '.join(why)} above {share:g} x the smallest scaled interval ({name}, {smallest:g} s): "
            f"the host could not keep the time scale; run on an idler host or with a larger --time-scale")


# -- the record -------------------------------------------------------------------------------------


@dataclass
class Observed:
    """What the run saw of one engine over time: (wall time, serving, ready as a spare)."""

    points: list[tuple[float, bool, bool]] = field(default_factory=list)


def serving_intervals(observed: Mapping[str, Observed], spare: bool = False) -> list[Serving]:
    """Each engine's intervals in which it was seen serving (or, with `spare`, standing ready
    as a spare): from the first observation in the state to the first one out of it; one still
    open at the last observation has no end."""
    out = []
    k = 2 if spare else 1
    for engine, obs in observed.items():
        start: float | None = None
        for p in obs.points:
            on = bool(p[k])
            if on and start is None:
                start = p[0]
            elif not on and start is not None:
                out.append(Serving(engine, start, p[0]))
                start = None
        if start is not None:
            out.append(Serving(engine, start, None))
    return out


RESTART_CAUSES = ("restart", "retry")
DOWN_STATES = ("EXITED", "BACKOFF", "UNHEALTHY", "STOPPING", "STOPPED", "FATAL")


def restarts_from(events: Iterable[Mapping[str, Any]], at_of: Any) -> list[Restart]:
    """The daemon's restarts from its log's transitions: each STARTING by a restart or a retry,
    with the cause of the engine's fall before it (hang, busy, exit, poisoned, ...) and the
    daemon's reason in brackets.
    `at_of(event)` gives an event's wall time."""
    fell: dict[str, str] = {}
    out = []
    for ev in events:
        if ev.get("event") != "engine.transition":
            continue
        engine, to, cause = ev.get("engine"), ev.get("to_state"), str(ev.get("cause", ""))
        if to in DOWN_STATES and cause not in RESTART_CAUSES and engine not in fell:
            reason = str(ev.get("reason") or "")[:120]
            fell[str(engine)] = f"{cause} ({reason})" if reason else cause
        elif to == "STARTING" and cause in RESTART_CAUSES:
            out.append(Restart(at=at_of(ev), engine=str(engine), cause=fell.pop(str(engine), cause)))
        elif to in ("RUNNING", "STANDBY"):
            fell.pop(str(engine), None)
    return out


# -- the daemon's loop lag -----------------------------------------------------------------------------

LAG_BUCKETS_RE = re.compile(r'^vime_event_loop_lag_seconds_bucket\{le="([^"]+)"\} ([0-9.e+-]+)$', re.M)


def lag_histogram(metrics: str) -> dict[float, float]:
    """The daemon's loop-lag histogram from its /metrics text: upper bound -> cumulative count."""
    return {float(le): float(n) for le, n in LAG_BUCKETS_RE.findall(metrics)}


def histogram_quantile(cum: Mapping[float, float], q: float) -> float:
    """The upper bound of the bucket holding quantile q of a cumulative histogram; 0.0 when empty."""
    total = cum.get(float("inf"), 0.0)
    if total <= 0:
        return 0.0
    for le in sorted(cum):
        if cum[le] >= q * total:
            return le
    return float("inf")


def per_bucket(cum: Mapping[float, float]) -> dict[str, float]:
    """A cumulative histogram as counts per bucket (upper bound -> count in it alone), the
    empty buckets left out: what a run's JSON keeps of the loop lag."""
    out, below = {}, 0.0
    for le in sorted(cum):
        if cum[le] - below > 0:
            out[f"{le:g}"] = cum[le] - below
        below = max(below, cum[le])
    return out
