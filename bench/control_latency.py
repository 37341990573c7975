"""Control-socket latency while the daemon probes N engines, against a bare aiohttp handler.

For each N it starts N engine stand-ins (harness/standin_engine.py: a protocol stand-in, since
N real vLLM servers do not fit here) and the real daemon attached to them at a 1 s interval,
then times round start+end pairs and status calls from the trainer's sync client. The
baseline, measured in the same run, is a bare aiohttp Unix-socket server answering a
constant JSON body, called by the same client code. The ratio is the figure.

    python bench/control_latency.py --engines 0 64 256 --calls 500
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from vime.harness.standin_engine import free_port_range  # noqa: E402  (bench/ is on sys.path when run)
from vime.supervisor.client import SupervisorClient  # noqa: E402
from vime.harness.local_daemon import Daemon, free_port, write_config  # noqa: E402

BARE_SERVER = r"""
import asyncio, os, sys, uvloop
from aiohttp import web
async def main(path):
    app = web.Application()
    async def h(_): return web.json_response({"round": 1, "open": True, "changed": True})
    app.router.add_post("/v1/rounds/{n}/{what}", h)
    app.router.add_get("/v1/status", h)
    runner = web.AppRunner(app, access_log=None); await runner.setup()
    await web.UnixSite(runner, path).start(); print("ready", flush=True)
    await asyncio.Event().wait()
uvloop.run(main(sys.argv[1]))
"""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def time_calls(client: SupervisorClient, calls: int) -> tuple[list[float], list[float]]:
    rounds, status = [], []
    for i in range(1, calls + 1):
        t0 = time.perf_counter()
        client.start_round(i)
        client.end_round(i)
        rounds.append((time.perf_counter() - t0) / 2)
        t0 = time.perf_counter()
        client.status()
        status.append(time.perf_counter() - t0)
    return rounds, status


def bare_baseline(calls: int, tmp: Path) -> tuple[list[float], list[float]]:
    path = str(tmp / "bare.sock")
    proc = subprocess.Popen([sys.executable, "-c", BARE_SERVER, path], stdout=subprocess.PIPE)
    try:
        proc.stdout.readline()
        return time_calls(SupervisorClient(path), calls)
    finally:
        proc.kill()
        proc.wait()


def daemon_with_standins(n: int, calls: int, tmp: Path) -> tuple[list[float], list[float]]:
    base = free_port() if n == 0 else free_port_range(n, 21000)
    standins = None
    engines = [{"name": "none", "url": "http://127.0.0.1:9"}]  # one engine needed; nothing listens
    if n:
        standins = subprocess.Popen([sys.executable, str(ROOT / "harness" / "standin_engine.py"),
                                     "--base-port", str(base), "--count", str(n)], stdout=subprocess.PIPE)
        standins.stdout.readline()
        engines = [{"name": f"standin-{i}", "url": f"http://127.0.0.1:{base + i}", "served_model_name": "tiny"}
                   for i in range(n)]
    run = tmp / f"run-{n}"
    cfg = write_config(tmp / f"sup-{n}.toml",
                       supervisor={"runtime_dir": str(run), "log_dir": str(tmp / "logs"), "log_level": "warning",
                                   "state_dir": str(tmp / f"state-{n}")},  # each run its own journal
                       health_check={"first_wait": 30.0, "interval": 1.0, "timeout": 0.9},
                       engines=engines)
    d = Daemon(cfg)
    try:
        client = SupervisorClient(str(run / "supervisor.sock"))
        deadline = time.time() + 60
        while n and client.status()["routable"] < n:
            if d.proc.poll() is not None or time.time() > deadline:  # not timed on a fleet it does not hold
                raise RuntimeError(f"{n} stand-ins: {client.status()['routable'] if d.proc.poll() is None else 'the daemon exited'}"
                                   f" routable after 60 s; daemon log tail: {d.raw[-1:]}")
            time.sleep(0.5)
        time.sleep(1.0)  # the heartbeat in its steady state
        return time_calls(client, calls)
    finally:
        d.kill()
        if standins:
            standins.kill()
            standins.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, nargs="+", default=[0, 64, 256])
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        b_round, b_status = bare_baseline(args.calls, tmp)
        print(f"control-socket latency, {args.calls} calls each; baseline: bare aiohttp Unix-socket handler")
        print(f"{'engines probed':>14} {'call':>7} {'p50 ms':>8} {'p99 ms':>8} {'bare p50':>9} {'bare p99':>9} "
              f"{'ratio p50':>9} {'ratio p99':>9}")
        failed = {}
        for n in args.engines:
            try:
                rounds, status = daemon_with_standins(n, args.calls, tmp)
            except Exception as e:  # noqa: BLE001  (printed; the other sizes still run)
                failed[n] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                print(f"{n:>14} FAILED: {failed[n]}", flush=True)
                continue
            for name, xs, bs in (("round", rounds, b_round), ("status", status, b_status)):
                p50, p99, bp50, bp99 = (pct(xs, .5), pct(xs, .99), pct(bs, .5), pct(bs, .99))
                print(f"{n:>14} {name:>7} {p50 * 1e3:8.2f} {p99 * 1e3:8.2f} {bp50 * 1e3:9.2f} {bp99 * 1e3:9.2f} "
                      f"{p50 / bp50:9.2f} {p99 / bp99:9.2f}", flush=True)
        print(f"(cpu count {os.cpu_count()}; median of bare status {statistics.median(b_status) * 1e3:.2f} ms)")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
