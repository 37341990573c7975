"""The client's typed errors, and the mapping of a daemon's error answer onto them.

    try:
        sup.start_round(7)
    except ConflictError as e:      # 409: e.code, e.message (says what to do)
        ...
"""

from __future__ import annotations

import json
from enum import StrEnum

from vime.supervisor.protocol import DEFAULT_SOCKET, ENV_SOCKET, ErrorCode

__all__ = [
    "SupervisorError", "DaemonUnreachable", "ConnectionLost", "ConflictError", "UnknownEngine",
    "BadRequest", "Forbidden", "ClientCode", "error_from_response",
]


class ClientCode(StrEnum):
    """`code`s the client sets itself (the daemon's own are protocol.ErrorCode)."""

    UNREACHABLE = "unreachable"  # no connection within connect_timeout
    TIMEOUT = "timeout"  # no answer within the request timeout
    CONNECTION_LOST = "connection_lost"  # dropped after a non-idempotent request was sent
    SOCKET_PERMISSION = "socket_permission"  # the socket file's mode refused us
    UNTRUSTED_SERVER = "untrusted_server"  # SO_PEERCRED: the server's uid is not trusted
    BAD_ANSWER = "bad_answer"  # an answer that is not JSON
    CLIENT_ERROR = "client_error"  # any other aiohttp client error
    BAD_SOCKET_PATH = "bad_socket_path"  # the path cannot be the daemon's socket: empty, too long, not a socket


class SupervisorError(Exception):
    """Any failure of a control-socket call. `status` is the HTTP status (None when no answer
    came), `code` the daemon's error code, `message` the daemon's message (it says what to do)."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = None if code is None else str(code)  # a plain str, also for ClientCode

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status={self.status!r}, code={self.code!r}, message={self.message!r})"


class DaemonUnreachable(SupervisorError):
    """No connection to the daemon (socket missing, connection refused) within connect_timeout,
    or no answer within the request timeout."""


class ConnectionLost(DaemonUnreachable):
    """The connection dropped after a non-idempotent request was sent: it may or may not have
    taken effect. Check `status()` before repeating it."""


class ConflictError(SupervisorError):
    """409: the request contradicts the daemon's state (a stale or out-of-order round, a stale
    weight version, an action the engine cannot take). Nothing was changed."""


class UnknownEngine(SupervisorError):
    """404 unknown_engine: no engine of that name in the daemon's config."""


class BadRequest(SupervisorError):
    """400: the request is wrong in itself (a bad checkpoint, a negative version)."""


class Forbidden(SupervisorError):
    """403 (the daemon refused our uid), or the socket's file permissions refused us."""


def error_from_response(status: int, body: bytes) -> SupervisorError:
    """The typed exception for a daemon's 4xx/5xx answer `{"error": {"code", "message"}}`."""
    code, message = f"http_{status}", ""
    try:
        err = json.loads(body)["error"]
        code, message = str(err.get("code") or code), str(err.get("message") or "")
    except (ValueError, KeyError, TypeError, AttributeError):
        message = body.decode("utf-8", "replace").strip()[:500]
    message = message or f"HTTP {status} from the daemon"
    if status == 409:
        cls: type[SupervisorError] = ConflictError
    elif status == 404 and code == ErrorCode.UNKNOWN_ENGINE:
        cls = UnknownEngine
    elif status in (400, 413):
        cls = BadRequest
    elif status == 403:
        cls = Forbidden
    else:  # 404 route / 405: a client newer than the daemon; 5xx: a bug in the daemon
        cls = SupervisorError
    return cls(message, status=status, code=code)


# Where the daemon's socket is, as every "not this path" message says it.
WHICH_SOCKET = f"(<runtime_dir>/supervisor.sock; ${ENV_SOCKET} chooses another)"


def unreachable_message(path: str, why: str) -> str:
    return (f"cannot reach the vime-supervisor daemon at {path}: {why}. Check that the daemon is "
            f"running (`systemctl status vime-supervisor`) and that this is its socket {WHICH_SOCKET}")


def not_a_socket_message(path: str, what: str) -> str:
    return (f"{path} is {what}, not the vime-supervisor daemon's control socket: give the socket the "
            f"daemon listens on {WHICH_SOCKET}")


def empty_socket_message() -> str:
    return (f"the control socket path is empty (--socket '', socket_path='' or ${ENV_SOCKET} set to ''): "
            f"give the socket the daemon listens on (<runtime_dir>/supervisor.sock), or leave "
            f"${ENV_SOCKET} unset for {DEFAULT_SOCKET}")


def long_socket_message(path: str, size: int, limit: int) -> str:
    return (f"{path} is {size} bytes, longer than a Unix socket path may be ({limit} bytes): put the "
            f"daemon's runtime_dir on a shorter path, or connect through a shorter symlink to the socket")


def not_a_folder_message(path: str, file: str | None) -> str:
    where = f"{file} is a regular file, not a folder" if file else "a folder on the way to it is not one"
    return f"{path} cannot be a socket: {where}; give the socket the daemon listens on {WHICH_SOCKET}"


def forbidden_socket_message(path: str, err: OSError) -> str:
    return (f"permission denied connecting to {path} ({err.strerror}): the socket is mode 0660; "
            f"run as the daemon's user or a member of its supervisor.socket_group, and have the uid "
            f"in supervisor.allowed_uids")


def timeout_error(path: str, method: str, url_path: str, timeout: float) -> DaemonUnreachable:
    return DaemonUnreachable(
        f"the vime-supervisor daemon at {path} did not answer {method} {url_path} within "
        f"{timeout:g}s; check `systemctl status vime-supervisor` and its log", code=ClientCode.TIMEOUT)
