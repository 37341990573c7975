"""Where each policy falls below ETTR 0.95: bench/goodput.py over fault rates and fleet sizes
(issue 36's sweep).

    python bench/goodput_sweep.py                                   # 8 and 64 engines x headline, stress, 900 s
    python bench/goodput_sweep.py --engines 8,64,256 --mtbf headline,stress,900 --dir sweep
    python bench/goodput_sweep.py --dir sweep --report-only         # the table from the cells already run

Each cell (a fleet size and a per-engine MTBF) is one `bench/goodput.py --engines N --mtbf M
--seeds S --out DIR/cell-N-M.json` run in a child process, its output in DIR/cell-N-M.log: every
policy on the same faults, ETTR against the seed's fault-free run, invalid runs left out
(bench/goodput.py's rules). A cell whose JSON is already in DIR with the same workload, rate and
seeds, and every policy --only names among those it ran (more is fine: the table shows the wanted
ones), is read, not run again, so an interrupted sweep resumes and a run made by hand can be put in
its place. A cell that must run while another JSON is in its place (other policies, another
workload, a corrupt file) first moves that JSON and its log aside, to cell-N-M.replaced-<n>.json
and .log, and says so: nothing a sweep wrote is written over. --report-only runs and writes
nothing (sweep.json stays the last run's); a cell lacking a wanted policy shows the ones it ran
and says which it did not ("ran fault-free, slime; not defaults").

A cell whose fault clock strikes nothing inside any seed's work (a small fleet at the headline
rate: 8 engines meet a fault per 3 engine-hours, a run's work is minutes) is not run: with no
fault every policy does the fault-free run's work, and the table says "no fault" rather than an
ETTR of 1 measured on noise.

The table: per fleet size, a row per policy and a column per MTBF, each cell the median ETTR
over the valid seeds [min-max] and the count of them; then, per policy and size, the lowest
fault rate swept at which the median ETTR is below 0.95. Exit 1 when a cell's run failed or
broke a must-be-zero figure (bench/goodput.py exited non-zero; a run that wrote no JSON is failed),
2 on bad flags (an unknown policy in --only, a --dir that cannot be a folder, refused before any cell
runs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from vime.harness.bench_runs import MIN_MTBF_S, policy_names
from vime.harness.emulated_model import PARAMETERS
from vime.harness.fault_clock import HEADLINE_MTBF_S, STRESS_MTBF_S, FaultClock
from vime.harness.fleet_plan import Workload, round_s

HERE = Path(__file__).resolve().parent
THRESHOLD = 0.95
# The share of a run's nominal work time (steps x (round + training)) a fault may land in and
# still count: a faulted run lasts longer than its nominal time (lost rounds, a fleet short).
HORIZON_SLACK = 3.0


# bench/goodput.py's floor, MIN_MTBF_S (its --mtbf refuses less): below it every cell would fail
# there, and the fault clock's draw over a cell's work grows without bound as the MTBF falls to 0.


def mtbf_value(text: str) -> float:
    named = {"headline": HEADLINE_MTBF_S, "stress": STRESS_MTBF_S}
    if text in named:
        return named[text]
    try:
        v = float(text)
    except ValueError:
        raise ValueError(repr(text)) from None
    if not (math.isfinite(v) and v >= MIN_MTBF_S):
        raise ValueError(repr(text))
    return v


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="8,64", help="fleet sizes, comma-separated (default 8,64)")
    ap.add_argument("--mtbf", default="headline,stress,900",
                    help="per-engine MTBFs: headline, stress or engine seconds, comma-separated "
                         "(default headline,stress,900)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per cell (default 3)")
    ap.add_argument("--rounds", type=int, default=6, help="steps per run (default 6, bench/goodput.py's)")
    ap.add_argument("--time-scale", type=float, help="passed to bench/goodput.py (its default 0.2)")
    ap.add_argument("--only", help="policies, passed to bench/goodput.py (fault-free always runs)")
    ap.add_argument("--dir", default="goodput-sweep", help="the cells' JSON and logs (default goodput-sweep)")
    ap.add_argument("--report-only", action="store_true", help="run nothing; the table from the cells in --dir")
    a = ap.parse_args(argv)
    try:
        a.sizes = sorted({int(x) for x in a.engines.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--engines takes fleet sizes, integers, comma-separated, not {a.engines!r}")
    try:
        a.mtbfs = sorted({mtbf_value(x.strip()) for x in a.mtbf.split(",") if x.strip()}, reverse=True)
    except ValueError as e:
        ap.error(f"--mtbf takes headline, stress or engine seconds (at least {MIN_MTBF_S:g}), comma-separated, "
                 f"not {e}")
    if not a.sizes or min(a.sizes) < 1:
        ap.error(f"--engines must name fleet sizes of at least 1, not {a.engines!r}")
    if not a.mtbfs:
        ap.error(f"--mtbf must name at least one rate, not {a.mtbf!r}")
    if a.seeds < 1 or a.rounds < 1:
        ap.error("--seeds and --rounds must be at least 1")
    if a.time_scale is not None and not (math.isfinite(a.time_scale) and a.time_scale > 0):
        ap.error(f"--time-scale must be a finite number > 0, not {a.time_scale}")
    return a


# -- pure -------------------------------------------------------------------------------------


def cell_args(engines: int, mtbf: float, a: argparse.Namespace) -> list[str]:
    args = ["--engines", str(engines), "--mtbf", f"{mtbf:.15g}", "--seeds", str(a.seeds), "--rounds", str(a.rounds)]
    if a.time_scale is not None:
        args += ["--time-scale", f"{a.time_scale:g}"]
    if a.only:
        args += ["--only", a.only]
    return args


def wanted(a: argparse.Namespace) -> list[str]:
    """The policies --only asks of each cell (fault-free always), in bench/goodput.py's order."""
    return policy_names(a.only, "sync")


