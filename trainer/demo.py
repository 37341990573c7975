"""The demo: a real RL loop on two vLLM engines under the daemon, with faults injected.

    make demo                   (or: python -m trainer.demo --out demo-run)

1. builds the tiny Llama (trainer/tiny_model.py) and writes a config for two engines that
   accept weight pushes (gloo on CPU);
2. starts `python -m supervisor` as a plain child process and waits until both are RUNNING;
3. runs the RL loop (trainer/rl_loop.py): rollouts through the daemon's routing, reward,
   a policy-gradient step, the new weights pushed into the engines, versions published, with
   a kill -9 (step --kill-at), a SIGSTOPped EngineCore (--hang-at) and a push that fails
   midway (--fail-push-at);
4. shows `supervisorctl status`, stops the daemon (SIGTERM: every engine stopped) and checks
   that no engine process is left.
Everything (config, daemon log, engine logs, incidents, trace.json, summary.json, dumps)
stays in --out. Any rl_loop flag after `--` goes to the loop.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from trainer.local_daemon import ENGINE_ARGS, ENGINE_ENV, GLOO, Daemon, free_port, live_pids_in_groups, write_config
from trainer.tiny_model import build_tiny_model

BOOT = 300.0


def _say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def demo_config(out: Path, model: Path, *, engines: int = 2, interval: float = 1.0, timeout: float = 2.0,
                threshold: int = 2, models: dict[str, Path] | None = None, **sections: dict) -> Path:
    """The daemon config the demo (and its tests and the soak) runs: fast probes, engines
    engine-0.. on this host. `models` gives an engine its own model path; `sections` adds
    tables (e.g. restart={...})."""
    cpus = max(1, os.cpu_count() or 1)
    names = [f"engine-{i}" for i in range(engines)]
    return write_config(
        out / "supervisor.toml",
        supervisor={"runtime_dir": str(out / "run"), "log_dir": str(out / "logs"), "stop_timeout": 5.0,
                    "min_healthy": 1, "sync_timeout": 60.0},
        health_check={"first_wait": BOOT, "interval": interval, "timeout": timeout,
                      "failure_threshold": threshold},
        **sections,
        engine_defaults={"args": ENGINE_ARGS + GLOO, "env": ENGINE_ENV},
        engines=[{"name": n, "model": str((models or {}).get(n, model)), "served_model_name": "tiny",
                  "port": free_port(), "env": {"VLLM_CPU_OMP_THREADS_BIND": str(i % cpus)}}
                 for i, n in enumerate(names)],
    )


def run(out: Path, loop_argv: list[str], *, engines: int, interval: float, timeout: float, threshold: int) -> int:
    from trainer.rl_loop import RLLoop, build_parser, format_report, quiet_rollout_log

    quiet_rollout_log()

    out.mkdir(parents=True, exist_ok=True)
    _say(f"building the tiny model in {out / 'model'}")
    model = build_tiny_model(out / "model")
    cfg = demo_config(out, model, engines=engines, interval=interval, timeout=timeout, threshold=threshold)
    sock = out / "run" / "supervisor.sock"
    _say(f"starting the daemon: python -m supervisor --config {cfg}")
    log_file = open(out / "daemon.log", "w")
    daemon = Daemon(cfg, tee=log_file)
    ok = False
    try:
        for i in range(engines):
            ev = daemon.transition(f"engine-{i}", "RUNNING", BOOT)
            _say(f"engine-{i} RUNNING ({ev['reason']})")
        args = build_parser().parse_args(["--model", str(model), "--socket", str(sock), "--out", str(out),
                                          "--save-debug-rollout-data", str(out / "dumps" / "{rollout_id}.jsonl"),
                                          *loop_argv])
        _say("running the RL loop: " + " ".join(loop_argv or ["(defaults)"]))
        report = RLLoop(args).run()
        print(format_report(report))
        env = {**os.environ, "VIME_SUPERVISOR_SOCKET": str(sock)}
        print("\n$ supervisorctl status")
        st = subprocess.run([str(Path(sys.executable).parent / "supervisorctl"), "status"], env=env,
                            capture_output=True, text=True)
        print(st.stdout + st.stderr, end="")
        ok = (report.rounds_lost == 0 and report.stale_responses == 0
              and all(f.resynced_at is not None for f in report.faults)
              and all(e["weight_version"] == report.final_version for e in report.engines.values()))
    finally:
        pids = set(daemon.spawned_pids())
        _say("SIGTERM to the daemon")
        rc = daemon.terminate(60)
        left = live_pids_in_groups(pids)
        log_file.close()
    print(f"\ndaemon exit status {rc}; engine processes left {len(left)}")
    print(f"config, daemon log, engine logs, trace.json (Perfetto), summary.json, dumps: {out}")
    (out / "demo.json").write_text(json.dumps({"ok": ok, "daemon_exit": rc, "processes_left": len(left)}))
    return 0 if ok and rc == 0 and not left else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    loop_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("demo-run"))
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--failure-threshold", type=int, default=2)
    args = ap.parse_args(argv)
    loop_argv = loop_argv or ["--num-rollout", "30", "--kill-at", "3", "--hang-at", "12", "--fail-push-at", "21"]
    return run(args.out.resolve(), loop_argv, engines=args.engines, interval=args.interval, timeout=args.timeout,
               threshold=args.failure_threshold)


if __name__ == "__main__":
    sys.exit(main())
