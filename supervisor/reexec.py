"""Reload in place: SIGHUP re-executes the daemon with no engine restart (docs/operations.md,
Reload in place).

The daemon checks the installed daemon will start (--check-config by the same interpreter and
argv), lets syncs end, detaches from its engines, writes its journal and execs itself; the new
image re-adopts every engine from the journal. The lock files and the listening control socket
are handed over open across the exec ($VIME_SUPERVISOR_HANDOVER), so no second daemon takes
the locks in between and a call made during the reload waits in the backlog instead of being
refused; a descriptor that fails the new image's check is not used.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import sys
from dataclasses import dataclass, field
from typing import Any

HANDOVER_ENV = "VIME_SUPERVISOR_HANDOVER"
# "0": a reload closes the control socket and the next image binds a new one (calls made in
# between are refused); bench/reload.py measures that against the handover.
SOCKET_HANDOVER_ENV = "VIME_SUPERVISOR_SOCKET_HANDOVER"
# "1" in the environment of the `--check-config` a reload runs: the new image re-adopts the
# engines this one holds, so a hard open-file limit below the fleet's estimate is said as a
# warning there (the new image starts and reports it), not refused as for a fresh start.
RELOAD_CHECK_ENV = "VIME_SUPERVISOR_RELOAD_CHECK"
PREFLIGHT_TIMEOUT = 120.0  # a cold import of the daemon on a loaded machine, with room


def socket_handover_enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether a reload hands the listening control socket over (unless the variable is "0")."""
    return (os.environ if environ is None else environ).get(SOCKET_HANDOVER_ENV, "1") != "0"


@dataclass
class Handover:
    """What a re-executed daemon got from the image before it."""

    generation: int = 0  # re-executions so far in this process (0: a fresh start)
    locks: dict[str, int] = field(default_factory=dict)  # lock file path -> open fd holding its flock
    listener: socket.socket | None = None  # the control socket, listening, if it passed the check
    listener_refused: str | None = None  # why a handed-over socket was not taken (logged once logging is up)


def socket_identity(sock: socket.socket, path: str, bound: tuple[int, int] | None) -> dict[str, int | str]:
    """What names a listening control socket in a handover: its descriptor, the socket itself
    (its inode in sockfs) and the file bound to the path (both survive the exec unchanged).
    `bound`: (st_dev, st_ino) of that file when it was bound; OSError if the path no longer
    holds it (the next image must not serve on a socket whose file was removed or replaced)."""
    held, there = os.fstat(sock.fileno()), os.lstat(path)
    if (there.st_dev, there.st_ino) != bound:
        raise OSError(f"{path} is no longer the file this socket was bound to")
    return {"fd": sock.fileno(), "path": path, "sock_dev": held.st_dev, "sock_ino": held.st_ino,
            "dev": there.st_dev, "ino": there.st_ino}


def take_listener(named: dict[str, Any]) -> tuple[socket.socket | None, str | None]:
    """The handed-over control socket, or (None, why not). The descriptor must be the very
    socket the previous image recorded, a listening AF_UNIX stream socket bound to the path,
    whose file is still the one it bound. One that is the socket but fails a later check is
    closed; a descriptor that is not that socket is left alone (it is not ours to close)."""
    try:
        fd, path = int(named["fd"]), str(named["path"])
        want_sock = (int(named["sock_dev"]), int(named["sock_ino"]))
        want_file = (int(named["dev"]), int(named["ino"]))
    except (KeyError, TypeError, ValueError):
        return None, f"the handover's listener entry is malformed: {named!r}"
    try:
        held = os.fstat(fd)
    except OSError as e:
        return None, f"fd {fd} is not open ({e.strerror})"
    if not stat.S_ISSOCK(held.st_mode) or (held.st_dev, held.st_ino) != want_sock:
        return None, f"fd {fd} is not the socket the previous image handed over"
    sock = socket.socket(fileno=fd)
    try:
        why = None
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            why = f"fd {fd} is not a Unix stream socket"
        elif not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            why = f"fd {fd} is not listening"
        elif sock.getsockname() != path:
            why = f"fd {fd} is bound to {sock.getsockname()!r}, not {path}"
        else:
            try:
                there = os.lstat(path)
            except OSError as e:
                there, why = None, f"{path}: {e.strerror}"
            if there is not None and (not stat.S_ISSOCK(there.st_mode) or (there.st_dev, there.st_ino) != want_file):
                why = f"{path} was replaced since the previous image bound it"
    except OSError as e:
        why = f"fd {fd}: {e}"
    if why is not None:
        sock.close()
        return None, why
    sock.set_inheritable(False)
    return sock, None


def reload_held(raw: str | None) -> int:
    """The running fleet's open-file need a reload's check was handed (RELOAD_CHECK_ENV); 0
    when it is not one, or the value is not a count."""
    return int(raw) if raw is not None and raw.isascii() and raw.isdigit() else 0


def daemon_argv() -> list[str]:
    """The command line this process was started with, run by this interpreter: `-m
    vime.supervisor ...` or the console script's path, with the interpreter's own options."""
    return [sys.executable, *sys.orig_argv[1:]]


async def preflight(argv: list[str], timeout: float = PREFLIGHT_TIMEOUT, held: int = 0) -> str | None:
    """None if the installed daemon accepts this command line and its config now, else why not
    (the check's own last lines). Runs while this daemon goes on serving. `held`: the open
    files the running fleet is estimated to need: a new config that needs no more may go
    ahead under a hard limit below that (the fleet runs already); one that needs more may not."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, "--check-config", stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**{k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}, RELOAD_CHECK_ENV: str(held)})
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


def execute(argv: list[str], generation: int, locks: list[int], listener: dict[str, Any] | None = None) -> None:
    """Replace this process's image; returns only by raising OSError (nothing was replaced).
    `listener`: socket_identity() of the listening control socket, handed over with the locks."""
    fds = [*locks, *([listener["fd"]] if listener else [])]
    for fd in fds:
        os.set_inheritable(fd, True)
    paths = {}
    for fd in locks:
        try:
            paths[os.readlink(f"/proc/self/fd/{fd}")] = fd
        except OSError:
            pass
    env = dict(os.environ)
    env[HANDOVER_ENV] = json.dumps({"pid": os.getpid(), "generation": generation, "locks": paths,
                                    "listener": listener})
    hold_signals()  # held already by the caller; they stay held if the exec fails, until a loop handles them
    try:
        os.execve(argv[0], argv, env)
    finally:  # only reached when execve failed: the fds stay ours, not our children's
        for fd in fds:
            os.set_inheritable(fd, False)


def inherited(environ: dict[str, str] | None = None) -> Handover | None:
    """The handover from the image before this one, if this process is a re-execution. The
    variable is removed either way: engines must not inherit it. One meant for another pid (a
    shell that copied it) is ignored, and so is any fd that is not the lock file or the
    listening socket it names (see take_listener)."""
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
        listener = data.get("listener")
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
    handover = Handover(generation=generation, locks=locks)
    if isinstance(listener, dict):
        handover.listener, handover.listener_refused = take_listener(listener)
    elif listener is not None:
        handover.listener_refused = f"the handover's listener entry is malformed: {listener!r}"
    return handover
