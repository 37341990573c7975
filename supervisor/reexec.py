"""Reload in place: SIGHUP re-executes the daemon with no engine restart.

`systemctl reload` (ExecReload= sends SIGHUP) or `kill -HUP PID`: the daemon checks that the
installed daemon will start (`--check-config` run by the same interpreter and argv, so an
upgrade that cannot even import is caught here), lets syncs in flight end, detaches from its
engines without stopping them, writes its journal, and execs itself. The pid stays (systemd's
MainPID, the engines' parent); the new image is whatever is installed now, and it re-adopts
every engine from the journal as after a kill -9, keeping the round and the weight version.

The lock files (one daemon per runtime and state directory) are handed over open across the
exec, so no second daemon can take them in between: their fds and the pid they were meant for
travel in $VIME_SUPERVISOR_HANDOVER, which the new image reads and removes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from dataclasses import dataclass, field

HANDOVER_ENV = "VIME_SUPERVISOR_HANDOVER"
PREFLIGHT_TIMEOUT = 120.0  # a cold import of the daemon on a loaded machine, with room


@dataclass
class Handover:
    """What a re-executed daemon got from the image before it."""

    generation: int = 0  # re-executions so far in this process (0: a fresh start)
    locks: dict[str, int] = field(default_factory=dict)  # lock file path -> open fd holding its flock


def daemon_argv() -> list[str]:
    """The command line this process was started with, run by this interpreter: `-m
    vime.supervisor ...` or the console script's path, with the interpreter's own options."""
    return [sys.executable, *sys.orig_argv[1:]]


async def preflight(argv: list[str], timeout: float = PREFLIGHT_TIMEOUT) -> str | None:
    """None if the installed daemon accepts this command line and its config now, else why not
    (the check's own last lines). Runs while this daemon goes on serving."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, "--check-config", stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env={k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"})
    except OSError as e:
        return f"cannot run {argv[0]}: {e}"
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return f"`{' '.join(argv)} --check-config` did not finish within {timeout:g}s"
    if proc.returncode != 0:
        lines = out.decode(errors="replace").strip().splitlines()[-5:]
        return f"`--check-config` exited {proc.returncode}: " + " | ".join(lines)
    return None


# Blocked across the exec (a blocked signal stays pending through execve) until the new
# image's event loop handles them: a `systemctl stop` in between is delayed, never lost, and
# a SIGHUP cannot kill an image that has no handler for it yet.
HELD_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def hold_signals() -> None:
    """Block them: pending, not lost, until release_signals() (in this image, or the next)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)


def release_signals() -> None:
    """Unblock what a reload held, once the loop's handlers are in place (a no-op after a
    fresh start)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)


def execute(argv: list[str], generation: int, locks: list[int]) -> None:
    """Replace this process's image; returns only by raising OSError (nothing was replaced)."""
    for fd in locks:
        os.set_inheritable(fd, True)
    paths = {}
    for fd in locks:
        try:
            paths[os.readlink(f"/proc/self/fd/{fd}")] = fd
        except OSError:
            pass
    env = dict(os.environ)
    env[HANDOVER_ENV] = json.dumps({"pid": os.getpid(), "generation": generation, "locks": paths})
    hold_signals()  # held already by the caller; they stay held if the exec fails, until a loop handles them
    try:
        os.execve(argv[0], argv, env)
    finally:  # only reached when execve failed: the locks stay ours, not our children's
        for fd in locks:
            os.set_inheritable(fd, False)


def inherited(environ: dict[str, str] | None = None) -> Handover | None:
    """The handover from the image before this one, if this process is a re-execution. The
    variable is removed either way: engines must not inherit it. One meant for another pid (a
    shell that copied it) is ignored, and so is any fd that is not the lock file it names."""
    env = os.environ if environ is None else environ
    raw = env.pop(HANDOVER_ENV, None)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        if data.get("pid") != os.getpid():
            return None
        generation = int(data["generation"])
        named = {str(p): int(fd) for p, fd in dict(data["locks"]).items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    locks = {}
    for path, fd in named.items():
        try:
            held, there = os.fstat(fd), os.stat(path)
        except OSError:
            continue
        if (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino):
            os.set_inheritable(fd, False)
            locks[path] = fd
    return Handover(generation=generation, locks=locks)
