"""The adapter interface every router kind implements, its error, URL normalization, and the
host resolution that tells another spelling of one address (`localhost`, `127.0.0.1`, a
hostname) for the same worker."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable, Protocol
from urllib.parse import urlsplit, urlunsplit


class RouterError(Exception):
    """A router call that failed. `transient`: worth retrying (refused, reset, timed out, a 5xx);
    otherwise the router said no in a way a retry will not change (a 4xx: bad token, wrong URL).
    `answered`: the router sent an answer (a status); False when it was not reached or did not
    answer in time; an adapter that does not say is taken to have had no answer when the error is
    transient (the feed then reports the router as not answering: the side that says more)."""

    def __init__(self, message: str, *, transient: bool, answered: bool | None = None):
        super().__init__(message)
        self.transient = transient
        self.answered = (not transient) if answered is None else answered


async def admin_call(session: Any, method: str, url: str, path: str, headers: dict[str, str], timeout: float,
                     body: Any = None, *, late: str, token_hint: str = "") -> tuple[int, Any]:
    """One bounded call to a router's admin API: (status, the body as JSON, or its text), or a
    RouterError that says whether it is worth retrying and whether the router answered (refused,
    reset, timed out: not answered; a 5xx or 429: answered, transient; 401/403: not transient).
    `late`: what a timeout says; `token_hint`: added to a refused token's message."""
    import aiohttp

    where = f"{method} {url}{path}"
    try:
        async with session.request(method, url + path, json=body, headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=timeout), allow_redirects=False) as resp:
            text = await resp.text(errors="replace")
            status = resp.status
    except asyncio.TimeoutError:
        raise RouterError(f"{where}: {late}", transient=True, answered=False) from None
    except aiohttp.InvalidURL:
        raise RouterError(f"{where}: not a valid URL; set router.url to http://HOST:PORT", transient=False) from None
    except (aiohttp.ClientError, OSError) as e:
        raise RouterError(f"{where}: {e or type(e).__name__}; is the router running at {url}?",
                          transient=True, answered=False) from None
    try:
        data = json.loads(text) if text else None
    except ValueError:
        data = text[:200]
    if status in (401, 403):
        raise RouterError(f"{where}: {status}: the router refused our token; check router.token_file{token_hint}",
                          transient=False)
    if status >= 500 or status == 429:
        raise RouterError(f"{where}: {status}: {said(data)}", transient=True, answered=True)
    return status, data


def said(data: Any) -> str:
    """What an admin answer says, short (its error or message)."""
    if isinstance(data, dict):
        return str(data.get("error") or data.get("message") or data)[:300]
    return str(data)[:300]


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


def _literal(host: str) -> str | None:
    """An IP literal in one spelling (an IPv4-mapped IPv6 address as IPv4); None for a name."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


class HostResolver:
    """Hosts to their addresses, each host resolved once (off the event loop, through
    `loop.getaddrinfo`) and cached: at most `bound` hosts, least recently used out first; a
    name that does not resolve is kept as itself for `retry_after` seconds, then asked again.
    Concurrent asks for one host share one lookup; one lookup waits at most `timeout`."""

    def __init__(self, *, bound: int = 1024, retry_after: float = 30.0, timeout: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        self.bound, self.retry_after, self.timeout, self.clock = bound, retry_after, timeout, clock
        self._cache: OrderedDict[str, tuple[frozenset[str], float | None]] = OrderedDict()  # host -> (addrs, expiry)
        self._inflight: dict[str, asyncio.Future[frozenset[str]]] = {}
        self.lookups = 0  # getaddrinfo calls made (tests: once per host)

    async def addresses(self, host: str) -> frozenset[str]:
        lit = _literal(host)
        if lit is not None:
            return frozenset({lit})
        hit = self._cache.get(host)
        if hit is not None and (hit[1] is None or hit[1] > self.clock()):
            self._cache.move_to_end(host)
            return hit[0]
        fut = self._inflight.get(host)
        if fut is None:
            fut = asyncio.ensure_future(self._lookup(host))
            self._inflight[host] = fut
            fut.add_done_callback(lambda _f: self._inflight.pop(host, None))
        return await asyncio.shield(fut)

    async def _lookup(self, host: str) -> frozenset[str]:
        self.lookups += 1
        try:
            infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(
                host, None, type=socket.SOCK_STREAM), self.timeout)
            found = frozenset(a for a in (_literal(str(i[4][0])) for i in infos) if a is not None)
        except (OSError, asyncio.TimeoutError, UnicodeError):
            found = frozenset()
        addrs, expiry = (found, None) if found else (frozenset({host}), self.clock() + self.retry_after)
        self._cache[host] = (addrs, expiry)
        self._cache.move_to_end(host)
        while len(self._cache) > self.bound:
            self._cache.popitem(last=False)
        return addrs

    async def same_workers(self, listed: Iterable[str], ours: Iterable[str]) -> dict[str, str]:
        """Normalized listed URL -> our normalized URL it names under another host spelling
        (same scheme, port and path, a host address in common). Listed URLs spelled as ours are
        left out; nothing is resolved when every listed URL is."""
        mine = {normalize_url(u) for u in ours}
        others = {normalize_url(u) for u in listed} - mine
        if not others:
            return {}
        hosts = {urlsplit(u).hostname or "" for u in mine | others}
        addrs = dict(zip(hosts, await asyncio.gather(*(self.addresses(h) for h in hosts))))
        index: dict[tuple[str, str, int | None, str], str] = {}
        for u in sorted(mine):
            s = urlsplit(u)
            for a in addrs[s.hostname or ""]:
                index.setdefault((s.scheme, a, s.port, s.path), u)
        out: dict[str, str] = {}
        for u in others:
            s = urlsplit(u)
            for a in sorted(addrs[s.hostname or ""]):
                if (s.scheme, a, s.port, s.path) in index:
                    out[u] = index[(s.scheme, a, s.port, s.path)]
                    break
        return out
