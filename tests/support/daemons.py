"""Starting and stopping what a test runs beside it: a daemon that must answer on its socket
first, and a helper process stopped politely, then by force."""

from __future__ import annotations

import http.client
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from vime.harness.local_daemon import Daemon, kill_all


def start_answering(cfg: Path, status: Callable[[str], Any], timeout: float = 30) -> Daemon:
    """A daemon on `cfg`, returned once `status(its socket)` answers; AssertionError with its
    log's tail if it exits or does not answer within `timeout` s."""
    d = Daemon(cfg)
    deadline = time.monotonic() + timeout
    while True:
        assert d.proc.poll() is None, "daemon exited:\n" + "\n".join(d.raw[-30:])
        try:
            status(d.sock)
            return d
        except (OSError, http.client.HTTPException):
            assert time.monotonic() < deadline, "control socket never answered:\n" + "\n".join(d.raw[-30:])
            time.sleep(0.1)


def stop_removing_run_dir(d: Daemon, timeout: float) -> None:
    """SIGTERM (past `timeout` s, SIGKILL to it and to its engines' groups), then remove its
    runtime_dir (a short one under /tmp)."""
    try:
        d.terminate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all([d])
    shutil.rmtree(d.run_dir, ignore_errors=True)


def end_process(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL if it is still there after `timeout` s."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
