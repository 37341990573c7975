"""The emulated fleet's long run (issue 36, "The long run, clean"): hours of the RL-shaped
workload on an emulated GPU fleet under the real daemon, faults on the clock all along, the
daemon sampled every 30 s and judged by harness/growth.py's bounds.

    python bench/fleet_soak.py --out fleet-soak-2h                # 256 engines, 2 h, the stress rate
    python bench/fleet_soak.py --engines 8 --hours 0.1 --out /tmp/fleet-soak-smoke

The fleet is bench/goodput.py's (harness/fleet_run.py: the emulated engines of
harness/emulated_engine.py, protocol stand-ins for vLLM with a GPU timing model, not vLLM, spawned
by the real daemon; the real rollout client; time-scaled, the daemon's timings scaled with them),
run as one policy (--policy, default everything-on with the spares fleet_plan sizes) whose steps
(a round, training, an emulated push, a publish) repeat until --hours have passed since the fleet
first served; the run ends at the first step's end after that.

Faults: harness/fault_clock.py's Poisson draw at --mtbf per engine (default the stress rate, one
fault per engine-hour of engine time), every kind it draws (an engine's kill -9, an engine core's
hang, a poisoned push, a crash at start, a node's engines at once) but the daemon's kill -9,
which comes from a clock of its own (--daemon-every, a mean of 30 wall minutes): the growth
report fits the daemon's quantities per daemon incarnation after a 10-minute warm-up, and the
fleet's draw would kill the daemon of 256 engines about every minute at the stress rate (its
share of the kinds, 0.5 in 9, of 256 faults per engine-hour).

Every --sample-every seconds one line of samples.jsonl: harness/soak.py's sample of the daemon
(RSS, descriptors, threads, the status round trip, the journal, the logs and their retention,
the engines' RSS), and the fleet's own figures over the last window: CPU in cores of the host,
the engines, the daemon and this bench; the daemon's loop lag and the engines' scheduling delay
(p99); engines routable; faults injected. The run's retention is the soak's (HOURS_RETENTION).

At the end: the growth report (harness/growth.py, bounds unchanged; growth.json), the headroom
(the fleet's CPU, lag and delay over the samples), the run's goodput ledger
(harness/goodput_ledger.py; stale samples and false restarts must be 0) and fleet_soak.json.

Exit status: 0 passed; 1 failed (a growth check or a retention rule, a must-be-zero figure not
0, a problem in the run, the run broke off); 3 not passed (the host did not keep the time scale,
fleet_plan.invalid; or a judged slope's spread is wider than half its bound: inconclusive).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from vime.harness import growth
from vime.harness.bench_runs import mtbf_of, run_header
from vime.harness.emulated_model import PARAMETERS, delay_quantile
from vime.harness.fault_clock import DEFAULT_WEIGHTS, STRESS_MTBF_S, FaultClock, ScheduledFault
from vime.harness.fleet_plan import LAG_QUANTILE, Policy, Workload, histogram_quantile, policies, spares_for
from vime.harness.fleet_run import FleetRun, Outcome
from vime.harness.goodput_ledger import Ledger, account
from vime.harness.local_daemon import write_config
from vime.harness.soak import HOURS_RETENTION, Sampler, retention_limits

DEFAULT_ENGINES = 256
DEFAULT_HOURS = 2.0
# Wall seconds per engine second: GPU time. The engines' decoding, the daemon's probes and the
# faults per wall hour fall as it grows; the emulated compiles' CPU per wall hour does not. At 1,
# 12 engines used 0.03 of a core (median of 20-s windows); 256 not measured yet (docs/testing.md).
DEFAULT_SCALE = 1.0
DEFAULT_DAEMON_EVERY_MIN = 30.0
# The observer reads every engine's /emulator/state this often (wall seconds): each read costs
# the engine and this bench a request, and its points stay in memory for the whole run.
DEFAULT_POLL_S = 1.0
MUST_BE_ZERO = ("stale_samples", "false_restarts")
EXIT_FAILED, EXIT_NOT_PASSED = 1, 3
# The daemon's own clock draws from a seed apart from the fleet's.
DAEMON_SEED_OFFSET = 1_000_003


# -- the plan (pure) --------------------------------------------------------------------------------


def soak_workload(engines: int, scale: float, poll_s: float) -> Workload:
    """bench/goodput.py's workload shape; `rounds` unused (the run repeats steps by the clock)."""
    return Workload(engines=engines, rounds=1, scale=scale, poll_s=poll_s)