def same_cell(doc: Mapping[str, Any], engines: int, mtbf: float, a: argparse.Namespace) -> bool:
    """Whether a bench/goodput.py JSON is this cell's run, its policies aside (by what it ran, not
    how it was typed): fleet size, rounds, rate, seeds and time scale."""
    w = doc.get("workload") or {}
    seeds = {r.get("seed") for r in doc.get("runs", ())}
    return (w.get("engines") == engines and w.get("rounds") == a.rounds and doc.get("mtbf_s") == mtbf
            and seeds == set(range(a.seeds)) and not doc.get("mutation")
            and (a.time_scale is None or w.get("scale") == a.time_scale))


def ran_policies(doc: Mapping[str, Any]) -> list[str]:
    pols = doc.get("policies")
    return list(pols) if isinstance(pols, dict) else []


def missing_policies(doc: Mapping[str, Any], a: argparse.Namespace) -> list[str]:
    """The policies --only wants that a cell's JSON did not run (none: it covers them, and is
    read in their place; the policies it ran beyond them are left out of the table)."""
    ran = set(ran_policies(doc))
    return [p for p in wanted(a) if p not in ran]


def ran_note(doc: Mapping[str, Any], missing: list[str]) -> str:
    """What a cell's JSON ran and which wanted policies it lacks: "ran fault-free, slime; not defaults"."""
    return f"ran {', '.join(ran_policies(doc)) or 'no policy'}; not {', '.join(missing)}"


