"""The adapter interface every router kind implements, its error, and URL normalization."""

from __future__ import annotations

from typing import Protocol
from urllib.parse import urlsplit, urlunsplit


class RouterError(Exception):
    """A router call that failed. `transient`: worth retrying (refused, reset, timed out, a 5xx);
    otherwise the router said no in a way a retry will not change (a 4xx: bad token, wrong URL)."""

    def __init__(self, message: str, *, transient: bool):
        super().__init__(message)
        self.transient = transient


class Router(Protocol):
    """One router's admin API, each call one bounded attempt (the caller retries)."""

    kind: str
    url: str

    async def workers(self, timeout: float) -> list[str]:
        """The workers' URLs as the router lists them (not normalized)."""
        ...

    async def add(self, worker: str, timeout: float) -> None:
        """Add `worker`; one the router already has is not an error."""
        ...

    async def remove(self, worker: str, timeout: float) -> None:
        """Remove `worker`; one the router does not have is not an error."""
        ...


_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_url(url: str) -> str:
    """The one spelling of a worker's URL that lists are compared in: scheme and host in lower
    case, the port always written, no trailing slash, no path, query or fragment.
    vllm-router joins paths onto the URL as given: `http://h:p/` makes it poll `//health`."""
    u = urlsplit(url.strip())
    scheme = (u.scheme or "http").lower()
    host = (u.hostname or "").lower()
    try:
        port = u.port
    except ValueError:
        port = None
    port = port or _DEFAULT_PORTS.get(scheme)
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc += f":{port}"
    path = u.path.rstrip("/")
    return urlunsplit((scheme, netloc, path, "", ""))