def soak_schedule(*, seed: int, engines: int, hours: float, mtbf_s: float, scale: float,
                  daemon_every_min: float, margin: float = 1.5) -> list[ScheduledFault]:
    """The run's faults in time order, numbered again: the fleet's draw (fault_clock at
    `mtbf_s`, its kinds and weights but the daemon's) and the daemon's kill -9 drawn by a clock
    of its own, a mean of `daemon_every_min` wall minutes apart. Both cover `margin` x the
    run's wall time (a run ends after its last step, past --hours), in engine seconds."""
    duration = margin * hours * 3600.0 / scale
    weights = {k: v for k, v in DEFAULT_WEIGHTS.items() if k != "daemon"}
    fleet = FaultClock(seed=seed, engines=engines, duration_s=duration, mtbf_s=mtbf_s, weights=weights,
                       scale=scale).schedule()
    daemon = FaultClock(seed=seed + DAEMON_SEED_OFFSET, engines=1, duration_s=duration,
                        mtbf_s=daemon_every_min * 60.0 / scale, weights={"daemon": 1.0}, scale=scale).schedule()
    both = sorted([*fleet, *daemon], key=lambda f: f.at_s)
    return [replace(f, seq=i) for i, f in enumerate(both)]


def faults_per_hour(schedule: Sequence[ScheduledFault], scale: float, hours: float) -> dict[str, float]:
    """Per kind, the schedule's faults per wall hour over the run's first `hours`."""
    out: dict[str, float] = {}
    for f in schedule:
        if f.wall_s(scale) < hours * 3600.0:
            out[f.kind] = out.get(f.kind, 0.0) + 1.0 / hours
    return dict(sorted(out.items()))


def soak_policy(name: str, engines: int, mtbf_s: float, w: Workload, spares: int | None) -> Policy:
    """The run's policy: bench/goodput.py's, everything-on's spares sized as it sizes them."""
    sized = spares if spares is not None else min(engines, spares_for(engines, mtbf_s, w.restart_s))
    pols = policies(sized)
    if name not in pols or name == "fault-free":
        raise ValueError(f"unknown policy {name!r} for a run with faults; known: "
                         f"{', '.join(n for n in pols if n != 'fault-free')}")
    return pols[name]


def window_quantile(prev: Mapping[float, float], now: Mapping[float, float], q: float = LAG_QUANTILE) -> float | None:
    """Quantile q of the observations a cumulative histogram gained between two reads (upper
    bound -> cumulative count); None: none gained."""
    diff = {le: now[le] - prev.get(le, 0.0) for le in now}
    if diff.get(float("inf"), 0.0) <= 0:
        return None
    return histogram_quantile(diff, q)


def delay_totals(delays: Mapping[Any, tuple[Sequence[float], Sequence[int]]]) -> tuple[list[float], list[int]]:
    """Every engine incarnation's scheduling-delay histogram summed: (bounds, counts per bucket)."""
    le: list[float] = []
    counts: list[int] = []
    for le_, c in delays.values():
        le = list(le_)
        counts = [a + b for a, b in zip(counts, c)] if counts else list(c)
    return le, counts


def window_delay(prev: Sequence[int], now: tuple[list[float], list[int]], q: float = LAG_QUANTILE) -> float | None:
    """Quantile q of the scheduling delays observed between two totals; None: none."""
    le, counts = now
    gained = [n - (prev[i] if i < len(prev) else 0) for i, n in enumerate(counts)]
    if sum(gained) <= 0:
        return None
    return delay_quantile(le, gained, q)