def wanted_ettrs(doc: Mapping[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """ettrs() of the policies --only wants; a wanted policy the JSON did not run gets a note
    saying what it ran instead."""
    got = ettrs(doc)
    missing = missing_policies(doc, a)
    return {p: (ran_note(doc, missing) if p in missing else got.get(p, [])) for p in wanted(a)}


def wanted_failures(doc: Mapping[str, Any], a: argparse.Namespace) -> list[str]:
    """A cell JSON's failed runs and broken must-be-zero figures that are the wanted policies'
    (bench/goodput.py writes each as "<policy> seed <n>: ..."): a reused cell's run of a policy
    --only does not ask for fails nothing."""
    lines = [*(doc.get("failed") or ()), *(doc.get("must_be_zero") or ())]
    return [x for x in lines if not isinstance(x, str) or x.split(" seed ", 1)[0] in wanted(a)]


def faults_in_work(engines: int, mtbf: float, seeds: int, rounds: int) -> int:
    """Faults the clock strikes, over all seeds, inside a run's work (its nominal time x
    HORIZON_SLACK): 0 means no policy of the cell would meet one."""
    w = replace(Workload(), engines=engines, rounds=rounds)
    step = round_s(w, PARAMETERS["step_base_s"].value, PARAMETERS["step_per_seq_s"].value) + w.train_s
    horizon = HORIZON_SLACK * rounds * step
    return sum(len(FaultClock(seed=s, engines=engines, duration_s=horizon, mtbf_s=mtbf).schedule())
               for s in range(seeds))


def _run_shape(r: object) -> bool:
    """A run of bench/goodput.py's JSON as ettrs() reads it."""
    if not isinstance(r, dict):
        return False
    if "error" in r:
        return True
    ledger = r.get("ledger") or {}
    ettr = ledger.get("ettr") if isinstance(ledger, dict) else "?"
    return isinstance(r.get("policy"), str) and (ettr is None or (isinstance(ettr, (int, float)) and not isinstance(ettr, bool)))


def read_cell(path: Path) -> dict[str, Any] | str:
    """A cell's JSON already in --dir: the document, or why it is not one bench/goodput.py wrote
    (it is then run again in its place, or, with --report-only, shown as that)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"unreadable {path.name} ({type(e).__name__})"
    if not (isinstance(doc, dict) and isinstance(doc.get("workload"), dict) and isinstance(doc.get("runs"), list)
            and all(_run_shape(r) for r in doc["runs"])):
        return f"{path.name} is not bench/goodput.py's JSON"
    return doc


def ettrs(doc: Mapping[str, Any]) -> dict[str, list[float]]:
    """Per policy, the ETTRs of its valid runs whose fault-free baseline was valid."""
    out: dict[str, list[float]] = {}
    for r in doc.get("runs", ()):
        if "error" in r:
            continue
        out.setdefault(r["policy"], [])
        e = (r.get("ledger") or {}).get("ettr")
        if r.get("invalid") is None and r.get("ettr_invalid") is None and e is not None:
            out[r["policy"]].append(float(e))
    return out


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def cell_text(values: list[float] | None, seeds: int, note: str | None = None) -> str:
    if note:
        return note
    if not values:
        return f"- (0/{seeds} valid)"
    m = f"{median(values):.3f}"
    rng = "" if len(values) == 1 or min(values) == max(values) else f" [{min(values):.2f}-{max(values):.2f}]"
    return f"{m}{rng} ({len(values)}/{seeds})"


def falls_below(cells: Mapping[float, list[float] | None], threshold: float = THRESHOLD,
                min_seeds: int = 3) -> str:
    """The lowest fault rate (largest MTBF) swept at which the median ETTR over at least
    min_seeds valid seeds is below threshold; what is known when none is."""
    judged = [(m, v) for m, v in sorted(cells.items(), reverse=True) if v and len(v) >= min_seeds]
    below = [m for m, v in judged if median(v) < threshold]
    if below:
        return f"below {threshold:g} from MTBF {_mtbf_name(below[0])}"
    if not judged:
        return f"not judged (fewer than {min_seeds} valid seeds in every cell)"
    return f"at or above {threshold:g} down to MTBF {_mtbf_name(judged[-1][0])}"


def _mtbf_name(m: float) -> str:
    return {HEADLINE_MTBF_S: "24 h (headline)", STRESS_MTBF_S: "1 h (stress)"}.get(m, f"{m:.15g} s")


def table(sizes: Iterable[int], mtbfs: list[float], results: Mapping[tuple[int, float], Any], seeds: int) -> list[str]:
    """results[(engines, mtbf)]: per policy its ETTRs (or a str: why the cell has none of it),
    or a str (why the cell has no figure)."""
    lines: list[str] = []
    for n in sizes:
        pols: list[str] = []
        for m in mtbfs:
            r = results.get((n, m))
            if isinstance(r, dict):
                pols += [p for p in r if p not in pols]
        head = [f"{n} engines", *[f"MTBF {_mtbf_name(m)}" for m in mtbfs], f"ETTR {THRESHOLD:g}"]
        body = []
        for p in pols or ["(every policy)"]:
            row, cells = [p], {}
            for m in mtbfs:
                r = results.get((n, m))
                if isinstance(r, dict):  # a policy's ETTRs, or why the cell has none of it
                    v = r.get(p)
                    cells[m] = v if isinstance(v, list) else None
                    row.append(cell_text(cells[m], seeds, note=v if isinstance(v, str) else None))
                else:
                    row.append(cell_text(None, seeds, note=r or "not run"))
            row.append("-" if p == "fault-free" else falls_below(cells))
            body.append(row)
        widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
        lines += ["  ".join(str(x).rjust(w) for x, w in zip(line, widths)) for line in [head, *body]] + [""]
    return lines


# -- the runs ---------------------------------------------------------------------------------


def cell_path(folder: Path, engines: int, mtbf: float, ext: str = "json") -> Path:
    return folder / f"cell-{engines}-{mtbf:.15g}.{ext}"


def move_aside(folder: Path, engines: int, mtbf: float) -> str:
    """Move a cell's JSON and its log out of a new run's way, to cell-N-M.replaced-<n>.json and
    .log (n the first free): what they hold is kept. The name it got."""
    n = 1
    while any(cell_path(folder, engines, mtbf, f"replaced-{n}.{x}").exists() for x in ("json", "log")):
        n += 1
    for x in ("json", "log"):
        src = cell_path(folder, engines, mtbf, x)
        if src.exists():
            src.rename(cell_path(folder, engines, mtbf, f"replaced-{n}.{x}"))
    return cell_path(folder, engines, mtbf, f"replaced-{n}.json").name


def run_cell(engines: int, mtbf: float, a: argparse.Namespace, folder: Path) -> tuple[Any, int]:
    """(the cell's ettrs of the wanted policies, or why it has none; bench/goodput.py's exit status)."""
    args = cell_args(engines, mtbf, a)
    out = cell_path(folder, engines, mtbf)
    found = read_cell(out) if out.exists() else None
    this_cell = isinstance(found, dict) and same_cell(found, engines, mtbf, a)
    if isinstance(found, dict) and this_cell and (a.report_only or not missing_policies(found, a)):
        return wanted_ettrs(found, a), 1 if wanted_failures(found, a) else 0
    if faults_in_work(engines, mtbf, a.seeds, a.rounds) == 0:
        return "no fault", 0
    if a.report_only:
        return found if isinstance(found, str) else "not run", 0
    name = f"cell {engines} engines, MTBF {_mtbf_name(mtbf)}"
    if found is not None:  # never written over: it may hold hours of runs
        why = (found if isinstance(found, str) else ran_note(found, missing_policies(found, a)) if this_cell
               else "another workload, rate or seeds")
        print(f"{name}: {out.name} ({why}) moved to {move_aside(folder, engines, mtbf)}, its log too", flush=True)
    cmd = [sys.executable, str(HERE / "goodput.py"), *args, "--out", str(out)]
    print(f"{name}: {' '.join(cmd[1:])}", flush=True)
    with open(cell_path(folder, engines, mtbf, "log"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    got = read_cell(out) if out.exists() else "no JSON written"
    if isinstance(got, str):
        return f"failed (exit {rc}: {got})", rc or 1
    return wanted_ettrs(got, a), rc


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    try:  # bench/goodput.py's own check (its sync rows, the sweep has no --weights), before any cell runs
        policy_names(a.only, "sync", weights_flag=False)
    except ValueError as e:
        print(f"--only: {e}", file=sys.stderr)
        return 2
    folder = Path(a.dir)
    if a.report_only and not folder.is_dir():
        print(f"--report-only reads the cells in --dir, and {folder} is not a folder: name the sweep's folder",
              file=sys.stderr)
        return 2
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a regular file there or above it, no permission
        print(f"--dir {folder}: cannot hold the cells ({e.strerror or type(e).__name__}): name a folder",
              file=sys.stderr)
        return 2
    results: dict[tuple[int, float], Any] = {}
    failed: list[str] = []
    for n in a.sizes:
        for m in a.mtbfs:
            results[(n, m)], rc = run_cell(n, m, a, folder)
            if rc:
                failed.append(f"{n} engines, MTBF {_mtbf_name(m)}: bench/goodput.py exited {rc} "
                              f"(see {cell_path(folder, n, m, 'log')})")
    print()
    print("\n".join(table(a.sizes, a.mtbfs, results, a.seeds)))
    print(f"  each cell: the median ETTR over the valid seeds [range] (valid seeds/{a.seeds}); "
          "'no fault': the clock struck nothing inside any seed's work, so no policy differs from fault-free")
    if not a.report_only:  # a report writes nothing: sweep.json stays the last run's, its failures too
        (folder / "sweep.json").write_text(json.dumps(
            {"sizes": a.sizes, "mtbfs": a.mtbfs, "seeds": a.seeds, "rounds": a.rounds, "failed": failed,
             "cells": {f"{n}/{m:.15g}": r for (n, m), r in results.items()}}, indent=1) + "\n")
    for line in failed:
        print(f"  FAIL: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
