"""The emulated fleet's goodput accounting (issue 36): from one run's record, the figures per
policy, and their spread over seeds.

Pure, no engines. The record is what the bench saw, not what the daemon concluded: each
engine's serving intervals as observed from outside (an emulated engine knows when its core
hung), the faults with the times they were injected, the restarts the daemon made and why,
the samples with the weight version they were generated at and the one their round required
(sync mode), or judged piece by piece against the version each piece claims and the staleness
bound (async mode: async_sample).
How each figure is counted is in docs/benchmarks.md ("The emulated fleet's accounting").

- Capacity lost is counted from the injection: a struck engine serves nothing from its
  injection until a serving interval that starts after it, whatever the record says and
  whether or not the daemon ever noticed.
- A restart is backed by an injection that struck its engine at or before it, with no serving
  interval of that engine starting between the two (a crash at start's repeated restarts are
  all backed; a restart of an engine that served again since is not). Any other is false.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

# Clocks of the bench and of the daemon's event log are this host's; 10 ms as harness/goodput.py.
TOLERANCE_S = 0.01


@dataclass(frozen=True)
class Injection:
    at: float
    kind: str
    engines: tuple[str, ...]        # struck; () for the daemon's kill


@dataclass(frozen=True)
class Serving:
    """One interval in which the bench saw `engine` serve (routable and generating)."""
    engine: str
    start: float
    end: float | None = None        # None: still serving at the run's end


@dataclass(frozen=True)
class Restart:
    at: float
    engine: str
    cause: str                      # the daemon's transition cause


@dataclass(frozen=True)
class Sample:
    """One returned sample. Sync rule (max_staleness None): `version` is the weight version its
    tokens were generated at, `expected` the one its round required; stale when they differ.
    Async rule (max_staleness given: the daemon's [weights] max_staleness): `version` is its
    oldest piece's version, each piece's tokens checked (async_sample; -1 when a piece's tokens
    are not what the version it claims makes), `expected` the version current when it was
    returned; stale when a piece lied or the oldest is more than max_staleness behind."""

    version: int
    expected: int
    max_staleness: int | None = None

    @property
    def stale(self) -> bool:
        if self.max_staleness is None:
            return self.version != self.expected
        return self.version < 0 or self.expected - self.version > self.max_staleness


@dataclass(frozen=True)
class Piece:
    """One piece of an async sample as its split claims it (trainer/rollout_types.Split):
    output tokens [offset, offset + tokens) made by weight version `version`, or by one of
    versions version..version_end (a bracket: the engine's two reads around it differed)."""

    offset: int
    tokens: int
    version: Any                    # an int; anything else (base weights, a label) is no version of the run
    version_end: Any = None


# (context, n, version label) -> the n tokens that version's weights make after the context.
Make = Callable[[Sequence[int], int, str], list[int]]


def piece_made_by(prompt: Sequence[int], output: Sequence[int], p: Piece, make: Make) -> int | None:
    """The version (of those `p` claims) whose weights alone make its tokens from the prompt and
    the output before it, token for token; None: none of them (a stale or lying piece)."""
    claimed = [p.version] if p.version_end is None else [p.version, p.version_end]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in claimed):
        return None
    ctx, toks = [*prompt, *output[:p.offset]], list(output[p.offset:p.offset + p.tokens])
    return next((v for v in range(claimed[0], claimed[-1] + 1) if make(ctx, len(toks), str(v)) == toks), None)


def async_sample(prompt: Sequence[int], output: Sequence[int], pieces: Sequence[Piece], make: Make, current: int,
                 max_staleness: int) -> Sample:
    """An async sample judged per token: its pieces must cover the output in order, each made
    by a version it claims (piece_made_by); `current` is the version current when it was
    returned. version -1 when a piece fails (stale whatever was reported)."""
    at, made = 0, []
    for p in pieces:
        v = piece_made_by(prompt, output, p, make) if p.offset == at and p.tokens >= 0 else None
        if v is None:
            return Sample(-1, current, max_staleness)
        made.append(v)
        at += p.tokens
    if at != len(output) or not made:
        return Sample(-1, current, max_staleness)
    return Sample(min(made), current, max_staleness)


@dataclass
class RunRecord:
    policy: str
    seed: int
    target: int                     # engines the run wants serving
    launched_at: float
    end: float                      # the last round's end
    injections: Sequence[Injection]
    serving: Sequence[Serving]
    restarts: Sequence[Restart] = ()
    samples: Sequence[Sample] = ()
    tokens_generated: int = 0
    tokens_discarded: int = 0       # generated but in no used sample (cut, re-sent, thrown away)
    rounds: int = 0
    rounds_lost: int = 0
    spares: int = 0                 # warm spares the policy runs
    spare_ready: Sequence[Serving] = ()  # intervals in which each spare stood ready
    # Where the work (and ETTR's and useful tokens' wall) starts; None: at the launch. A bench
    # whose engines' start-up is not to scale (an emulated fleet's Python start-ups on a shared
    # host) starts it once the fleet first serves and reports the time to start apart.
    work_start: float | None = None
    # Async mode: samples the rollout client did not return as useful (a token past
    # max_staleness when answered): regenerated, their tokens in tokens_discarded.
    stale_regenerated: int = 0

    def __post_init__(self) -> None:
        if self.target < 1:
            raise ValueError(f"target must be at least 1 engine, not {self.target}")
        if not self.end > self.launched_at:
            raise ValueError(f"the run must end after its launch (launched_at {self.launched_at}, end {self.end})")
        if self.work_start is not None and not self.launched_at <= self.work_start < self.end:
            raise ValueError(f"work_start ({self.work_start}) must lie in [launched_at, end) "
                             f"([{self.launched_at}, {self.end}))")
        for s in (*self.serving, *self.spare_ready):
            if s.end is not None and s.end < s.start:
                raise ValueError(f"interval of {s.engine} ends ({s.end}) before it starts ({s.start})")


@dataclass
class Ledger:
    policy: str
    seed: int
    wall_s: float                   # the work's start (the launch unless given) to the last round's end
    ettr: float | None              # None: no fault-free time given
    useful_tps: float
    time_to_start_s: float | None   # launch to the first moment `target` engines served; None: never
    recover_s: tuple[float | None, ...]  # per injection: to the fleet back at target; None: not by the end
    failures: int                   # injections
    on_down: int                    # injections whose every struck engine was already down
    capacity_lost_s: float          # engine-seconds below target, from the start to the end
    tokens_lost: int
    rounds: int
    rounds_lost: int
    stale_samples: int
    false_restarts: int
    spare_exhaustions: int          # injections into a policy with spares that found too few ready
    unanswered: list[str] = field(default_factory=list)   # struck engines no restart answered (kind@engine)
    false: list[str] = field(default_factory=list)        # false restarts (engine@t:cause)
    stale_regenerated: int = 0      # async: samples past max_staleness the client regenerated

    @property
    def mean_recover_s(self) -> float | None:
        done = [r for r in self.recover_s if r is not None]
        return sum(done) / len(done) if done else None

    @property
    def unrecovered(self) -> int:
        return sum(1 for r in self.recover_s if r is None)

    @property
    def tokens_lost_per_fault(self) -> float | None:
        return self.tokens_lost / self.failures if self.failures else None

    @property
    def capacity_lost_per_fault_s(self) -> float | None:
        return self.capacity_lost_s / self.failures if self.failures else None


def _struck(injections: Sequence[Injection]) -> dict[str, list[float]]:
    """Each engine's injection times, sorted."""
    out: dict[str, list[float]] = {}
    for i in injections:
        for e in i.engines:
            out.setdefault(e, []).append(i.at)
    for ts in out.values():
        ts.sort()
    return out


def _first_cut(s: Serving, times: Sequence[float]) -> float | None:
    """The first injection time strictly inside the interval, if any."""
    k = bisect.bisect_right(times, s.start)
    if k < len(times) and (s.end is None or times[k] < s.end):
        return times[k]
    return None


def truncated(serving: Iterable[Serving], injections: Sequence[Injection]) -> list[Serving]:
    """The intervals with each one cut at the first injection that struck its engine inside it."""
    struck = _struck(injections)
    out = []
    for s in serving:
        cut = _first_cut(s, struck.get(s.engine, ()))
        out.append(s if cut is None else Serving(s.engine, s.start, cut))
    return out


def _serving_at(intervals: Sequence[Serving], times: Sequence[float], t: float) -> bool:
    """Whether the engine of `intervals` served up to `t`, no injection before `t` having cut it
    (an interval the bench saw end at `t` itself was serving up to it)."""
    for s in intervals:
        if s.start <= t and (s.end is None or t <= s.end):
            cut = _first_cut(s, times)
            if cut is None or cut >= t:
                return True
    return False


def _steps(intervals: Sequence[Serving], t0: float, t1: float) -> list[tuple[float, int]]:
    """(time, count serving from then on) at each change inside [t0, t1], starting at t0."""
    delta: dict[float, int] = {}
    for s in intervals:
        a, b = max(s.start, t0), min(t1 if s.end is None else s.end, t1)
        if b > a:
            delta[a] = delta.get(a, 0) + 1
            delta[b] = delta.get(b, 0) - 1
    out, n = [(t0, 0)], 0
    for t in sorted(delta):
        n += delta[t]
        if out[-1][0] == t:
            out[-1] = (t, n)
        else:
            out.append((t, n))
    return out


def _count_at(steps: Sequence[tuple[float, int]], times: Sequence[float], t: float) -> int:
    k = bisect.bisect_right(times, t)
    return steps[k - 1][1] if k else 0


def _first_at_target(steps: Sequence[tuple[float, int]], times: Sequence[float], t: float,
                     target: int) -> float | None:
    """The first moment at or after `t` with at least `target` engines serving."""
    if _count_at(steps, times, t) >= target:
        return t
    k = bisect.bisect_right(times, t)
    return next((ts for ts, c in steps[k:] if c >= target), None)


def _below(steps: Sequence[tuple[float, int]], t0: float, t1: float, target: int) -> float:
    """Engine-seconds under `target` in [t0, t1]."""
    lost = 0.0
    for (ta, c), nxt in zip(steps, [*steps[1:], (t1, 0)]):
        a, b = max(ta, t0), min(nxt[0], t1)
        if b > a:
            lost += (b - a) * max(0, target - c)
    return lost


def false_restarts(record: RunRecord) -> tuple[list[Restart], list[str]]:
    """The restarts no injection backs (see the module docstring), and each struck engine that
    no restart answered (kind@engine)."""
    starts: dict[str, list[float]] = {}
    for s in record.serving:
        starts.setdefault(s.engine, []).append(s.start)
    for v in starts.values():
        v.sort()
    by_engine: dict[str, list[tuple[float, int]]] = {}
    for k, i in enumerate(record.injections):
        for e in i.engines:
            by_engine.setdefault(e, []).append((i.at, k))
    answered: set[tuple[int, str]] = set()
    false = []
    for r in sorted(record.restarts, key=lambda r: r.at):
        st = starts.get(r.engine, [])
        # Backed by injections after the engine's last serving start before the restart.
        k = bisect.bisect_left(st, r.at)
        since = st[k - 1] if k else float("-inf")
        backing = [n for at, n in by_engine.get(r.engine, ()) if since <= at and at - TOLERANCE_S <= r.at]
        if not backing:
            false.append(r)
        answered.update((n, r.engine) for n in backing)
    unanswered = [f"{i.kind}@{e}" for k, i in enumerate(record.injections) for e in i.engines
                  if (k, e) not in answered]
    return false, unanswered


def _ready_spares(record: RunRecord, t: float) -> int:
    return sum(1 for s in record.spare_ready if s.start <= t and (s.end is None or t < s.end))


def account(record: RunRecord, fault_free_s: float | None = None) -> Ledger:
    """The run's figures; ETTR against `fault_free_s`, the fault-free run's wall time for the
    same work (launch to the last round's end)."""
    t0, t1 = record.launched_at, record.end
    wall = t1 - (t0 if record.work_start is None else record.work_start)
    injections = sorted(record.injections, key=lambda i: i.at)
    steps = _steps(truncated(record.serving, injections), t0, t1)
    times = [t for t, _ in steps]
    ready = _first_at_target(steps, times, t0, record.target)
    # Down at the injection: cut by an earlier injection, or not serving at all.
    struck = _struck(injections)
    per_engine: dict[str, list[Serving]] = {}
    for s in record.serving:
        per_engine.setdefault(s.engine, []).append(s)
    on_down = sum(1 for i in injections if i.engines and not any(
        _serving_at(per_engine.get(e, []), struck.get(e, []), i.at) for e in i.engines))
    false, unanswered = false_restarts(record)
    exhausted = sum(1 for i in injections if record.spares > 0 and i.engines
                    and _ready_spares(record, i.at) < len(i.engines))
    return Ledger(
        policy=record.policy, seed=record.seed, wall_s=wall,
        ettr=None if fault_free_s is None else fault_free_s / wall,
        useful_tps=(record.tokens_generated - record.tokens_discarded) / wall,
        time_to_start_s=None if ready is None else ready - t0,
        recover_s=tuple(None if (b := _first_at_target(steps, times, i.at, record.target)) is None else b - i.at
                        for i in injections),
        failures=len(injections), on_down=on_down,
        capacity_lost_s=_below(steps, t0 if ready is None else ready, t1, record.target),
        tokens_lost=record.tokens_discarded, rounds=record.rounds, rounds_lost=record.rounds_lost,
        stale_samples=sum(1 for s in record.samples if s.stale), stale_regenerated=record.stale_regenerated,
        false_restarts=len(false), spare_exhaustions=exhausted, unanswered=unanswered,
        false=[f"{r.engine}@{r.at:g}:{r.cause}" for r in false])


@dataclass(frozen=True)
class Spread:
    median: float
    lo: float
    hi: float
    q1: float
    q3: float
    n: int


MIN_SEEDS = 3
FIGURES = ("ettr", "useful_tps", "time_to_start_s", "mean_recover_s", "failures", "capacity_lost_s",
           "tokens_lost_per_fault", "rounds_lost", "stale_samples", "false_restarts", "spare_exhaustions",
           "stale_regenerated")


def spread(values: Sequence[float]) -> Spread:
    if not values:
        raise ValueError("no values to spread")
    xs = sorted(values)
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0], xs[0], xs[0])
    return Spread(statistics.median(xs), xs[0], xs[-1], q1, q3, len(xs))


def over_seeds(ledgers: Sequence[Ledger], min_seeds: int = MIN_SEEDS) -> dict[str, Spread | None]:
    """One policy's figures over its seeds (at least min_seeds, each once; fewer than MIN_SEEDS
    is a smoke run's, not a figure to report); a figure no run has (ETTR without a fault-free
    time, per-fault figures without faults) is None."""
    policies = {g.policy for g in ledgers}
    if len(policies) != 1:
        raise ValueError(f"spread over seeds is per policy; got policies {sorted(policies)}")
    seeds = [g.seed for g in ledgers]
    if len(set(seeds)) != len(seeds) or len(seeds) < max(1, min_seeds):
        raise ValueError(f"need at least {max(1, min_seeds)} distinct seeds, got {seeds}: run more seeds")
    out: dict[str, Spread | None] = {}
    for name in FIGURES:
        vals = [v for g in ledgers if (v := getattr(g, name)) is not None]
        out[name] = spread([float(v) for v in vals]) if vals else None
    return out
