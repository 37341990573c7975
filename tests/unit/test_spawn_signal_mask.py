"""An engine spawned from a thread that has SIGTERM blocked must not inherit the block: after a
reload (reexec.hold_signals), a worker thread made before the loop's handlers were in place
carries it, and an engine spawned there would sit out every SIGTERM until the SIGKILL."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from vime.supervisor.engine import process


def blocked_signals(pid: int) -> set[int]:
    """The signals /proc/PID/status says the process blocks (SigBlk, a hex mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            mask = int(line.split()[1], 16)
            return {n for n in range(1, 65) if mask >> (n - 1) & 1}
    raise AssertionError("no SigBlk line")


def test_a_child_spawned_from_a_thread_with_sigterm_blocked_does_not_block_it(tmp_path):
    got: dict[str, object] = {}

    def spawn() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGHUP})
        popen = process._start([sys.executable, "-c", "import time; time.sleep(30)"], {}, tmp_path / "log",
                               False)
        got["popen"] = popen
        got["thread_mask"] = signal.pthread_sigmask(signal.SIG_BLOCK, ())  # the thread's, kept

    t = threading.Thread(target=spawn)
    t.start()
    t.join(30)
    popen = got["popen"]
    try:
        assert signal.SIGTERM in got["thread_mask"]  # the spawning thread's own mask is left as it was
        blocked = blocked_signals(popen.pid)
        assert signal.SIGTERM not in blocked and signal.SIGHUP not in blocked, blocked
        popen.terminate()  # and SIGTERM ends it
        assert popen.wait(10) == -signal.SIGTERM
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait(10)
