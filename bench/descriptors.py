"""The daemon's open descriptors against limits.nofile_needed(), the estimate that
--check-config holds the open-file limit to.

A daemon supervises N engine stand-ins (harness/standin_engine.py: the protocol, not vLLM;
hundreds of real servers do not fit here), attached (one stand-in process serving N ports) or
spawned (one stand-in process per engine, started by the daemon as it starts vLLM). Its
/proc/PID/fd is counted every 20 ms from start to 8 s after READY=1 (every first start and
warm-up done). The ratio is the peak over the estimate: below 1 means the check is on the safe
side.

    python bench/descriptors.py [--attached 1 50 200] [--spawned 20 50] [--warmup 8]
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

from vime.harness.local_daemon import Daemon, write_config  # noqa: E402
from vime.harness.standin_engine import free_port_range  # noqa: E402
from vime.supervisor.limits import nofile_needed  # noqa: E402

FAKE = f"""#!{sys.executable}
# Stands in for `python -m vllm.entrypoints.openai.api_server ... --port P` (bench only).
import asyncio, sys
from vime.harness import standin_engine
port = int(sys.argv[sys.argv.index("--port") + 1])
async def main():
    await standin_engine.serve(port, 1)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def measure(tmp: Path, n: int, mode: str, warmup: int) -> tuple[int, int]:
    """(peak, steady) descriptors of the daemon."""
    tmp.mkdir(parents=True, exist_ok=True)
    base = free_port_range(n)
    sup = {"runtime_dir": str(tmp / "run"), "log_dir": str(tmp / "logs"), "state_dir": str(tmp / "state"),
           "stop_timeout": 2.0}
    standin = None
    if mode == "attached":
        standin = subprocess.Popen([sys.executable, str(ROOT / "harness" / "standin_engine.py"), "--base-port",
                                    str(base), "--count", str(n)], stdout=subprocess.PIPE)
        assert standin.stdout.readline().startswith(b"ready")
        engines = [{"name": f"e{i}", "url": f"http://127.0.0.1:{base + i}", "served_model_name": "tiny"}
                   for i in range(n)]
    else:
        fake = tmp / "fake-python"
        fake.write_text(FAKE)
        fake.chmod(0o755)
        (tmp / "model").mkdir(exist_ok=True)
        (tmp / "model" / "config.json").write_text("{}")
        sup["python"] = str(fake)
        engines = [{"name": f"e{i}", "model": str(tmp / "model"), "port": base + i, "served_model_name": "tiny"}
                   for i in range(n)]
    cfg = write_config(tmp / "sup.toml", supervisor=sup,
                       health_check={"first_wait": 120.0, "interval": 1.0, "timeout": 0.8, "failure_threshold": 3},
                       warmup={"requests": warmup}, engines=engines)
    d = Daemon(cfg)
    peak = steady = 0
    try:
        t0 = time.monotonic()
        t_ready = None
        while time.monotonic() - t0 < 150:
            if d.proc.poll() is not None:
                raise RuntimeError(f"{mode} x {n}: the daemon exited with status {d.proc.returncode}: {d.raw[-2:]}")
            peak = max(peak, len(os.listdir(f"/proc/{d.proc.pid}/fd")))
            if t_ready is None and any(e.get("event") == "supervisor.ready" for e in list(d.events)):
                t_ready = time.monotonic()
            if t_ready is not None and time.monotonic() - t_ready > 8:
                break
            time.sleep(0.02)
        if t_ready is None:
            raise RuntimeError(f"{mode} x {n}: not READY within 150 s")
        steady = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
    finally:
        d.terminate(60)
        if standin is not None:
            standin.kill()
            standin.wait()
    return peak, steady


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attached", type=int, nargs="*", default=[1, 50, 200])
    ap.add_argument("--spawned", type=int, nargs="*", default=[20, 50])
    ap.add_argument("--warmup", type=int, default=8)
    args = ap.parse_args()
    failed = 0
    print(f"the daemon's descriptors, start to 8 s after READY=1 (warm-up {args.warmup} requests), "
          "against nofile_needed(), what --check-config and the daemon hold the limit to", flush=True)
    print(f"{'engines':>14} {'peak':>6} {'steady':>7} {'estimate':>9} {'peak/estimate':>14}", flush=True)
    with tempfile.TemporaryDirectory() as t:
        for mode, counts in (("attached", args.attached), ("spawned", args.spawned)):
            for n in counts:
                need = nofile_needed(0, attached=n) if mode == "attached" else nofile_needed(n, args.warmup)
                try:
                    peak, steady = measure(Path(t) / f"{mode}-{n}", n, mode, args.warmup)
                except Exception as e:  # noqa: BLE001  (printed; the other rows still run)
                    failed += 1
                    print(f"{f'{n} {mode}':>14} FAILED: {type(e).__name__}: {e}", flush=True)
                    continue
                print(f"{f'{n} {mode}':>14} {peak:6d} {steady:7d} {need:9d} {peak / need:14.2f}", flush=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
