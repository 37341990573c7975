"""A real SMG (PyPI smg 1.13.0, `smg launch`) as a child process, for the tests that drive it
directly (not spawned by the daemon); or sglang-router 0.3.2 (`python -m
sglang_router.launch_router`) where that package can be imported. The two cannot share one
environment: sglang-router's wheel installs console scripts named `smg` and `amg` too, over
SMG's. Flags: vime's (breaker off, a 4-hour request timeout, as for vllm-router), round_robin
so that load reaches every engine, metrics on a port of its own on loopback."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from vime.harness.local_daemon import free_port

VIME_FLAGS = ("--disable-circuit-breaker", "--request-timeout-secs", "14400", "--policy", "round_robin")


def smg_binary() -> str | None:
    here = Path(sys.executable).parent / "smg"
    return str(here) if here.exists() else shutil.which("smg")


def available(kind: str) -> str | None:
    """Why `kind` cannot be run here, or None if it can."""
    if kind == "smg":
        return None if smg_binary() else "smg is not installed: pip install 'vime-supervisor[router]'"
    if importlib.util.find_spec("sglang_router") is None:
        return ("sglang-router 0.3.2 is not importable (not in the test extra: its wheel overwrites SMG's `smg` "
                "script); put its unpacked wheel on PYTHONPATH to run it")
    return None


class SmgProc:
    def __init__(self, log: Path, *extra: str, kind: str = "smg", port: int | None = None):
        self.kind, self.log_path, self.extra = kind, log, extra
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        head = ([smg_binary() or "smg", "launch"] if self.kind == "smg"
                else [sys.executable, "-m", "sglang_router.launch_router"])
        return [*head, "--host", "127.0.0.1", "--port", str(self.port), *VIME_FLAGS,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *self.extra]

    def start(self, timeout: float = 30.0, token: str | None = None) -> "SmgProc":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, process_group=0,
                                     env={**os.environ, "NO_COLOR": "1"})
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.listing(token=token)
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{self.kind} did not start; see {self.log_path}") from None
                time.sleep(0.1)

    def listing(self, token: str | None = None) -> list[dict]:
        """GET /workers as the router answers it: every entry, draining ones included."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        req = urllib.request.Request(self.url + "/workers", headers=headers)
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.load(r)["workers"]

    def routed(self) -> list[str]:
        """The URLs the router may send requests to: listed and not draining (SMG's policies
        skip a draining worker)."""
        return [w["url"] for w in self.listing() if w.get("status") != "draining"]

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