def cpu_delta(prev: Mapping[int, float], now: Mapping[int, float]) -> float:
    """CPU seconds that processes used between two reads (pid -> CPU seconds): a process seen in
    both counts its difference, a new one all of it (it started in between), a gone one nothing
    (its last part is lost: a killed engine's)."""
    return sum(v - prev.get(pid, 0.0) for pid, v in now.items() if v >= prev.get(pid, 0.0))


HEADROOM_FIELDS = (("host_cores", "host CPU (all processes)", "cores"),
                   ("engines_cores", "engines' CPU", "cores"),
                   ("daemon_cores", "daemon's CPU", "cores"),
                   ("bench_cores", "this bench's CPU (rollout client, observer)", "cores"),
                   ("loop_lag_p99_ms", "daemon loop lag p99 (its histogram)", "ms"),
                   ("sched_delay_p99_ms", "engines' scheduling delay p99", "ms"),
                   ("routable", "engines routable", "engines"))


def headroom(samples: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per HEADROOM_FIELDS field, its median and max over the samples that have it."""
    out: dict[str, dict[str, float | None]] = {}
    for key, _, _ in HEADROOM_FIELDS:
        vals = [float(s[key]) for s in samples if s.get(key) is not None]
        out[key] = {"median": statistics.median(vals) if vals else None, "max": max(vals) if vals else None,
                    "min": min(vals) if vals else None, "n": float(len(vals))}
    return out


def inconclusive(rep: Mapping[str, Any]) -> list[str]:
    """The judged quantities whose slope's spread is wider than half the bound (growth.judge's
    note): a pass that cannot rule out a leak of the bound's size."""
    return [f"{r['label']}: {r['slope per h']:+.3g} ± {r['se per h']:.3g} {r['unit']}/h, bound {r['bound per h']:g}"
            for r in rep["quantities"] if r["bound per h"] is not None and r["se per h"] is not None
            and 2 * r["se per h"] > r["bound per h"]]


@dataclass
class Verdict:
    code: int
    failed: list[str]
    not_passed: list[str]

    @property
    def word(self) -> str:
        return "FAILED" if self.code == EXIT_FAILED else "NOT PASSED" if self.code == EXIT_NOT_PASSED else "passed"


def verdict(*, growth_rep: Mapping[str, Any] | None, ledger: Ledger | None, invalid: str | None,
            problems: Sequence[str], error: str | None) -> Verdict:
    """The run's exit status and why: failed over not passed over passed."""
    failed: list[str] = []
    if error is not None:
        failed.append(f"the run broke off: {error}")
    failed += [f"problem in the run: {p}" for p in problems]
    if growth_rep is None:
        failed.append("no growth report (no samples)")
    elif not growth_rep["ok"]:
        failed += [f"growth: {r['label']}: {r['verdict']}" for r in growth_rep["quantities"] if not r["ok"]]
        failed += [f"retention: {r['rule']}: max {r['max seen']} > {r['limit']}" for r in growth_rep["retention"]
                   if not r["ok"]]
    if ledger is None:
        failed.append("no ledger (the run broke off)")
    else:
        failed += [f"{f} = {getattr(ledger, f)} (must be 0)" for f in MUST_BE_ZERO if getattr(ledger, f)]
    not_passed: list[str] = []
    if invalid is not None:
        not_passed.append(f"invalid: {invalid}")
    if growth_rep is not None:
        not_passed += [f"inconclusive: {x}" for x in inconclusive(growth_rep)]
    code = EXIT_FAILED if failed else EXIT_NOT_PASSED if not_passed else 0
    return Verdict(code, failed, not_passed)


# -- the run (I/O) --------------------------------------------------------------------------------


def _clk() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


