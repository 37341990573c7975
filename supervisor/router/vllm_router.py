"""vllm-router's admin API (PyPI vllm-router 0.1.17; its admin routes changed between versions):
GET /workers, POST /workers {"url", "worker_type"}, DELETE /workers/{quote(url)}.

POST /workers blocks until the worker answers /health (up to the router's
--worker-startup-timeout-secs, 600 s by default): every call here is bounded by the caller's
timeout, and one attempt is made per call (the caller retries transient errors).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import aiohttp

from .base import RouterError, admin_call, said


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
        return await admin_call(self.session, method, self.url, path, self.headers, timeout, body,
                                late=f"no answer within {timeout:g}s")

    async def workers(self, timeout: float) -> list[str]:
        return list(await self.listing(timeout))

    async def listing(self, timeout: float) -> dict[str, bool]:
        """GET /workers as {url as listed: is_healthy} (the router alone marks a worker it finds
        unhealthy, it does not remove it; a worker with no flag counts as healthy)."""
        status, data = await self._call("GET", "/workers", timeout)
        if status != 200 or not isinstance(data, dict) or not isinstance(data.get("workers"), list):
            raise RouterError(f"GET {self.url}/workers: {status}: not vllm-router's worker list ({said(data)}); "
                              "check router.url and router.kind", transient=False)
        return parse_listing(data)

    async def add(self, worker: str, timeout: float) -> None:
        status, data = await self._call("POST", "/workers", timeout,
                                        {"url": worker, "worker_type": self.worker_type})
        if status == 200:
            return
        if status == 400 and "already exists" in said(data):
            return
        raise RouterError(f"POST {self.url}/workers {worker}: {status}: {said(data)}", transient=False)

    async def remove(self, worker: str, timeout: float) -> None:
        status, data = await self._call("DELETE", "/workers/" + quote(worker, safe=""), timeout)
        if status in (200, 404):  # 0.1.17 answers 200 for a worker it does not have
            return
        raise RouterError(f"DELETE {self.url}/workers/{worker}: {status}: {said(data)}", transient=False)


def parse_listing(data: dict[str, Any]) -> dict[str, bool]:
    """vllm-router's GET /workers body as {url: is_healthy}: entries are objects with `url` (and
    `is_healthy`) or, in older answers, bare URLs."""
    out: dict[str, bool] = {}
    for w in data.get("workers", []):
        url = w.get("url") if isinstance(w, dict) else w
        if isinstance(url, str):
            out[url] = bool(w.get("is_healthy", True)) if isinstance(w, dict) else True
    return out
