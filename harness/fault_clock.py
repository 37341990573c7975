"""Faults on a clock: a seeded Poisson schedule of faults for an emulated fleet (issue 36).

Each engine fails at a fixed rate of its own (one fault per `mtbf_s` of engine time), so the
fleet's faults arrive as one Poisson process of rate engines / mtbf_s; each arrival draws its
kind by weight and, for an engine kind, its engine uniformly. There is no whole-fleet gate:
faults may overlap and may strike an engine that is already down (the ledger marks those).
Pure: the schedule is a function of (seed, engines, duration, mtbf, kinds and weights, node
size) only, never of the policy under test, so every policy meets the same draw. Durations are
in engine time (GPU seconds); `scale` stretches every one of them alike into the run's wall
time without changing the draw.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Mapping

# The two rates fixed before any run (issue 36): the headline, one fault per engine per 24 h of
# engine time; the stress rate, one per engine-hour.
HEADLINE_MTBF_S = 24 * 3600.0
STRESS_MTBF_S = 3600.0

# The kinds, named as harness/faults.py names the same faults on real engines, plus "node".
KIND_WHAT = {
    "kill": "kill -9 of an engine",
    "hang": "an engine core that hangs while /health answers 200",
    "push": "a weight push that fails midway (the engine half-loaded: poisoned)",
    "crash-start": "an engine killed whose next start crashes",
    "daemon": "kill -9 of the daemon (no engine struck)",
    "node": "every engine of one node at once",
}
DEFAULT_WEIGHTS: Mapping[str, float] = {"kill": 4.0, "hang": 2.0, "push": 1.0, "crash-start": 1.0,
                                        "daemon": 0.5, "node": 0.5}
NODE_SIZE = 8  # engines per node: eight GPUs a node, one engine a GPU


@dataclass(frozen=True)
class ScheduledFault:
    at_s: float                 # engine time from the run's start (unscaled)
    kind: str
    engines: tuple[int, ...]    # the engines struck, by index; () for the daemon's kill
    seq: int                    # its place in the schedule

    def wall_s(self, scale: float) -> float:
        """When to inject it in a run whose durations are scaled by `scale`."""
        return self.at_s * scale


@dataclass(frozen=True)
class FaultClock:
    seed: int
    engines: int
    duration_s: float                               # engine time the schedule covers
    mtbf_s: float = HEADLINE_MTBF_S                 # per engine
    weights: Mapping[str, float] | None = None      # None: DEFAULT_WEIGHTS
    node_size: int = NODE_SIZE
    scale: float = 1.0                              # wall seconds per engine second

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError(f"engines must be at least 1, not {self.engines}")
        if not self.duration_s >= 0:
            raise ValueError(f"duration_s must be >= 0, not {self.duration_s}")
        if not self.mtbf_s > 0:
            raise ValueError(f"mtbf_s must be > 0 (seconds of engine time per fault), not {self.mtbf_s}")
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0, not {self.scale}")
        if self.node_size < 1:
            raise ValueError(f"node_size must be at least 1, not {self.node_size}")
        w = self.kind_weights
        unknown = sorted(set(w) - set(KIND_WHAT))
        if unknown:
            raise ValueError(f"unknown fault kinds {unknown}; known: {sorted(KIND_WHAT)}")
        if any(not v >= 0 for v in w.values()) or not sum(w.values()) > 0:
            raise ValueError(f"kind weights must be >= 0 with a positive sum, not {dict(w)}")

    @property
    def kind_weights(self) -> Mapping[str, float]:
        return DEFAULT_WEIGHTS if self.weights is None else self.weights

    @property
    def rate_per_s(self) -> float:
        """The fleet's fault rate, per second of engine time."""
        return self.engines / self.mtbf_s

    def schedule(self) -> list[ScheduledFault]:
        """The faults in time order. The same arguments give the same list."""
        rng = random.Random(f"vime-fault-clock/{self.seed}")  # str seeds hash stably (sha512)
        kinds = sorted(k for k, v in self.kind_weights.items() if v > 0)  # order fixed, not the dict's
        weights = [self.kind_weights[k] for k in kinds]
        out: list[ScheduledFault] = []
        t = 0.0
        while True:
            t += rng.expovariate(self.rate_per_s)
            if t >= self.duration_s:
                return out
            kind = rng.choices(kinds, weights)[0]
            if kind == "daemon":
                struck: tuple[int, ...] = ()
            elif kind == "node":
                first = rng.randrange(0, self.engines, self.node_size)
                struck = tuple(range(first, min(first + self.node_size, self.engines)))
            else:
                struck = (rng.randrange(self.engines),)
            out.append(ScheduledFault(at_s=t, kind=kind, engines=struck, seq=len(out)))