def proc_cpu_s(pid: int) -> float | None:
    """A process's user + system CPU seconds, from /proc (None: gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / _clk()  # utime, stime (fields 14, 15)
    except (OSError, ValueError, IndexError):
        return None


def groups_cpu_s(pgids: set[int]) -> dict[int, float]:
    """pid -> CPU seconds of every process in these process groups (an engine's server and its
    core child: the daemon starts each engine in a group of its own)."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry.name}/stat").read_text().rpartition(")")[2].split()
            if int(fields[2]) in pgids:  # pgrp
                out[int(entry.name)] = (int(fields[11]) + int(fields[12])) / _clk()
        except (OSError, ValueError, IndexError):
            continue
    return out


def host_busy_s() -> float:
    """CPU seconds the host's CPUs were busy since boot (all but idle and iowait)."""
    vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(vals[:8]) - vals[3] - vals[4]) / _clk()


class _Daemons:
    """What harness/soak.py's Sampler reads of its keeper: the control socket, the daemon now."""

    def __init__(self, run: SoakRun):
        self.run = run
        self.sock = str(run.tmp / "run" / "supervisor.sock")

    @property
    def daemon(self) -> Any:
        return self.run.daemons[-1]


class FleetSampler(Sampler):
    """harness/soak.py's sample of the daemon; the daemons' output appended to daemon.log first
    (the fleet's daemons keep it in memory, the soak's tees it), so its size is the file's."""

    def __init__(self, root: Path, run: SoakRun, every: float):
        super().__init__(root, run.cfg, _Daemons(run), every, [])  # type: ignore[arg-type]  # reads .sock, .daemon
        self.run = run
        self._written: dict[int, int] = {}  # id(daemon) -> its lines already written

    def write_log(self) -> None:
        """Append the daemons' lines not yet written to daemon.log."""
        with (self.root / "daemon.log").open("a") as log:
            for d in list(self.run.daemons):
                raw = d.raw
                n = self._written.get(id(d), 0)
                end = len(raw)
                if end > n:
                    log.write("".join(line + "\n" for line in raw[n:end]))
                    self._written[id(d)] = end

    def take(self) -> dict[str, Any]:
        self.write_log()
        return super().take()


