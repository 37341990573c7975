"""Check FleetSender(backend="nccl") on a multi-GPU host: the GPU fleet path, never run here.

This project's machines have no GPU, and a lent GPU machine holds one (NCCL refuses two ranks on
one device), so the NCCL fleet push is checked in CI only up to the collective
(tests/unit/test_nccl_entry.py). This script runs the collective: N vLLM engines on GPUs 1..N
(one each, ``--weight-transfer-config '{"backend":"nccl"}'``, dev mode, random weights:
``--load-format dummy``), the trainer on GPU 0 holding the model's real weights, one
`FleetSender(backend="nccl")` push into all of them (vLLM's trainer-side API: one NCCL group
over every receiver, each at its own rank offset), twice (the group is kept), then a push with
one engine SIGSTOPped mid-transfer (no stall window on NCCL: the deadline finds it).

Checked: every engine reads the version back, and its greedy completions match an engine that
loaded the same weights from disk (bit for bit at fp32) and differ from its random start; the
faulted push ends within its announced bound with the stopped engine reported.
A reference engine (same weights, loaded from disk) shares GPU 0 with the trainer.

    python bench/check_nccl_fleet.py --model facebook/opt-125m --engines 2

Exit status 0 when every check passed; each line says what it checked.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PROMPTS = ["The capital of France is", "def fibonacci(n):", "One, two, three,"]


def engine(model: str, gpu: int, log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    from vime.harness.local_daemon import free_port

    port = free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "VLLM_SERVER_DEV_MODE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                             "--port", str(port), "--dtype", "float32", "--enforce-eager",
                             "--max-model-len", "512", "--gpu-memory-utilization", "0.5", *extra],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, process_group=0)
    return proc, f"http://127.0.0.1:{port}"


def greedy(url: str) -> list[str]:
    out = []
    for p in PROMPTS:
        req = urllib.request.Request(url + "/v1/completions", method="POST",
                                     data=json.dumps({"model": "m", "prompt": p, "max_tokens": 12,
                                                      "temperature": 0}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out.append(json.loads(r.read())["choices"][0]["text"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True, help="a small HF causal LM (name or path)")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--logs", default="nccl-fleet-logs")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from vime.harness.local_daemon import wait_healthy
    from vime.weight_sync.broadcast import FleetSender

    if torch.cuda.device_count() < args.engines + 1:
        print(f"needs {args.engines + 1} GPUs (the trainer's and one per engine), "
              f"found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    nccl = ["--weight-transfer-config", '{"backend":"nccl"}', "--load-format", "dummy",
            "--served-model-name", "m"]
    procs = [engine(args.model, k + 1, logs / f"engine-{k}.log", *nccl) for k in range(args.engines)]
    ref = None
    failed = 0

    def check(ok: bool, what: str) -> None:
        nonlocal failed
        failed += not ok
        print(("ok   " if ok else "FAIL ") + what, flush=True)

    try:
        for p, url in procs:
            if not wait_healthy(url, 900, p):
                print(f"{url} did not start: {logs}", file=sys.stderr)
                return 1
        urls = [u for _, u in procs]
        before = {u: greedy(u) for u in urls}
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).to("cuda:0")
        bounds: list[float] = []
        with FleetSender(backend="nccl", announce=lambda rs, nb, bound: bounds.append(bound)) as fs:
            for v in (1, 2):
                res = fs.push(urls, model, v)
                check(all(r.ok for r in res.values()), f"push {v} into {len(urls)}: "
                      + ", ".join(f"{r.status} {r.seconds:.2f}s" for r in res.values()))
            check(fs.group_inits == 1, f"one group over every receiver, kept: {fs.group_inits} built")
            # A reference engine with the same weights from disk (the GPU after the last).
            ref = engine(args.model, 0, logs / "reference.log", "--served-model-name", "m")
            check(wait_healthy(ref[1], 900, ref[0]), "the reference engine started")
            want = greedy(ref[1])
            for u in urls:
                got = greedy(u)
                check(got == want and got != before[u], f"{u}: greedy completions equal the disk-loaded "
                      f"reference's and differ from its random start")
            victim = procs[-1][0]
            seen: dict[str, float] = {}

            def progress(step, info):
                if step == "start_weight_update" and "at" not in seen:
                    seen["at"] = time.monotonic()
                    os.killpg(victim.pid, signal.SIGSTOP)

            fs.progress = progress
            t0 = time.monotonic()
            try:
                res = fs.push(urls, model, 3)
            finally:
                os.killpg(victim.pid, signal.SIGCONT)
            took = time.monotonic() - t0
            check(took <= bounds[-1], f"the faulted push took {took:.1f}s, within its bound {bounds[-1]:.1f}s")
            check(not res[urls[-1]].ok, f"the stopped engine reported: {res[urls[-1]].status}")
    finally:
        for p, _ in procs + ([ref] if ref else []):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    print(f"{'all checks passed' if not failed else f'{failed} check(s) failed'}; logs in {logs}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
