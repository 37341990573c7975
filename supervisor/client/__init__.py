"""The client of the supervisor's control socket (HTTP/JSON over a Unix socket): `SupervisorClient`
(blocking) and `AsyncSupervisorClient` (asyncio), the same verbs from one table (calls.py),
and their typed errors (docs/control-socket.md).

    sup = SupervisorClient()                 # $VIME_SUPERVISOR_SOCKET or the default
    with sup.round(412):
        urls = [e["url"] for e in sup.routable_engines()["engines"]]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vime.supervisor.protocol import API, DEFAULT_SOCKET, ENGINE_ACTIONS, ENV_SOCKET, default_socket_path

from ._transport import ENV_SERVER_UID
from .blocking import SupervisorClient
from .calls import VERBS, Call, LogTail, Verbs
from .errors import (
    BadRequest,
    ClientCode,
    ConflictError,
    ConnectionLost,
    DaemonUnreachable,
    Forbidden,
    SupervisorError,
    UnknownEngine,
    error_from_response,
)

if TYPE_CHECKING:
    from .aio import AsyncSupervisorClient

__all__ = [
    "API", "DEFAULT_SOCKET", "ENV_SOCKET", "ENV_SERVER_UID", "ENGINE_ACTIONS", "default_socket_path",
    "SupervisorClient", "AsyncSupervisorClient", "LogTail", "Call", "Verbs", "VERBS",
    "SupervisorError", "DaemonUnreachable", "ConnectionLost", "ConflictError", "UnknownEngine",
    "BadRequest", "Forbidden", "ClientCode", "error_from_response",
]


def __getattr__(name: str) -> Any:
    # The asyncio client imports aiohttp: only when asked for, so the blocking one stays light.
    if name == "AsyncSupervisorClient":
        from .aio import AsyncSupervisorClient

        return AsyncSupervisorClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