class SoakRun(FleetRun):
    """FleetRun by the clock: steps until `hours` after the fleet first served (the run ends at
    the first step's end after that), a sample every `sample_every` seconds from then on, the
    soak's retention in the daemon's config."""

    def __init__(self, w: Workload, policy: Policy, schedule: Sequence[ScheduledFault], seed: int, tmp: Path, *,
                 out: Path, hours: float, sample_every: float, say: Any = print):
        super().__init__(w, policy, schedule, seed, tmp, None, say)
        self.out, self.hours, self.sample_every = out, hours, sample_every
        self.sampler: FleetSampler | None = None
        self.steps = 0

    def _config(self) -> Path:
        path = super()._config()
        doc = tomllib.loads(path.read_text())
        doc["supervisor"].update(HOURS_RETENTION)
        engines = doc.pop("engines")
        return write_config(path, engines=engines, **doc)

    # -- the per-minute sample -----------------------------------------------------------------

    def _fleet_sample(self, prev: dict[str, Any], now_t: float) -> dict[str, Any]:
        """The fleet's figures since the last sample (read on the event loop: FleetRun's state is
        the loop's). `prev` holds the last reads and is updated."""
        st = self.status
        engines = [e for e in st.get("engines", ()) if e.get("pid")]
        pgids = {int(e["pid"]) for e in engines}
        dpid = self.daemons[-1].proc.pid
        reads: dict[str, Any] = {"t": now_t, "host": host_busy_s(), "engines": groups_cpu_s(pgids),
                 "daemon": {dpid: proc_cpu_s(dpid) or 0.0}, "bench": sum(os.times()[:2]),
                 "lag": dict(self.lag), "delay": delay_totals(self.delays)}
        s: dict[str, Any] = {"routable": sum(1 for e in st.get("engines", ()) if e.get("routable")),
                             "faults_injected": len(self.injections), "steps": self.steps,
                             "rounds_lost": self.rounds_lost, "load1": os.getloadavg()[0],
                             "bench_rss": _self_rss()}
        if prev:
            dt = now_t - prev["t"]
            s["host_cores"] = round((reads["host"] - prev["host"]) / dt, 3)
            s["engines_cores"] = round(cpu_delta(prev["engines"], reads["engines"]) / dt, 3)
            s["daemon_cores"] = round(cpu_delta(prev["daemon"], reads["daemon"]) / dt, 3)
            s["bench_cores"] = round((reads["bench"] - prev["bench"]) / dt, 3)
            lag = window_quantile(prev["lag"], reads["lag"])
            s["loop_lag_p99_ms"] = None if lag is None else lag * 1000
            delay = window_delay(prev["delay"][1], reads["delay"])
            s["sched_delay_p99_ms"] = None if delay is None else delay * 1000
        prev.clear()
        prev.update(reads)
        return s

    @property
    def growth_samples(self) -> list[dict[str, Any]]:
        return [] if self.sampler is None else self.sampler.samples

    async def _sample_every(self) -> None:
        assert self.sampler is not None
        path = self.out / "samples.jsonl"
        path.write_text("")
        prev: dict[str, Any] = {}
        k = 0
        while True:
            fleet = self._fleet_sample(prev, time.time())
            try:
                sample = await asyncio.to_thread(self.sampler.take)
            except Exception as e:  # noqa: BLE001 - a sample lost is a gap, not the run's end
                sample = {"t": time.time() - self.sampler.start, "error": f"{type(e).__name__}: {e}"}
            sample.update(fleet)
            self.sampler.samples.append(sample)  # the Sampler reads the last daemon pid from them
            with path.open("a") as f:
                f.write(json.dumps(sample) + "\n")
            k += 1
            await asyncio.sleep(max(0.0, self.sampler.start + k * self.sample_every - time.time()))

    # -- the workload by the clock ---------------------------------------------------------------

    async def _workload(self, session: Any, client: Any) -> None:
        """FleetRun's steps (its _workload's, with its _rollout_client) until the clock runs out."""
        w = self.w
        self.sampler = FleetSampler(self.out, self, self.sample_every)
        self.sampler.start = self.t0
        sampling = asyncio.ensure_future(self._sample_every())
        until = self.t0 + self.hours * 3600.0
        self.rollout = self._rollout_client(client)
        await self.rollout.start()
        try:
            await self._push_and_publish(session, client, 1)
            rnd = 0
            while time.time() < until:
                rnd += 1
                while not await self._round(client, rnd):
                    while not (await self._routable(client)):
                        await asyncio.sleep(w.poll_s)
                await asyncio.sleep(w.wall(w.train_s))
                await self._push_and_publish(session, client, rnd + 1)
                self.steps = rnd
                if rnd % 10 == 0:
                    self.say(f"    step {rnd} at +{(time.time() - self.t0) / 60:.1f} min, "
                             f"{len(self.injections)} faults injected, {self.rounds_lost} rounds lost")
        finally:
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)
            await self.rollout.aclose()


