"""What the blocking and asyncio transports share: connect-failure mapping, the retry policy,
the server's uid check, and the event stream's line handling. No I/O of its own but the stat
of a socket path that refused a connect (path_mode, file_on_the_way) and the uid check's getsockopt."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import struct
import time
from typing import TYPE_CHECKING, Any, Callable

import tenacity
from tenacity import stop_after_delay, wait_exponential, wait_random
from tenacity.stop import stop_base

from vime.supervisor.protocol import ENV_SOCKET, Event, ReconnectedEvent, default_socket_path

if TYPE_CHECKING:
    import aiohttp

from .errors import (
    ClientCode,
    ConnectionLost,
    DaemonUnreachable,
    Forbidden,
    SupervisorError,
    empty_socket_message,
    forbidden_socket_message,
    long_socket_message,
    not_a_folder_message,
    not_a_socket_message,
    unreachable_message,
)

# tenacity >= 8.3: do not start a wait that would end past the deadline; older tenacity
# overshoots by at most one wait.
stop_within: Callable[[float], stop_base] = getattr(tenacity, "stop_before_delay", stop_after_delay)

# A daemon running as a dedicated user (neither root nor ours) is trusted only when named here.
ENV_SERVER_UID = "VIME_SUPERVISOR_UID"


class NotConnected(Exception):
    """The connection could not be made: nothing was sent, so a retry is always safe."""


class Dropped(Exception):
    """The connection broke after the request was (perhaps) sent."""


def path_mode(path: str) -> int | None:
    """os.stat's st_mode of path (None: nothing there, or it cannot be stat'ed)."""
    try:
        return os.stat(path).st_mode
    except OSError:
        return None


# sun_path is 108 bytes on Linux, its path NUL-terminated: 107 bytes of path at most.
SUN_PATH_MAX = 107


def file_on_the_way(path: str) -> str | None:
    """The nearest existing folder above path that is a regular file instead (ENOTDIR), if any."""
    parent = os.path.dirname(os.path.abspath(path))
    while parent != os.path.dirname(parent):
        if os.path.isfile(parent):
            return parent
        parent = os.path.dirname(parent)
    return None


def _bad_path(message: str) -> DaemonUnreachable:
    return DaemonUnreachable(message, code=ClientCode.BAD_SOCKET_PATH)


def _what_is_there(mode: int) -> str:
    for test, what in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "a file of another kind"


def connect_failure(path: str, err: OSError, mode: int | None = None) -> Exception:
    """What a failed connect to path means; `mode` is path_mode(path), taken after the failure.
    A path that cannot be the daemon's socket (empty, too long, under a regular file, not a
    socket) is refused at once, code bad_socket_path: waiting will not make it one."""
    if not path:  # Linux: EINVAL
        return _bad_path(empty_socket_message())
    size = len(os.fsencode(path))
    if size > SUN_PATH_MAX:  # Python: "AF_UNIX path too long", or the kernel's ENOENT past the NUL
        return _bad_path(long_socket_message(path, size, SUN_PATH_MAX))
    if isinstance(err, NotADirectoryError) or err.errno == errno.ENOTDIR:
        return _bad_path(not_a_folder_message(path, file_on_the_way(path)))
    if isinstance(err, FileNotFoundError) or err.errno == errno.ENOENT:
        return NotConnected("no such socket (the daemon is not running, or uses another runtime_dir)")
    if isinstance(err, PermissionError) or err.errno in (errno.EACCES, errno.EPERM):
        return Forbidden(forbidden_socket_message(path, err), code=ClientCode.SOCKET_PERMISSION)
    if mode is not None and not stat.S_ISSOCK(mode):
        # Linux answers ECONNREFUSED for a regular file or a FIFO: not a stale socket.
        return _bad_path(not_a_socket_message(path, _what_is_there(mode)))
    if isinstance(err, ConnectionRefusedError) or err.errno == errno.ECONNREFUSED:
        return NotConnected("connection refused (a stale socket: the daemon is not listening)")
    if err.errno == errno.ENOTSOCK:
        return NotConnected("the path exists but is not a socket")
    if isinstance(err, TimeoutError):
        return NotConnected("connect timed out")
    return NotConnected(f"{type(err).__name__}: {err}")


def retry_predicate(idempotent: bool) -> Callable[[BaseException], bool]:
    return lambda e: isinstance(e, NotConnected) or (idempotent and isinstance(e, Dropped))


def wait() -> Any:
    # 0.05 s doubling to 1 s, plus up to 0.1 s of jitter so clients do not reconnect in lockstep.
    return wait_exponential(multiplier=0.05, max=1.0) + wait_random(0, 0.1)


def give_up(path: str, err: BaseException, idempotent: bool, elapsed: float) -> SupervisorError:
    if isinstance(err, Dropped) and not idempotent:
        return ConnectionLost(
            f"the connection to the vime-supervisor daemon at {path} dropped after the request was "
            f"sent ({err}); it may or may not have taken effect: check `status()` before repeating it",
            code=ClientCode.CONNECTION_LOST)
    return DaemonUnreachable(unreachable_message(path, f"{err} (tried for {elapsed:.1f}s)"),
                             code=ClientCode.UNREACHABLE)


def why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".rstrip(": ")


def _trusted_server_uids() -> set[int]:
    uids = {0, os.geteuid()}
    extra = os.environ.get(ENV_SERVER_UID, "").strip()
    if extra.isdigit():
        uids.add(int(extra))
    return uids


def check_server(sock: Any, path: str) -> None:
    """SO_PEERCRED on our side: whoever could replace the socket file could otherwise answer
    for the daemon. The daemon must be root, our own uid, or $VIME_SUPERVISOR_UID."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return  # not a Unix socket with credentials (never the daemon's): nothing to check
    _pid, uid, _gid = struct.unpack("3i", creds)
    if uid not in _trusted_server_uids():
        raise Forbidden(f"the process behind {path} runs as uid {uid}, not root nor uid {os.geteuid()}: "
                        f"not trusted as the vime-supervisor daemon. Check who owns its runtime_dir; if the "
                        f"daemon runs as a dedicated user, set ${ENV_SERVER_UID}={uid}",
                        code=ClientCode.UNTRUSTED_SERVER)


