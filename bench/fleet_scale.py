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

    python bench/fleet_scale.py --engines 64 256 1024 --seconds 10
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from vime.harness.standin_engine import free_port_range  # noqa: E402  (bench/ is on sys.path when run)
from vime.supervisor.client import SupervisorClient  # noqa: E402
from vime.harness.local_daemon import Daemon, write_config  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
PER_PROCESS = 256  # stand-ins per helper process (each an aiohttp app on its own port)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run(n: int, seconds: float, interval: float, timeout: float, tmp: Path, client_kind: str) -> dict:
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
        health_check={"first_wait": 60.0, "interval": interval, "timeout": timeout, "failure_threshold": 3},
        engines=[{"name": f"standin-{i}", "url": f"http://127.0.0.1:{base + i}", "served_model_name": "tiny"}
                 for i in range(n)],
    )
    d = Daemon(cfg, env={"VIME_PROBE_HTTP": client_kind})
    try:
        client = SupervisorClient(str(tmp / f"run-{tag}" / "supervisor.sock"), connect_timeout=30)
        deadline = time.time() + 120
        while client.status()["routable"] < n:
            assert time.time() < deadline, "stand-ins never all became routable"
            time.sleep(0.5)
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
    return {"n": n, "cpu": 100 * (c1 - c0) / (t1 - t0), "rss": rss, "probes": probes,
            "expected": n * seconds / interval, "failed": failed, "late": late}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=0.9)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as t:
        for n in args.engines:
            pair = {kind: run(n, args.seconds, args.interval, args.timeout, Path(t), kind) for kind in ("lean", "aiohttp")}
            rows.append(pair)
            print(f"  measured {n} engines: {pair['lean']['cpu']:.1f}% of a core "
                  f"(aiohttp probes: {pair['aiohttp']['cpu']:.1f}%)", flush=True)
    print(f"\nfleet scale: one daemon, interval {args.interval:g} s, timeout {args.timeout:g} s, "
          f"{args.seconds:g} s window; engines are protocol stand-ins; {os.cpu_count()} cores")
    print(f"{'engines':>8} {'cpu % core':>10} {'aiohttp %':>10} {'ratio':>6} {'rss MiB':>8} {'probes':>8} "
          f"{'expected':>9} {'failed':>7} {'late':>5}")
    for pair in rows:
        r, b = pair["lean"], pair["aiohttp"]
        ratio = r["cpu"] / b["cpu"] if b["cpu"] > 0 else float("nan")
        print(f"{r['n']:>8} {r['cpu']:10.1f} {b['cpu']:10.1f} {ratio:6.2f} {r['rss']:8.0f} {r['probes']:8d} "
              f"{r['expected']:9.0f} {r['failed']:7d} {r['late']:5d}")
    print("(baseline: the same daemon and fleet with its probes over aiohttp's client, VIME_PROBE_HTTP=aiohttp)")


if __name__ == "__main__":
    main()