def _self_rss() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# -- the command -----------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python bench/fleet_soak.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=DEFAULT_ENGINES, help=f"serving engines (default {DEFAULT_ENGINES})")
    ap.add_argument("--hours", type=float, default=DEFAULT_HOURS, help=f"wall hours of work (default {DEFAULT_HOURS:g})")
    ap.add_argument("--mtbf", type=mtbf_of, default=STRESS_MTBF_S,
                    help="per-engine MTBF: headline (24 h), stress (1 h) or engine seconds (default stress)")
    ap.add_argument("--time-scale", type=float, default=DEFAULT_SCALE,
                    help=f"wall seconds per engine second (default {DEFAULT_SCALE:g})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("fleet-soak"), help="a new or empty folder (default fleet-soak)")
    ap.add_argument("--policy", default="everything-on", help="bench/goodput.py's policy (default everything-on)")
    ap.add_argument("--spares", type=int, default=None, help="everything-on's warm spares (default: sized from the MTBF)")
    ap.add_argument("--daemon-every", type=float, default=DEFAULT_DAEMON_EVERY_MIN, metavar="MIN",
                    help=f"mean wall minutes between the daemon's kills -9 (default {DEFAULT_DAEMON_EVERY_MIN:g})")
    ap.add_argument("--sample-every", type=float, default=30.0, metavar="S", help="seconds between samples (default 30)")
    ap.add_argument("--warmup", type=float, default=None, metavar="MIN",
                    help=f"minutes skipped before fitting slopes (default {growth.WARMUP_S / 60:g}, or the first "
                         f"{growth.WARMUP_SHARE * 100:.0f}%% of a shorter run)")
    ap.add_argument("--poll", type=float, default=DEFAULT_POLL_S, metavar="S",
                    help=f"seconds between the observer's reads of the fleet (default {DEFAULT_POLL_S:g})")
    a = ap.parse_args(argv)
    if a.engines < 1:
        ap.error(f"--engines must be at least 1, not {a.engines}")
    if a.spares is not None and not 0 <= a.spares <= a.engines:
        ap.error(f"--spares must be between 0 and --engines ({a.engines}), not {a.spares}")
    for flag in ("hours", "time_scale", "daemon_every", "sample_every", "poll"):
        v = getattr(a, flag)
        if not (math.isfinite(v) and v > 0):
            ap.error(f"--{flag.replace('_', '-')} must be a finite number > 0, not {v}")
    if a.warmup is not None and not (math.isfinite(a.warmup) and a.warmup >= 0):
        ap.error(f"--warmup must be minutes >= 0, not {a.warmup}")
    if a.sample_every * 3 > a.hours * 3600:
        ap.error(f"--hours {a.hours:g} holds fewer than 3 samples at --sample-every {a.sample_every:g}: "
                 "a slope needs more; run longer or sample more often")
    if a.out.exists() and (not a.out.is_dir() or any(a.out.iterdir())):
        ap.error(f"--out {a.out} exists and is not an empty folder: name a new one (its samples and logs would mix)")
    return a


def format_headroom(h: Mapping[str, Mapping[str, float | None]]) -> str:
    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.3g}"

    lines = ["", "headroom (per sample window: median, min-max)"]
    for key, label, unit in HEADROOM_FIELDS:
        r = h[key]
        lines.append(f"  {label:<46}{num(r['median']):>8} {unit:<8}[{num(r['min'])}-{num(r['max'])}]")
    return "\n".join(lines)


