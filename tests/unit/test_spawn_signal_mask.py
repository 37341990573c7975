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


def _running_with(marker: str) -> list[int]:
    """Live processes whose argv holds `marker`."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and marker in process.cmdline(int(d.name)):
            st = process.proc_stat(int(d.name))
            if st is not None and st.state != "Z":
                out.append(int(d.name))
    return out


async def test_a_spawn_cancelled_while_its_thread_forks_leaves_no_process(tmp_path):
    """A shutdown cancels an engine's start while the fork runs in its thread: what the thread
    starts is killed, never left running with no record of it."""
    import asyncio
    import os
    import time

    from concurrent.futures import ThreadPoolExecutor

    marker = f"vime-cancelled-spawn-{os.getpid()}"
    cmd = [sys.executable, "-c", "import time; time.sleep(60)", marker]
    loop = asyncio.get_running_loop()
    for attempt, delay in enumerate((0.0, 0.001, 0.005, 0.02)):
        log = tmp_path / f"{attempt}.log"
        pool = ThreadPoolExecutor(1)  # the spawn's thread (asyncio.to_thread), to be waited for below
        loop.set_default_executor(pool)
        task = asyncio.ensure_future(process.ChildProcess.spawn(cmd, dict(os.environ), log))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            child = await task
        except asyncio.CancelledError:
            # The fork's thread ends before anything is judged: only then is its process (if it
            # made one) there to be found, and the spawn's clean-up due.
            pool.shutdown(wait=True)
            await asyncio.sleep(0.05)
            if not log.exists():  # cancelled before its thread began: nothing started
                continue
            deadline = time.monotonic() + 10
            while _running_with(marker) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert _running_with(marker) == []
            return
        await child.stop(5)  # the spawn had ended before the cancel: try a shorter delay
    raise AssertionError("no attempt cancelled a spawn while its thread forked")
