"""Goodput under faults: the figures RL teams compare (ETTR, useful tokens per second, tokens
lost, rounds lost, false restarts, seconds at reduced strength), from what a run records.

Pure accounting, no engines: bench/goodput.py drives real ones and hands its records here as a
`Run`; `account(run, fault_free_s)` gives its `Goodput` row, `table()` prints the rows and
`versus()` divides a row by the fault-free baseline's. How each figure is counted is in
docs/benchmarks.md (Goodput under faults). The event log must begin before the engines came up:
an engine's state is the last transition seen for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

from vime.harness.faults import DETECTED_AS, Fault
from vime.supervisor.protocol import ROUTABLE, Cause, Event, State


class RoundRecord(Protocol):
    """The fields of trainer/rl_loop.py StepRecord this module reads."""

    lost: bool
    tokens_regenerated: int


class StartedOver(Protocol):
    """trainer/continuation.py StartOver: a partial output thrown away."""

    @property
    def tokens(self) -> int: ...


# Causes of a stop that is the daemon's verdict on a failure (not an operator's, not shutdown).
STOP_CAUSES = frozenset({Cause.EXIT, Cause.HANG, Cause.BUSY, Cause.PAUSED, Cause.REPORTED, Cause.POISONED,
                         Cause.SYNC_FAILED, Cause.FINGERPRINT})
_DOWN = frozenset({State.UNHEALTHY, State.STOPPING, State.EXITED})
# A stop is taken from a state with a process that was up (a failed start is no stop).
_UP = frozenset({State.STALE, State.SYNCING, State.RUNNING, State.SUSPECT, State.STANDBY})


@dataclass
class Run:
    name: str                                   # the configuration
    events: Sequence[Mapping[str, Any]]
    faults: Sequence[Fault]
    rounds: Sequence[RoundRecord]
    target: int
    wall_s: float
    useful_tokens: int
    started_over: Sequence[StartedOver] = ()
    discarded_tokens: int = 0


@dataclass
class Goodput:
    name: str
    wall_s: float
    ettr: float | None                          # None: no fault-free time given
    useful_tps: float
    faults: int                                 # injections (injections())
    tokens_lost: int
    rounds: int
    rounds_lost: int
    started_over: int                           # requests started over (partial outputs thrown away)
    false_restarts: int
    reduced_s: float                            # seconds below the target strength
    engines: int
    unmatched: list[str] = field(default_factory=list)  # faults no stop matched (kind@engine)

    @property
    def tokens_lost_per_fault(self) -> float | None:
        return self.tokens_lost / self.faults if self.faults else None

    @property
    def reduced_s_per_fault(self) -> float | None:
        return self.reduced_s / self.faults if self.faults else None


def injections(faults: Sequence[Fault]) -> int:
    """Faults injected, one per injection (see the module docstring: a trainer-dies-mid-push's
    receivers are one)."""
    return len({(f.kind, f.fired_step if f.fired_step is not None else f.injected_at) for f in faults})


def ettr(fault_free_s: float, wall_s: float) -> float:
    """Effective training time ratio: the same work's time without faults over its time with them."""
    if wall_s <= 0:
        raise ValueError(f"wall time must be positive, not {wall_s}")
    return fault_free_s / wall_s


