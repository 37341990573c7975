"""The demo: the daemon supervising two real vLLM engines on a tiny model, a kill and a hang.

    make demo                       (or: python -m trainer.demo --out demo-run)

1. builds the tiny Llama (trainer/tiny_model.py) and writes a config for two engines;
2. starts `python -m supervisor` as a plain child process and waits until both are RUNNING;
3. kill -9 of engine-0's server: seen at once, restarted, RUNNING again;
4. SIGSTOP of engine-1's VLLM::EngineCore (its /health still says 200): caught by the deep
   probe, stopped, restarted, RUNNING again;
5. SIGTERM to the daemon: every engine stopped, no process left; a summary is printed.
Everything (config, daemon log, engine logs) stays in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path

from trainer.local_daemon import (
    ENGINE_ARGS,
    ENGINE_ENV,
    Daemon,
    child_pids,
    free_port,
    live_pids_in_groups,
    write_config,
)
from trainer.tiny_model import build_tiny_model

BOOT = 300.0


def _ts(ev: dict) -> float:
    return datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()


def _say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _complete(port: int) -> str:
    body = json.dumps({"model": "tiny", "prompt": "the quick brown", "max_tokens": 6, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["choices"][0]["text"]


def run(out: Path, interval: float, timeout: float, threshold: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    _say(f"building the tiny model in {out / 'model'}")
    model = build_tiny_model(out / "model")
    ports = [free_port(), free_port()]
    cfg = write_config(
        out / "supervisor.toml",
        supervisor={"runtime_dir": str(out / "run"), "log_dir": str(out / "logs"), "stop_timeout": 5.0,
                    "min_healthy": 1},
        health_check={"first_wait": BOOT, "interval": interval, "timeout": timeout,
                      "failure_threshold": threshold},
        engine_defaults={"args": ENGINE_ARGS, "env": ENGINE_ENV},
        engines=[
            {"name": f"engine-{i}", "model": str(model), "served_model_name": "tiny", "port": port,
             "env": {"VLLM_CPU_OMP_THREADS_BIND": str(i % max(1, os.cpu_count() or 1))}}
            for i, port in enumerate(ports)
        ],
    )
    _say(f"starting the daemon: python -m supervisor --config {cfg}")
    log_file = open(out / "daemon.log", "w")
    daemon = Daemon(cfg, tee=log_file)
    rows: list[tuple[str, str]] = []
    try:
        for name in ("engine-0", "engine-1"):
            ev = daemon.transition(name, "RUNNING", BOOT)
            _say(f"{name} RUNNING ({ev['reason']})")
        _say(f"engine-0 says: {_complete(ports[0])!r}")

        # A death: kill -9 of the API server.
        pid = daemon.last_pid("engine-0")
        mark, t0 = daemon.mark(), time.time()
        _say(f"kill -9 engine-0's server (pid {pid})")
        os.kill(pid, signal.SIGKILL)
        exited = daemon.transition("engine-0", "EXITED", 30, after=mark)
        _say(f"engine-0 EXITED after {_ts(exited) - t0:.2f}s: {exited['reason']}")
        back = daemon.transition("engine-0", "RUNNING", BOOT, after=mark)
        _say(f"engine-0 RUNNING again after {_ts(back) - t0:.1f}s (incarnation {back['incarnation']})")
        rows += [("kill -9 -> EXITED (detected)", f"{_ts(exited) - t0:.2f}s"),
                 ("kill -9 -> RUNNING (restarted)", f"{_ts(back) - t0:.1f}s")]

        # A hang: SIGSTOP of the EngineCore. /health keeps saying 200.
        server = daemon.last_pid("engine-1")
        core = child_pids(server, "VLLM::EngineCor")[0]
        mark, t0 = daemon.mark(), time.time()
        _say(f"SIGSTOP engine-1's VLLM::EngineCore (pid {core}); its /health still answers 200")
        os.kill(core, signal.SIGSTOP)
        sick = daemon.transition("engine-1", "UNHEALTHY", 60, after=mark)
        _say(f"engine-1 UNHEALTHY after {_ts(sick) - t0:.2f}s: {sick['reason']}")
        back = daemon.transition("engine-1", "RUNNING", BOOT, after=mark)
        _say(f"engine-1 RUNNING again after {_ts(back) - t0:.1f}s (incarnation {back['incarnation']})")
        rows += [(f"SIGSTOP -> UNHEALTHY (bound {interval + timeout * threshold:g}s)", f"{_ts(sick) - t0:.2f}s"),
                 ("SIGSTOP -> RUNNING (restarted)", f"{_ts(back) - t0:.1f}s")]
        _say(f"engine-1 says: {_complete(ports[1])!r}")
    finally:
        pids = set(daemon.spawned_pids())
        _say("SIGTERM to the daemon")
        rc = daemon.terminate(60)
        left = live_pids_in_groups(pids)
        log_file.close()
    rows += [("daemon exit status", str(rc)), ("engine processes left", str(len(left)))]
    print("\nsummary")
    for what, value in rows:
        print(f"  {what:<40}{value}")
    print(f"\nconfig, daemon log and engine logs: {out}")
    return 0 if rc == 0 and not left else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("demo-run"))
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--failure-threshold", type=int, default=2)
    args = ap.parse_args(argv)
    return run(args.out.resolve(), args.interval, args.timeout, args.failure_threshold)


if __name__ == "__main__":
    sys.exit(main())
