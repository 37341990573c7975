"""A PROTOCOL STAND-IN for a vLLM server's process group, for faults vLLM cannot be made to show
on demand (tests only; every behaviour here is also tested against real engines).

Run by the daemon in place of the engine's interpreter (config `python = <this file>`), it
takes the spawn command line (`-m vllm.entrypoints.openai.api_server --model M --port P`),
serves /health, /v1/completions, /metrics (counters that never move unless it answers),
/weight_info and /is_paused, and forks a child titled like vLLM's EngineCore into its own
process group. A mode file (env STANDIN_MODE_FILE, re-read at every request) says how it acts:

    ok          answer everything at once
    busy        completions hang while the core burns CPU (a compile: no counter moves)
    hang        completions hang, the core idles (the test SIGSTOPs it: a hung EngineCore)
    paused      completions hang, /is_paused says true (vLLM 0.32 queues while paused)
    silent      /health never answers (a start that cannot finish inside first_wait)
    deaf        as ok, and SIGTERM is ignored by the whole group (a stop that outlives it)
    reject      completions with logprobs answer 400 (a warm-up the engine refuses)
    version=X   as ok, /weight_info answers weight_version X (an engine's untrusted answer)
    weights_down  as ok, /weight_info answers 503 (a route that cannot be read now)

With STANDIN_CONNECTION_CLOSE=1 every answer closes its connection (each probe opens a new one:
what a daemon out of descriptors cannot do).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal

from aiohttp import web

from standin_cli import engine_args


def mode() -> str:
    try:
        with open(os.environ["STANDIN_MODE_FILE"]) as f:
            return f.read().strip() or "ok"
    except OSError:
        return "ok"


def core(pipe_path: str) -> None:
    """The 'EngineCore': idles, or burns CPU while the mode is busy."""
    try:
        import setproctitle

        setproctitle.setproctitle("VLLM::EngineCore")
    except ImportError:
        pass
    if mode() == "deaf":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(pipe_path, "w") as f:
        f.write(str(os.getpid()))
    import time

    while True:
        if mode() == "busy":
            end = time.monotonic() + 0.2
            while time.monotonic() < end:
                pass
        else:
            time.sleep(0.05)


async def main() -> None:
    args = engine_args()
    if mode() == "deaf":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pid_file = os.environ["STANDIN_MODE_FILE"] + f".core.{os.getpid()}"
    child = multiprocessing.get_context("fork").Process(target=core, args=(pid_file,), daemon=True)
    child.start()
    served = 0

    async def health(_):
        if mode() == "silent":
            await asyncio.sleep(3600)
        return web.Response()

    async def completions(request):
        nonlocal served
        m = mode()
        body = await request.json()
        if m in ("busy", "hang", "paused"):
            while mode() == m:
                await asyncio.sleep(0.05)
        if m == "reject" and body.get("logprobs"):
            return web.json_response({"error": {"message": "logprobs not allowed here (stand-in)"}}, status=400)
        served += 1
        return web.json_response({"choices": [{"text": "x", "finish_reason": "length"}],
                                  "usage": {"completion_tokens": 1}})

    async def metrics(_):
        return web.Response(text=f'vllm:generation_tokens_total{{engine="0"}} {float(served)}\n'
                                 'vllm:num_requests_running{engine="0"} 0.0\n')

    async def weight_info(_):
        m = mode()
        if m == "weights_down":
            return web.json_response({"error": "unavailable (stand-in)"}, status=503)
        return web.json_response({"weight_version": m[len("version="):] if m.startswith("version=") else "default"})

    async def is_paused(_):
        return web.json_response({"is_paused": mode() == "paused"})

    @web.middleware
    async def closing(request, handler):
        resp = await handler(request)
        resp.force_close()
        return resp

    app = web.Application(middlewares=[closing] if os.environ.get("STANDIN_CONNECTION_CLOSE") == "1" else [])
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/weight_info", weight_info)
    app.router.add_get("/is_paused", is_paused)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    print(json.dumps({"standin": "ready", "pid": os.getpid(), "core": child.pid}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
