"""PROTOCOL STAND-INS for vLLM engines (tests only; not vLLM): for faults and scales real
engines cannot be made to show here. Every one is the emulated engine
(harness/emulated_engine.py), and every behaviour they stand in for is also tested against
real engines (tests/engine).

- scripts the daemon spawns as its `python` (give it `standin_python(folder, SCRIPT)` from
  vime.harness.local_daemon): STANDIN_GROUP (a process group with an EngineCore-like child
  and fault modes), STANDIN_VERSIONED (the client tests'), STANDIN_CTL (supervisorctl's);
- `standin_server`: protocol-only emulated engines as someone else's server an engine is
  attached to;
- `AttachedStandIns`: attached emulated engines in this process that can be reloaded from a
  checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

from aiohttp import web

from vime.harness import emulated_engine
from vime.harness.local_daemon import free_port

HERE = Path(__file__).resolve().parent
STANDIN_GROUP = HERE / "standin_group.py"
STANDIN_VERSIONED = HERE / "standin_versioned.py"
STANDIN_CTL = HERE / "standin_ctl.py"


@contextlib.contextmanager
def standin_server(port: int) -> Iterator[str]:
    """A protocol-only emulated engine serving on `port`: its URL once it is up; killed on the way out."""
    proc = subprocess.Popen([sys.executable, emulated_engine.__file__, "--base-port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith(b"ready"), "the stand-in did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


class AttachedStandIns:
    """n attached emulated engines on one event loop in a thread, answering at once except
    /collective_rpc reload_weights, which takes `reload_s`; each records when its reload
    started and ended (`reloads`: (index, start, end))."""

    def __init__(self, n: int, reload_s: float = 0.0):
        self.n, self.reload_s = n, reload_s
        self.ports = [free_port() for _ in range(n)]
        self.reloads: list[tuple[int, float, float]] = []
        self.loop = asyncio.new_event_loop()
        self._runners: list[web.AppRunner] = []
        # Time scale 1 with every duration 0 but the reload's: model_bytes at 1 GB/s = reload_s.
        zero = {k: 0.0 for k in ("boot_s", "first_batch_s", "step_base_s", "step_per_seq_s", "prefill_token_s")}
        self.emulated = [emulated_engine.EmulatedEngine(
            time_scale=1.0, exit_on_death=False,
            params={**zero, "model_bytes": max(reload_s, 1e-9) * 1e9, "reload_bytes_per_s": 1e9}) for _ in range(n)]
        for i, e in enumerate(self.emulated):
            e.on_reload = lambda t0, t1, i=i: self.reloads.append((i, t0, t1))
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        assert ready.wait(30), f"{n} stand-ins did not all listen within 30 s (a port taken since free_port?)"

    @property
    def versions(self) -> list[str]:
        return [e.label for e in self.emulated]

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def up():
            for i, port in enumerate(self.ports):
                runner = web.AppRunner(self.emulated[i].app(), access_log=None)
                await runner.setup()
                for _ in range(5):  # a port free when picked may be taken since (other tests)
                    try:
                        await web.TCPSite(runner, "127.0.0.1", self.ports[i]).start()
                        break
                    except OSError:
                        self.ports[i] = free_port()
                self._runners.append(runner)
                self.emulated[i].start()

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
