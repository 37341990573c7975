"""The node agent: a Ray actor on one node that relays the cluster client's calls to that
node's daemon over its local Unix socket, and the daemon's event stream back.

It holds nothing a restart would lose: a client of the local socket and nothing else. The
cluster client places one per node (hard node affinity) as `ray.remote(NodeAgent)`; this module
does not import Ray, so it stays importable where Ray is not installed.
"""

from __future__ import annotations

import os
import socket
from typing import Any, AsyncIterator, Mapping

from vime.supervisor.client import VERBS, SupervisorError
from vime.supervisor.client.aio import AsyncSupervisorClient
from vime.supervisor.protocol import Role

# An error travels back as data, not as a Ray task error: the client re-raises the same class.
ErrorAnswer = dict[str, Any]


def error_answer(e: SupervisorError) -> ErrorAnswer:
    return {"error": {"class": type(e).__name__, "message": e.message, "status": e.status, "code": e.code}}


class NodeAgent:
    """One node's relay. `call` performs one verb of the control socket's table; `events` is a
    streaming generator of the daemon's events (the role is the caller's)."""

    def __init__(self, socket_path: str | None = None, *, connect_timeout: float = 2.0, timeout: float = 60.0):
        # A short connect_timeout: a daemon that is gone must show as gone in seconds, and the
        # cluster client retries the node itself.
        self.client = AsyncSupervisorClient(socket_path, connect_timeout=connect_timeout, timeout=timeout,
                                            read_timeout=30.0)

    async def where(self) -> dict[str, Any]:
        import ray  # inside the actor only

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "address": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "host": socket.gethostname(), "socket": self.client.socket_path}

    async def call(self, verb: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> Any:
        """{"ok": answer} or {"error": {...}} for a SupervisorError (the daemon's 4xx, or its
        socket unreachable)."""
        if verb not in VERBS:
            return {"error": {"class": "BadRequest", "message": f"no verb {verb!r} on the control socket",
                              "status": 400, "code": "unknown_verb"}}
        try:
            return {"ok": await getattr(self.client, verb)(*args, **(kwargs or {}))}
        except SupervisorError as e:
            return error_answer(e)
        except (TypeError, ValueError) as e:  # arguments the local client refused to send
            return {"error": {"class": "BadRequest", "message": f"{verb}: {e}", "status": 400,
                              "code": "bad_argument"}}

    async def events(self, role: str = Role.OBSERVER.value) -> AsyncIterator[Mapping[str, Any]]:
        """The daemon's events, keepalives included (they prove the stream alive). Ends with an
        error event when the daemon cannot be reached (the client decides what that means)."""
        try:
            async for ev in self.client.events(role=role, keepalives=True):
                yield ev
        except SupervisorError as e:
            yield {"event": "agent_error", **error_answer(e)}
