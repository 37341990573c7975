"""A real vllm-router (PyPI vllm-router 0.1.17) as a child process, for tests and bench/router.py.

Its flags are vime's: the circuit breaker off (long RL generations trip it on healthy engines),
a 4-hour request timeout; round_robin instead of vime's cache_aware, so that steady load
reaches both engines of a test whatever the prompts. Its own health checker keeps its defaults
(60 s interval) unless `extra` says otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

VIME_FLAGS = ("--disable-circuit-breaker", "--request-timeout-secs", "14400", "--policy", "round_robin")


def router_binary() -> str:
    """vllm-router beside this interpreter (the venv's), else on PATH."""
    here = Path(sys.executable).parent / "vllm-router"
    found = str(here) if here.exists() else shutil.which("vllm-router")
    if not found:
        raise FileNotFoundError("vllm-router is not installed: pip install 'vime-supervisor[router]'")
    return found


class RouterProc:
    def __init__(self, port: int, log: Path, *extra: str):
        self.port, self.log_path, self.extra = port, log, extra
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        # Its own metrics listener: the default port (29000) would clash between routers.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.prometheus_port = s.getsockname()[1]

    def start(self, timeout: float = 30.0) -> "RouterProc":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [router_binary(), "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *VIME_FLAGS,
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port), *self.extra],
            # Its own group in our session: one scheduling autogroup with the daemon and the
            # engines (vime.supervisor.engine.process says why).
            stdout=log, stderr=subprocess.STDOUT, process_group=0,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")})
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.workers()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vllm-router did not start; see {self.log_path}") from None
                time.sleep(0.1)

    def workers(self) -> list[str]:
        with urllib.request.urlopen(self.url + "/workers", timeout=5) as r:
            return [w["url"] for w in json.load(r)["workers"]]

    def add(self, worker: str, timeout: float = 10.0) -> int:
        req = urllib.request.Request(self.url + "/workers", method="POST",
                                     data=json.dumps({"url": worker, "worker_type": "regular"}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