def ledger_lines(g: Ledger) -> list[str]:
    recover = g.mean_recover_s
    return ["", "goodput ledger (harness/goodput_ledger.py; wall seconds)",
            f"  steps {g.rounds - g.rounds_lost} ({g.rounds} rounds, {g.rounds_lost} lost), wall {g.wall_s:.0f} s, "
            f"useful tokens/s {g.useful_tps:.0f}",
            f"  faults {g.failures} ({g.on_down} on engines already down), mean recover "
            f"{'-' if recover is None else f'{recover:.1f} s'}, unrecovered {g.unrecovered}, capacity lost "
            f"{g.capacity_lost_s:.0f} engine-s, tokens lost {g.tokens_lost}, spare exhaustions {g.spare_exhaustions}",
            f"  stale samples {g.stale_samples} (must be 0), false restarts {g.false_restarts} (must be 0)"
            + (f": {g.false[:5]}" if g.false else "")]


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    w = soak_workload(a.engines, a.time_scale, a.poll)
    try:
        policy = soak_policy(a.policy, a.engines, a.mtbf, w, a.spares)
    except ValueError as e:
        print(f"--policy: {e}", file=sys.stderr)
        return 2
    schedule = soak_schedule(seed=a.seed, engines=a.engines, hours=a.hours, mtbf_s=a.mtbf, scale=a.time_scale,
                             daemon_every_min=a.daemon_every)
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    per_h = faults_per_hour(schedule, a.time_scale, a.hours)
    print(f"fleet soak: {a.engines} serving engines ({policy.name}, {policy.spares} spares), {a.hours:g} h, "
          f"time scale {a.time_scale:g}, MTBF {a.mtbf:g} engine s per engine, the daemon killed every "
          f"{a.daemon_every:g} min on average; faults per wall hour {per_h}", flush=True)
    doc: dict[str, Any] = {
        **run_header("fleet_soak.py", sys.argv[1:] if argv is None else argv),
        "workload": asdict(w), "policy": asdict(policy), "mtbf_s": a.mtbf, "fault_weights": dict(DEFAULT_WEIGHTS),
        "daemon_every_min": a.daemon_every, "retention": HOURS_RETENTION, "faults_per_wall_hour": per_h,
        "timing_parameters": {k: {"value": p.value, "unit": p.unit, "source": p.source} for k, p in PARAMETERS.items()}}
    run = SoakRun(w, policy, schedule, a.seed, out / "fleet", out=out, hours=a.hours, sample_every=a.sample_every,
                  say=lambda m: print(m, flush=True))
    outcome: Outcome | None = None
    error: str | None = None
    t0 = time.monotonic()
    try:
        (out / "fleet").mkdir()
        outcome = asyncio.run(run.run(ready_within=max(300.0, 3.0 * len(run.names))))
    except Exception as e:  # noqa: BLE001 - reported and judged: the run broke off
        error = f"{type(e).__name__}: {e}"
        print(f"the run broke off: {error}", flush=True)
    if run.sampler is not None:
        run.sampler.write_log()  # the lines after the last sample, for the record
    samples = run.growth_samples
    growth_rep = None
    if samples:
        duration = samples[-1]["t"]
        warmup = a.warmup * 60 if a.warmup is not None else growth.warmup_for(duration)
        growth_rep = growth.report(samples, warmup_s=warmup, limits=retention_limits(run.cfg), start=0.0)
        (out / "growth.json").write_text(json.dumps(growth_rep, indent=1, default=str))
        print(growth.format_report(growth_rep))
    room = headroom(samples[1:])
    print(format_headroom(room))
    ledger = account(outcome.record) if outcome is not None else None
    if ledger is not None:
        print("\n".join(ledger_lines(ledger)))
    if outcome is not None:
        print(f"  the time scale: loop lag p99 {outcome.lag_p99_s * 1000:.0f} ms, scheduling delay p99 "
              f"{outcome.delay_p99_s * 1000:.0f} ms, bound 0.1 x {min(outcome.intervals.values()):g} s "
              f"({min(outcome.intervals, key=lambda k: outcome.intervals[k])}): "
              + ("kept" if outcome.invalid is None else f"INVALID: {outcome.invalid}"))
    v = verdict(growth_rep=growth_rep, ledger=ledger, invalid=None if outcome is None else outcome.invalid,
                problems=[] if outcome is None else outcome.problems, error=error)
    doc.update(took_s=round(time.monotonic() - t0, 1), error=error, headroom=room,
               ledger=None if ledger is None else {**asdict(ledger), "mean_recover_s": ledger.mean_recover_s,
                                                   "unrecovered": ledger.unrecovered},
               invalid=None if outcome is None else outcome.invalid,
               loop_lag_p99_s=None if outcome is None else outcome.lag_p99_s,
               sched_delay_p99_s=None if outcome is None else outcome.delay_p99_s,
               intervals_s=None if outcome is None else outcome.intervals,
               daemon_config=None if outcome is None else outcome.daemon_config,
               faults=None if outcome is None else outcome.faults_injected,
               problems=None if outcome is None else outcome.problems, growth_ok=growth_rep and growth_rep["ok"],
               verdict={"code": v.code, "word": v.word, "failed": v.failed, "not_passed": v.not_passed})
    (out / "fleet_soak.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"\nfleet soak {v.word} (exit {v.code}) after {doc['took_s'] / 60:.1f} min; {out}/fleet_soak.json, "
          "growth.json, samples.jsonl, daemon.log")
    for line in v.failed:
        print(f"  FAIL: {line}")
    for line in v.not_passed:
        print(f"  NOT PASSED: {line}")
    return v.code


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
