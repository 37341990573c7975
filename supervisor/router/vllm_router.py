"""vllm-router's admin API (PyPI vllm-router 0.1.17; its admin routes changed between versions):
GET /workers, POST /workers {"url", "worker_type"}, DELETE /workers/{quote(url)}.

POST /workers blocks until the worker answers /health (up to the router's
--worker-startup-timeout-secs, 600 s by default): every call here is bounded by the caller's
timeout, and one attempt is made per call (the caller retries transient errors).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import quote

import aiohttp

from .base import RouterError


class VllmRouter:
    kind = "vllm-router"

    def __init__(self, url: str, session: aiohttp.ClientSession, *, worker_type: str = "regular",
                 token: str | None = None):
        self.url = url.rstrip("/")
        self.session = session
        self.worker_type = worker_type
        # vllm-router 0.1.17 has no admin token of its own; one is sent for a proxy in front.
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def _call(self, method: str, path: str, timeout: float, body: Any = None) -> tuple[int, Any]:
        where = f"{method} {self.url}{path}"
        try:
            async with self.session.request(method, self.url + path, json=body, headers=self.headers,
                                            timeout=aiohttp.ClientTimeout(total=timeout),
                                            allow_redirects=False) as resp:
                text = await resp.text(errors="replace")
                status = resp.status
        except asyncio.TimeoutError:
            raise RouterError(f"{where}: no answer within {timeout:g}s", transient=True, answered=False) from None
        except aiohttp.InvalidURL:
            raise RouterError(f"{where}: not a valid URL; set router.url to http://HOST:PORT", transient=False) from None
        except (aiohttp.ClientError, OSError) as e:
            raise RouterError(f"{where}: {e or type(e).__name__}; is the router running at {self.url}?",
                              transient=True, answered=False) from None
        try:
            data = json.loads(text) if text else None
        except ValueError:
            data = text[:200]
        if status in (401, 403):
            raise RouterError(f"{where}: {status}: the router refused our token; check router.token_file",
                              transient=False)
        if status >= 500 or status == 429:
            raise RouterError(f"{where}: {status}: {_said(data)}", transient=True, answered=True)
        return status, data

    async def workers(self, timeout: float) -> list[str]:
        return list(await self.listing(timeout))

    async def listing(self, timeout: float) -> dict[str, bool]:
        """GET /workers as {url as listed: is_healthy} (the router alone marks a worker it finds
        unhealthy, it does not remove it; a worker with no flag counts as healthy)."""
        status, data = await self._call("GET", "/workers", timeout)
        if status != 200 or not isinstance(data, dict) or not isinstance(data.get("workers"), list):
            raise RouterError(f"GET {self.url}/workers: {status}: not vllm-router's worker list ({_said(data)}); "
                              "check router.url and router.kind", transient=False)
        return parse_listing(data)

    async def add(self, worker: str, timeout: float) -> None:
        status, data = await self._call("POST", "/workers", timeout,
                                        {"url": worker, "worker_type": self.worker_type})
        if status == 200:
            return
        if status == 400 and "already exists" in _said(data):
            return
        raise RouterError(f"POST {self.url}/workers {worker}: {status}: {_said(data)}", transient=False)

    async def remove(self, worker: str, timeout: float) -> None:
        status, data = await self._call("DELETE", "/workers/" + quote(worker, safe=""), timeout)
        if status in (200, 404):  # 0.1.17 answers 200 for a worker it does not have
            return
        raise RouterError(f"DELETE {self.url}/workers/{worker}: {status}: {_said(data)}", transient=False)


def parse_listing(data: dict[str, Any]) -> dict[str, bool]:
    """vllm-router's GET /workers body as {url: is_healthy}: entries are objects with `url` (and
    `is_healthy`) or, in older answers, bare URLs."""
    out: dict[str, bool] = {}
    for w in data.get("workers", []):
        url = w.get("url") if isinstance(w, dict) else w
        if isinstance(url, str):
            out[url] = bool(w.get("is_healthy", True)) if isinstance(w, dict) else True
    return out


def _said(data: Any) -> str:
    if isinstance(data, dict):
        return str(data.get("error") or data.get("message") or data)[:300]
    return str(data)[:300]
