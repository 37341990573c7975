"""Fleet scale: one daemon probing 64 / 256 / 1024 engines at a 1 s interval.

The engines are protocol stand-ins (harness/standin_engine.py): a real vLLM server needs ~3 GB
and ~40 s to boot on CPU, so hundreds of them cannot run here. Each stand-in answers /health,
a 1-token /v1/completions, /metrics and /weight_info like vLLM. The daemon is the real one.

For each fleet size it reports the daemon's CPU (% of one core, from /proc/PID/stat over a
steady-state window), its resident memory, and heartbeats that missed their deadline: probes
that failed (an answer later than the timeout) and late starts (a probe whose start slipped
more than one interval behind its schedule, from the daemon's probe-history counters on
/v1/status). The baseline, measured in the same run for each fleet size, is the same daemon
with its probes over aiohttp's client (VIME_PROBE_HTTP=aiohttp), as before the lean client.

The bench raises its own open-file limit (the soft one to the hard one; as root, the hard one
too) to what the largest fleet needs, and the daemon and stand-ins inherit it. A daemon that
refuses its fleet or exits is reported with its own words, one that does not get every
engine routable in time with what it was doing; either way the other sizes still run.

    python bench/fleet_scale.py --engines 64 256 1024 --seconds 10
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from vime.harness.standin_engine import free_port_range  # noqa: E402  (bench/ is on sys.path when run)
from vime.supervisor.client import DaemonUnreachable, SupervisorClient  # noqa: E402
from vime.harness.local_daemon import Daemon, write_config  # noqa: E402
from vime.supervisor.limits import nofile_needed  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
MIN_TICKS = 20  # below this a ratio is quantization: 1 tick against 2 reads as 0.5
PER_PROCESS = 256  # stand-ins per helper process (each an aiohttp app on its own port)
# Descriptors of this bench beside the daemon's own need: its client, the log pipe, the
# stand-in helpers' pipes (each helper has the same limit and uses about 3 per stand-in).
SLACK = 1024


class FleetFailed(Exception):
    """The daemon refused the fleet, exited, or did not get every engine routable in time."""


def raise_own_limit(n: int) -> tuple[int, int, str | None]:
    """Raise this process' RLIMIT_NOFILE (inherited by the daemon and the stand-ins) to what n
    attached engines need, as far as allowed: the soft limit to the hard one, and the hard one
    itself where this process may (root). Returns (soft, hard, why it could not)."""
    want = nofile_needed(0, attached=n) + SLACK
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    why = None
    if hard != resource.RLIM_INFINITY and hard < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
        except (ValueError, OSError) as e:
            why = f"hard open-file limit {hard} < {want} and not raisable here ({e})"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard, why


def fleet_state(d: Daemon, client: SupervisorClient) -> str:
    """What the daemon was doing when the wait for routable ended: its states, descriptors,
    CPU, and the limit lines of its log."""
    parts = []
    try:
        st = client.status()
        parts.append("states " + ", ".join(f"{k} {v}" for k, v in
                                           collections.Counter(e["state"] for e in st["engines"]).most_common()))
    except Exception as e:  # noqa: BLE001  (a daemon too busy to answer is the finding)
        parts.append(f"status: {type(e).__name__}: {e}")
    try:
        parts.append(f"{len(os.listdir(f'/proc/{d.proc.pid}/fd'))} open descriptors")
        parts.append(f"{cpu_seconds(d.proc.pid):.0f} s of CPU")
    except OSError:
        pass
    limits = [e for e in list(d.events) if str(e.get("event", "")).startswith("limits.")]
    parts += [f"{e['event']}: {e.get('problem') or {k: e[k] for k in ('soft', 'hard', 'needed') if k in e}}"
              for e in limits]
    notmade = sum(1 for e in list(d.events) if e.get("event") == "engine.probe_not_made")
    if notmade:
        parts.append(f"{notmade} engine(s) with probes the daemon had no descriptor for")
    return "; ".join(parts)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run(n: int, seconds: float, interval: float, timeout: float, tmp: Path, client_kind: str,
        routable_within: float) -> dict:
    base = free_port_range(n)
    helpers = []
    for start in range(0, n, PER_PROCESS):
        count = min(PER_PROCESS, n - start)
        p = subprocess.Popen([sys.executable, str(ROOT / "harness" / "standin_engine.py"),
                              "--base-port", str(base + start), "--count", str(count)], stdout=subprocess.PIPE)
        helpers.append(p)
    for p in helpers:
        p.stdout.readline()
    tag = f"{n}-{client_kind}"
    cfg = write_config(
        tmp / f"scale-{tag}.toml",
        supervisor={"runtime_dir": str(tmp / f"run-{tag}"), "log_dir": str(tmp / "logs"), "log_level": "warning",
                    "min_healthy": 0, "state_dir": str(tmp / f"state-{tag}")},  # each run its own journal
        health_check={"first_wait": max(60.0, routable_within), "interval": interval, "timeout": timeout, "failure_threshold": 3},
        engines=[{"name": f"standin-{i}", "url": f"http://127.0.0.1:{base + i}", "served_model_name": "tiny"}
                 for i in range(n)],
    )
    d = Daemon(cfg, env={"VIME_PROBE_HTTP": client_kind})
    try:
        sock = tmp / f"run-{tag}" / "supervisor.sock"
        t0 = time.time()
        deadline = t0 + routable_within
        unanswered = 0  # status calls the daemon did not answer within the client's timeout
        while True:
            rc = d.proc.poll()
            if rc is not None:
                d.terminate(5)
                said = [ln for ln in d.raw if "config error" in ln or '"level": "error"' in ln][-3:]
                raise FleetFailed(f"the daemon exited with status {rc}: " + (" | ".join(said) or d.raw[-1:]))
            if sock.exists():
                client = SupervisorClient(str(sock), connect_timeout=30, timeout=30)
                try:
                    if client.status()["routable"] >= n:
                        break
                except DaemonUnreachable:  # its event loop held for 30 s: part of the finding
                    unanswered += 1
            if time.time() > deadline:
                busy = f"; {unanswered} status call(s) unanswered for 30 s (its event loop busy)" if unanswered else ""
                raise FleetFailed(f"not every engine routable within {routable_within:g} s{busy}: "
                                  f"{fleet_state(d, SupervisorClient(str(sock), connect_timeout=5, timeout=30))}")
            time.sleep(0.5)
        up = time.time() - t0
        time.sleep(2 * interval)  # steady state
        before = client.status()
        c0, t0 = cpu_seconds(d.proc.pid), time.monotonic()
        time.sleep(seconds)
        c1, t1 = cpu_seconds(d.proc.pid), time.monotonic()
        after = client.status()
        rss = rss_mib(d.proc.pid)
    finally:
        d.kill()
        for p in helpers:
            p.kill()
            p.wait()
    probes = sum(e["probes"] for e in after["engines"]) - sum(e["probes"] for e in before["engines"])
    failed = sum(e["probe_failures"] for e in after["engines"]) - sum(e["probe_failures"] for e in before["engines"])
    late = sum(e["late_probes"] for e in after["engines"]) - sum(e["late_probes"] for e in before["engines"])
    return {"n": n, "cpu": 100 * (c1 - c0) / (t1 - t0), "ticks": round((c1 - c0) * TICK), "rss": rss, "probes": probes,
            "expected": n * seconds / interval, "failed": failed, "late": late, "up": up}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=0.9)
    ap.add_argument("--probes", nargs="+", choices=("lean", "aiohttp"), default=["lean", "aiohttp"],
                    help="probe clients to run (default both: the lean client and its aiohttp baseline)")
    ap.add_argument("--routable-within", type=float, default=None,
                    help="seconds for every engine to become routable (default: 120, or 0.1 s per engine above that)")
    args = ap.parse_args()
    soft, hard, why = raise_own_limit(max(args.engines))
    print(f"open-file limit (this bench, the daemon, the stand-ins): soft {soft}, hard {hard}"
          + (f"; {why}" if why else ""), flush=True)
    rows, failed = [], {}
    with tempfile.TemporaryDirectory() as t:
        for n in args.engines:
            within = args.routable_within or max(120.0, 0.1 * n)
            pair = {}
            for kind in args.probes:
                try:
                    pair[kind] = run(n, args.seconds, args.interval, args.timeout, Path(t), kind, within)
                except FleetFailed as e:  # printed; the other sizes still run
                    failed[(n, kind)] = str(e)
                    print(f"  {n} engines, {kind} probes: FAILED: {e}", flush=True)
                    continue
                r = pair[kind]
                print(f"  measured {n} engines, {kind} probes: {r['cpu']:.1f}% of a core, {r['rss']:.0f} MiB, "
                      f"{r['failed']} failed and {r['late']} late of {r['probes']} probes; all routable in "
                      f"{r['up']:.1f} s", flush=True)
            rows.append((n, pair))
    print(f"\nfleet scale: one daemon, interval {args.interval:g} s, timeout {args.timeout:g} s, "
          f"{args.seconds:g} s window; engines are protocol stand-ins; {os.cpu_count()} cores")
    print(f"{'engines':>8} {'cpu % core':>10} {'aiohttp %':>10} {'ratio':>6} {'rss MiB':>8} {'probes':>8} "
          f"{'expected':>9} {'failed':>7} {'late':>5} {'up s':>6}")
    nan = float("nan")
    coarse = False
    for n, pair in rows:
        r, b = pair.get("lean"), pair.get("aiohttp")
        if r is None:
            print(f"{n:>8} {'FAILED':>10} " + (f"{b['cpu']:10.1f}" if b else f"{'FAILED':>10}"))
            continue
        bcpu = b["cpu"] if b else nan
        # /proc counts CPU in clock ticks (10 ms): a ratio of a few ticks is noise, not a figure
        if b and min(r["ticks"], b["ticks"]) >= MIN_TICKS:
            ratio = f"{r['cpu'] / bcpu:6.2f}"
        else:
            ratio, coarse = f"{'-':>6}", coarse or bool(b)
        print(f"{n:>8} {r['cpu']:10.1f} {bcpu:10.1f} {ratio} {r['rss']:8.0f} {r['probes']:8d} "
              f"{r['expected']:9.0f} {r['failed']:7d} {r['late']:5d} {r['up']:6.1f}")
    print("(baseline: the same daemon and fleet with its probes over aiohttp's client, VIME_PROBE_HTTP=aiohttp; "
          "up s: start to every engine routable)")
    if coarse:
        print(f"(ratio -: under {MIN_TICKS} clock ticks of CPU ({1000 / TICK:g} ms each) in the window; "
              "a longer --seconds measures it)")
    for (n, kind), why in failed.items():
        print(f"FAILED {n} engines, {kind} probes: {why}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