def _transitions(events: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted((ev for ev in events if ev.get("event") == Event.TRANSITION), key=lambda ev: float(ev["ts"]))


def stops(events: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Each engine taken down for a failure: one transition per incarnation (a hang's
    UNHEALTHY, not the STOPPING and EXITED that follow it)."""
    out = []
    down: set[str] = set()
    for ev in _transitions(events):
        name, to = ev.get("engine"), ev.get("to_state")
        if to == State.STARTING:
            down.discard(str(name))
        elif (to in _DOWN and ev.get("from_state") in _UP and ev.get("cause") in STOP_CAUSES
              and name not in down):
            down.add(str(name))
            out.append(ev)
    return out


def false_restarts(events: Sequence[Mapping[str, Any]], faults: Sequence[Fault]) -> tuple[int, list[Fault]]:
    """Stops matching no injected fault, and the faults that matched no stop."""
    open_ = sorted((f for f in faults if f.injected_at is not None and f.kind in DETECTED_AS),
                   key=lambda f: float(f.injected_at or 0.0))
    false = 0
    for ev in stops(events):
        # The daemon's ts and injected_at are both this host's wall clock; 10 ms as timeline() allows.
        hit = next((f for f in open_ if f.engine == ev.get("engine") and DETECTED_AS[f.kind] == ev.get("cause")
                    and float(f.injected_at or 0.0) - 0.01 <= float(ev["ts"])), None)
        if hit is None:
            false += 1
        else:
            open_.remove(hit)
    return false, open_


def window(events: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """From the first round_start to the last round_end (else the first and last event)."""
    starts = [float(ev["ts"]) for ev in events if ev.get("event") == Event.ROUND_START]
    ends = [float(ev["ts"]) for ev in events if ev.get("event") == Event.ROUND_END]
    every = [float(ev["ts"]) for ev in events if "ts" in ev]
    if not every:
        return 0.0, 0.0
    return (min(starts) if starts else min(every)), (max(ends) if ends else max(every))


def reduced_strength(events: Sequence[Mapping[str, Any]], target: int) -> float:
    """Seconds inside `window()` with fewer than `target` engines in a routable state."""
    t0, t1 = window(events)
    state: dict[str, str] = {}
    below, last = 0.0, t0

    def serving() -> int:
        return sum(1 for s in state.values() if s in ROUTABLE)

    for ev in _transitions(events):
        ts = float(ev["ts"])
        if ts > last and last < t1:
            if serving() < target:
                below += min(ts, t1) - last
            last = min(ts, t1)
        name = str(ev.get("engine"))
        if ev.get("cause") == Cause.RESTORED and ev.get("to_state") == State.STARTING and name in state:
            continue  # a restarted daemon re-adopting it: the engine served on (its next transition says)
        state[name] = str(ev.get("to_state"))
    if last < t1 and serving() < target:
        below += t1 - last
    return below


def account(run: Run, fault_free_s: float | None = None) -> Goodput:
    """The run's goodput row; ETTR against `fault_free_s`, the fault-free run's wall time."""
    lost_rounds = [r for r in run.rounds if r.lost]
    tokens_lost = sum(r.tokens_regenerated for r in run.rounds) + run.discarded_tokens
    false, unmatched = false_restarts(run.events, run.faults)
    engines = {str(ev.get("engine")) for ev in _transitions(run.events)}
    return Goodput(
        name=run.name, wall_s=run.wall_s, ettr=None if fault_free_s is None else ettr(fault_free_s, run.wall_s),
        useful_tps=run.useful_tokens / run.wall_s if run.wall_s > 0 else 0.0, faults=injections(run.faults),
        tokens_lost=tokens_lost, rounds=len(run.rounds), rounds_lost=len(lost_rounds),
        started_over=len(run.started_over), false_restarts=false,
        reduced_s=reduced_strength(run.events, run.target), engines=len(engines),
        unmatched=[f"{f.kind}@{f.engine}" for f in unmatched])


def versus(row: Goodput, baseline: Goodput) -> dict[str, float | None]:
    """A configuration against the fault-free baseline, as ratios (row / baseline): useful
    tokens per second and wall time; `ettr` is baseline wall / row wall."""
    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None
    return {"useful_tps": ratio(row.useful_tps, baseline.useful_tps), "wall": ratio(row.wall_s, baseline.wall_s),
            "ettr": ratio(baseline.wall_s, row.wall_s)}


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: Sequence[Goodput], baseline: Goodput | None = None) -> list[str]:
    """One line per configuration; `tok/s vs base` is versus()'s useful_tps ratio."""
    lines = ["goodput under faults, per configuration (same schedule and seeds); ETTR = fault-free time / "
             "time with faults; lost tokens and reduced strength per injected fault",
             f"{'configuration':>22} {'engines':>7} {'faults':>6} {'wall s':>8} {'ETTR':>5} {'useful tok/s':>12} "
             f"{'vs base':>7} {'tok lost/fault':>14} {'rounds lost':>11} {'false restarts':>14} "
             f"{'reduced s/fault':>15}"]
    for r in rows:
        vs = versus(r, baseline)["useful_tps"] if baseline is not None else None
        lines.append(f"{r.name:>22} {r.engines:>7} {r.faults:>6} {r.wall_s:8.1f} {_fmt(r.ettr, '.2f'):>5} "
                     f"{r.useful_tps:12.1f} {_fmt(vs, '.2f'):>7} {_fmt(r.tokens_lost_per_fault, '.1f'):>14} "
                     f"{f'{r.rounds_lost}/{r.rounds}':>11} {r.false_restarts:>14} "
                     f"{_fmt(r.reduced_s_per_fault, '.1f'):>15}")
    for r in rows:
        if r.unmatched:
            lines.append(f"{r.name}: faults no stop matched (wrong cause, or not seen): {', '.join(r.unmatched)}")
    return lines
