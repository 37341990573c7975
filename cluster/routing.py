"""A lost node's engines out of the router, from the cluster side; and a node's that has not
acknowledged the current version.

Each node's daemon feeds the router its own engines (supervisor/router/feed.py) and never
touches another node's: to every other daemon they are someone else's URLs. A node that is
lost (its daemon or its whole host gone) cannot take its engines out, so the process that marks
it lost does: the trainer's `AsyncClusterClient`, given `router_url`. The URLs removed are the
node's engines as its last routable answer listed them (the view drops them at the loss).

One bounded attempt per URL, retried with jittered backoff on transient errors only; never
awaited by the client's watchers (a router that is down costs the trainer nothing but a log
line). If the node's daemon is in fact alive (only its Ray agent was lost), its own feed adds
its routable engines back within its period: the daemon's evidence about its engines wins.

A publish that a node did not acknowledge (its daemon unreachable or not answering in time)
leaves that node's daemon judging by the version before: its engines the routing rule does not
allow at the new version (states.VersionRule; in sync mode all not at it) are taken out of the
router by the publisher at once (the URLs of the node's last routable answer), and the publish
waits for it at most `timeout`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from vime.supervisor.router import RouterError, make_router, normalize_url

log = logging.getLogger("vime.cluster.routing")

ATTEMPTS = 3


def _transient(e: BaseException) -> bool:
    return isinstance(e, RouterError) and e.transient


def lost_urls(routable: Iterable[dict[str, Any]]) -> list[str]:
    """The URLs to take out for a node's last routable entries: each once, as listed."""
    seen: dict[str, str] = {}
    for e in routable:
        url = e.get("url")
        if isinstance(url, str) and url:
            seen.setdefault(normalize_url(url), url)
    return sorted(seen.values())


class LostNodeRemoval:
    """Removes a lost node's engines from the router (`kind` as the daemons' [router] kind).
    `emit(event_dict)` reports each outcome on the cluster's event stream."""

    def __init__(self, url: str, *, kind: str = "vllm-router", token: str | None = None,
                 timeout: float = 1.0, emit: Callable[[dict[str, Any]], None] | None = None):
        self.url, self.kind, self.token, self.timeout = url, kind, token, timeout
        self.emit = emit or (lambda ev: None)
        self._session: aiohttp.ClientSession | None = None

    async def remove(self, node: str, urls: list[str], why: str = "its node is lost") -> dict[str, str]:
        """url -> "removed" or the error; never raises for the router's failure."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        router = make_router(self.kind, self.url, self._session, token=self.token)
        out: dict[str, str] = {}
        for url in urls:
            try:
                async for attempt in AsyncRetrying(retry=retry_if_exception(_transient), reraise=True,
                                                   stop=stop_after_attempt(ATTEMPTS),
                                                   wait=wait_random_exponential(multiplier=0.1, max=2.0)):
                    with attempt:
                        await router.remove(url, self.timeout)
                out[url] = "removed"
            except RouterError as e:
                out[url] = str(e)
                log.warning("router removal of node %s's engine %s (%s) failed: %s", node, url, why, e)
            self.emit({"event": "router", "action": "removed" if out[url] == "removed" else "remove_failed",
                       "node": node, "url": url, "why": why,
                       **({} if out[url] == "removed" else {"error": out[url]})})
        return out

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
