"""An emulated GPU fleet under the real daemon: does a fleet of N emulated engines fit here?

The daemon (the real one) spawns N emulated engines (harness/emulated_engine.py: a protocol
stand-in for vLLM, one process per engine plus its VLLM::EngineCore child; not vLLM) as it
spawns vLLM, with the GPU timing model scaled by --time-scale (boot 80 s x scale, then a
warm-up batch that pays the first-batch compile). It reports:
- boot: seconds from the daemon's start until every engine is routable, and per engine from
  its spawn to RUNNING (the daemon's transitions), median and max;
- memory: each engine's resident set (server + core child), median and max; its proportional
  set (pages shared between the two counted once) and the fleet's sum; the daemon's; and what
  the machine had available before and with the fleet;
- the daemon's loop lag, read as the round trip of GET /v1/status on its control socket (the
  daemon has no loop-lag probe; the soak reads the same proxy), median and p99 over a steady
  window while it probes all N engines every --interval s;
- the fleet's CPU (servers and core children) over that window, in % of one core.
It exits 1 when the fleet did not come up (not every engine routable in time, or the daemon
exited), saying why.

    python bench/emulated_fleet.py                 # 64 engines
    python bench/emulated_fleet.py --engines 128 --time-scale 0.02 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from vime.harness import emulated_engine  # noqa: E402  (bench/ is on sys.path when run)
from vime.harness.local_daemon import Daemon, standin_model, standin_python, write_config  # noqa: E402
from vime.supervisor.client import DaemonUnreachable, SupervisorClient  # noqa: E402


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def pss_mib(pid: int) -> float:
    """Proportional set size: pages shared with the core child (forked) counted once between them."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def cpu_s(pid: int) -> float:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(n: int, scale: float, interval: float, seconds: float, within: float, tmp: Path) -> dict:
    model = standin_model(tmp / "model")
    python = standin_python(tmp, Path(emulated_engine.__file__))
    scaled_boot = emulated_engine.PARAMETERS["boot_s"].value * scale
    base = emulated_engine.free_port_range(n)
    cfg = write_config(
        tmp / "sup.toml",
        supervisor={"runtime_dir": str(tmp / "run"), "log_dir": str(tmp / "logs"), "python": str(python),
                    "stop_timeout": 5.0, "min_healthy": 0},
        health_check={"first_wait": max(60.0, 4 * scaled_boot), "interval": interval, "timeout": max(2.0, interval),
                      "failure_threshold": 3},
        engine_defaults={"args": ["--time-scale", str(scale), "--dump-params", str(tmp / "params.json")]},
        engines=[{"name": f"e{i}", "model": str(model), "served_model_name": "tiny", "port": base + i}
                 for i in range(n)],
    )
    mem_before = available_mib()
    t0 = time.time()
    d = Daemon(cfg)
    try:
        sock = tmp / "run" / "supervisor.sock"
        client = None
        while True:
            if d.proc.poll() is not None:
                raise SystemExit(f"the daemon exited with status {d.proc.returncode}: {d.raw[-3:]}")
            if client is None and sock.exists():
                client = SupervisorClient(str(sock), connect_timeout=30, timeout=30)
            try:
                if client is not None and client.status()["routable"] >= n:
                    break
            except DaemonUnreachable:
                pass
            if time.time() - t0 > within:
                states = {} if client is None else {e["name"]: e["state"] for e in client.status()["engines"]}
                raise SystemExit(f"not every engine routable within {within:g} s: "
                                 f"{sum(s == 'RUNNING' for s in states.values())}/{n} RUNNING")
            time.sleep(0.5)
        all_up = time.time() - t0
        spawned: dict[str, float] = {}
        running: dict[str, float] = {}
        for ev in d.events:  # the daemon's log lines (info: every transition)
            if ev.get("event") == "engine.transition" and "timestamp" in ev:
                at = datetime.fromisoformat(ev["timestamp"]).timestamp()
                if ev.get("to_state") == "STARTING":
                    spawned.setdefault(ev["engine"], at)
                elif ev.get("to_state") == "RUNNING":
                    running.setdefault(ev["engine"], at)
        boots = [running[k] - spawned[k] for k in running if k in spawned]
        time.sleep(2 * interval)  # steady state
        pids = [e["pid"] for e in client.status()["engines"] if e["pid"]]
        procs = pids + [c for p in pids for c in children(p)]
        cpu0, w0 = sum(cpu_s(p) for p in procs), time.monotonic()
        lag: list[float] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            c0 = time.perf_counter()
            client.status()
            lag.append(time.perf_counter() - c0)
            time.sleep(0.05)
        fleet_cpu = 100 * (sum(cpu_s(p) for p in procs) - cpu0) / (time.monotonic() - w0)
        per_engine = [rss_mib(p) + sum(rss_mib(c) for c in children(p)) for p in pids]
        per_engine_pss = [pss_mib(p) + sum(pss_mib(c) for c in children(p)) for p in pids]
        mem_after = available_mib()
        daemon_rss = rss_mib(d.proc.pid)
        after = client.status()
    finally:
        d.terminate(60)
    failed = sum(e["probe_failures"] for e in after["engines"])
    return {
        "engines": n, "time_scale": scale, "scaled_boot_s": scaled_boot, "all_routable_s": round(all_up, 1),
        "boot_s": {"median": round(statistics.median(boots), 2), "max": round(max(boots), 2)} if boots else None,
        "engine_rss_mib": {"median": round(statistics.median(per_engine), 1), "max": round(max(per_engine), 1),
                           "sum": round(sum(per_engine), 1)},
        "engine_pss_mib": {"median": round(statistics.median(per_engine_pss), 1),
                           "sum": round(sum(per_engine_pss), 1)},
        "daemon_rss_mib": round(daemon_rss, 1),
        "mem_available_mib": {"before": round(mem_before), "with_fleet": round(mem_after)},
        "status_round_trip_ms": {"median": round(1000 * statistics.median(lag), 2),
                                 "p99": round(1000 * pct(lag, 0.99), 2), "calls": len(lag)},
        "probe_failures": failed,
        "fleet_cpu_pct_of_a_core": round(fleet_cpu, 1),
        "parameters": json.loads((tmp / "params.json").read_text()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=64)
    ap.add_argument("--time-scale", type=float, default=0.05, help="the emulated engines' time scale")
    ap.add_argument("--interval", type=float, default=1.0, help="the daemon's probe interval (s)")
    ap.add_argument("--seconds", type=float, default=10.0, help="the steady window the loop lag is read over")
    ap.add_argument("--within", type=float, default=300.0, help="how long the fleet may take to be routable (s)")
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="emulated-fleet-") as tmp:
        r = run(args.engines, args.time_scale, args.interval, args.seconds, args.within, Path(tmp))
    print(f"{r['engines']} emulated engines under the real daemon (time scale {r['time_scale']:g}: "
          f"boot {r['scaled_boot_s']:.1f} s each)")
    b = r["boot_s"]
    print(f"  all routable after {r['all_routable_s']:.1f} s; spawn to RUNNING median "
          f"{b['median'] if b else '?'} s, max {b['max'] if b else '?'} s")
    m, pss = r["engine_rss_mib"], r["engine_pss_mib"]
    print(f"  engine RSS (server + core child): median {m['median']:.1f} MiB, max {m['max']:.1f} MiB; PSS median "
          f"{pss['median']:.1f} MiB, all {pss['sum']:.0f} MiB; daemon {r['daemon_rss_mib']:.0f} MiB; memory available "
          f"{r['mem_available_mib']['before']} MiB before, {r['mem_available_mib']['with_fleet']} MiB with the fleet")
    lag = r["status_round_trip_ms"]
    print(f"  daemon loop lag (GET /v1/status round trip): median {lag['median']:.2f} ms, p99 {lag['p99']:.2f} ms "
          f"over {lag['calls']} calls; probe failures {r['probe_failures']}")
    print(f"  the fleet's CPU while probed (servers and core children): {r['fleet_cpu_pct_of_a_core']:.1f}% of a core")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
    sys.exit(0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
