"""The engine command line a protocol stand-in script accepts: the daemon spawns it as its
`python` with vLLM's (`-m vllm.entrypoints.openai.api_server --model M --host H --port P`).
The stand-in scripts beside this file import it (a script's folder is on its sys.path)."""

from __future__ import annotations

import argparse


def engine_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m")
    ap.add_argument("--model")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args, _ = ap.parse_known_args()
    return args
