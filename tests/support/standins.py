"""PROTOCOL STAND-INS for vLLM engines (tests only; not vLLM): for faults and scales real
engines cannot be made to show here. Every behaviour they stand in for is also tested against
real engines (tests/engine).

- scripts the daemon spawns as its `python` (give it `standin_python(folder, SCRIPT)` from
  vime.harness.local_daemon): STANDIN_GROUP (a process group with an EngineCore-like child
  and fault modes), STANDIN_VERSIONED (the client tests'), STANDIN_CTL (supervisorctl's);
- `standin_server`: harness/standin_engine.py as someone else's server an engine is attached to;
- `AttachedStandIns`: attached stand-ins in this process that can be reloaded from a checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

from aiohttp import web

from vime.harness import standin_engine
from vime.harness.local_daemon import free_port

HERE = Path(__file__).resolve().parent
STANDIN_GROUP = HERE / "standin_group.py"
STANDIN_VERSIONED = HERE / "standin_versioned.py"
STANDIN_CTL = HERE / "standin_ctl.py"


@contextlib.contextmanager
def standin_server(port: int) -> Iterator[str]:
    """harness/standin_engine.py serving on `port`: its URL once it is up; killed on the way out."""
    proc = subprocess.Popen([sys.executable, standin_engine.__file__, "--base-port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith(b"ready"), "the stand-in did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


class AttachedStandIns:
    """n attached-engine stand-ins on one event loop in a thread. reload_weights takes
    `reload_s`; each one records when its reload started and ended."""

    def __init__(self, n: int, reload_s: float = 0.0):
        self.n, self.reload_s = n, reload_s
        self.ports = [free_port() for _ in range(n)]
        self.versions = ["default"] * n
        self.reloads: list[tuple[int, float, float]] = []
        self.loop = asyncio.new_event_loop()
        self._runners: list[web.AppRunner] = []
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        assert ready.wait(30), f"{n} stand-ins did not all listen within 30 s (a port taken since free_port?)"

    def _app(self, i: int) -> web.Application:
        async def ok(_):
            return web.json_response({})

        async def completions(_):
            return web.json_response({"choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

        async def metrics(_):
            return web.Response(text='vllm:generation_tokens_total{engine="0"} 1.0\n'
                                     'vllm:num_requests_running{engine="0"} 0.0\n')

        async def weight_info(_):
            return web.json_response({"weight_version": self.versions[i]})

        async def rpc(_):
            t0 = time.monotonic()
            await asyncio.sleep(self.reload_s)
            self.reloads.append((i, t0, time.monotonic()))
            return web.json_response({"results": [None]})

        async def update(request):
            self.versions[i] = (await request.json())["new_version"]
            return web.json_response({})

        app = web.Application()
        app.add_routes([web.get("/health", ok), web.post("/v1/completions", completions), web.get("/metrics", metrics),
                        web.get("/weight_info", weight_info), web.post("/pause", ok), web.post("/resume", ok),
                        web.post("/collective_rpc", rpc), web.post("/update_weight_version", update)])
        return app

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def up():
            for i, port in enumerate(self.ports):
                runner = web.AppRunner(self._app(i), access_log=None)
                await runner.setup()
                for _ in range(5):  # a port free when picked may be taken since (other tests)
                    try:
                        await web.TCPSite(runner, "127.0.0.1", self.ports[i]).start()
                        break
                    except OSError:
                        self.ports[i] = free_port()
                self._runners.append(runner)

        self.loop.run_until_complete(up())
        ready.set()
        self.loop.run_forever()

    def engines(self) -> list[dict]:
        return [{"name": f"s{i}", "url": f"http://127.0.0.1:{p}"} for i, p in enumerate(self.ports)]

    def close(self) -> None:
        async def down():
            for r in self._runners:
                await r.cleanup()

        asyncio.run_coroutine_threadsafe(down(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