class Stream:
    """One events() generator's connection, so close() can end it from another thread."""

    def __init__(self) -> None:
        self.closed = False
        self.handle: socket.socket | aiohttp.ClientResponse | None = None  # blocking: the socket; asyncio: the response


def reconnected(path: str, reason: str) -> ReconnectedEvent:
    return {"event": Event.RECONNECTED, "ts": time.time(), "socket": path,  # type: ignore[typeddict-item]
            "message": f"event stream reconnected after: {reason}; events in between may have been missed "
                       "(the hello that follows has the current state)"}


def wanted(ev: Any, keepalives: bool) -> bool:
    return isinstance(ev, dict) and (keepalives or ev.get("event") != Event.KEEPALIVE)


def event_lines(buf: bytearray, chunk: bytes) -> list[dict[str, Any]]:
    """Append chunk to buf; return the complete NDJSON lines, parsed (bad lines skipped)."""
    buf += chunk
    out: list[dict[str, Any]] = []
    while True:
        i = buf.find(b"\n")
        if i < 0:
            return out
        line = bytes(buf[:i]).strip()
        del buf[:i + 1]
        if line:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict):
                out.append(ev)


class ClientSettings:
    """What both clients are given: the socket and three timeouts (see SupervisorClient)."""

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *, connect_timeout: float = 10.0,
                 timeout: float = 60.0, read_timeout: float = 30.0):
        if socket_path is not None:
            self.socket_path = os.fspath(socket_path)
        else:  # $VIME_SUPERVISOR_SOCKET set but empty is a mistake to say, not the default
            self.socket_path = "" if os.environ.get(ENV_SOCKET) == "" else default_socket_path()
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self.read_timeout = read_timeout
        self._streams: set[Stream] = set()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.socket_path!r})"

