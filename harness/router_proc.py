"""A real vllm-router (PyPI vllm-router 0.1.17) as a child process, for tests and bench/router.py.

Its flags are vime's: the circuit breaker off (long RL generations trip it on healthy engines),
a 4-hour request timeout; round_robin instead of vime's cache_aware, so that steady load
reaches both engines of a test whatever the prompts. Its own health checker keeps its defaults
(60 s interval) unless `extra` says otherwise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Awaitable, Callable, Self, TypeVar

import aiohttp

from vime.supervisor.router import RouterError
from vime.supervisor.router.vllm_router import VllmRouter

T = TypeVar("T")

VIME_FLAGS = ("--disable-circuit-breaker", "--request-timeout-secs", "14400", "--policy", "round_robin")


def router_binary() -> str:
    """vllm-router beside this interpreter (the venv's), else on PATH."""
    here = Path(sys.executable).parent / "vllm-router"
    found = str(here) if here.exists() else shutil.which("vllm-router")
    if not found:
        raise FileNotFoundError("vllm-router is not installed: pip install 'vime-supervisor[router]'")
    return found


class RouterProc:
    name = "vllm-router"  # in the error when it does not start

    def __init__(self, port: int, log: Path, *extra: str):
        self.port, self.log_path, self.extra = port, log, extra
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        # Its own metrics listener: the default port (29000) would clash between routers.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.prometheus_port = s.getsockname()[1]

    def command(self) -> list[str]:
        return [router_binary(), "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *VIME_FLAGS,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port), *self.extra]

    def env(self) -> dict[str, str]:
        return {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")}

    def start(self, timeout: float = 30.0) -> Self:
        """Spawn `command()` and wait until its /workers answers (RuntimeError if it exits or
        `timeout` s pass first)."""
        argv = self.command()
        log = open(self.log_path, "ab")
        # Its own group in our session: one scheduling autogroup with the daemon and the
        # engines (vime.supervisor.engine.process says why).
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, process_group=0,
                                     env=self.env())
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.workers()
                return self
            except RouterError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} did not start; see {self.log_path}") from None
                time.sleep(0.1)

    # The admin calls go through the daemon's own adapter (one /workers client for the daemon,
    # the harness and the bench), run to completion from synchronous code.
    def admin(self, call: Callable[[VllmRouter], Awaitable[T]]) -> T:
        async def run() -> T:
            async with aiohttp.ClientSession() as session:
                return await call(VllmRouter(self.url, session))
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(run())
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called from a coroutine: a loop of its own
            return pool.submit(asyncio.run, run()).result()

    def workers(self, timeout: float = 5.0) -> list[str]:
        return self.admin(lambda r: r.workers(timeout))

    def listing(self, timeout: float = 5.0) -> dict[str, bool]:
        """{url: is_healthy} as the router lists them."""
        return self.admin(lambda r: r.listing(timeout))

    def add(self, worker: str, timeout: float = 10.0) -> None:
        """POST /workers (blocks until the worker answers /health); RouterError if refused."""
        self.admin(lambda r: r.add(worker, timeout))

    def remove(self, worker: str, timeout: float = 10.0) -> None:
        """DELETE /workers/URL; one the router does not have is not an error."""
        self.admin(lambda r: r.remove(worker, timeout))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
