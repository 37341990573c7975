"""SMG's admin API (sgl-model-gateway, PyPI smg 1.13.0; sglang-router 0.3.2 answers the same
routes): GET /workers, POST /workers, GET /workers/{id}, DELETE /workers/{id} (by SMG's id).

Both writes are queued jobs (202 at once); each call here waits, within its one bounded
attempt, for the router to have acted: an add until the worker is ready (or listed healthy), a
removal until each of the URL's ids is gone or draining. A pending add cannot be cancelled; the
feed's list watch removes it once it lands. `workers()` leaves out draining workers. The
details are in docs/router.md.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import aiohttp

from .base import RouterError, admin_call, normalize_url, said

# A spawned SMG's flags (router.args when unset; `smg launch` and --host/--port/--worker-urls are
# the daemon's): vime's breaker-off and 4-hour request timeout as for vllm-router; its metrics
# (per-worker series named by address) on loopback, not every interface; a pending add that
# cannot be cancelled gives up within a minute (SMG ended one 60 s after it was sent, with 30),
# not SMG's 30 minutes.
SPAWN_ARGS = ("--disable-circuit-breaker", "--request-timeout-secs", "14400", "--prometheus-host", "127.0.0.1",
              "--worker-startup-timeout-secs", "30")
POLL = 0.02  # how often a queued add or removal is looked at, within the call's bound
_ID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_QUEUED = ("pending", "processing")  # job_status.status of a job not yet ended


class SmgRouter:
    def __init__(self, url: str, session: aiohttp.ClientSession, *, worker_type: str = "regular",
                 token: str | None = None, kind: str = "smg"):
        self.kind = kind  # "smg", or "sglang-router" (the same routes)
        self.url = url.rstrip("/")
        self.session = session
        self.worker_type = worker_type
        # SMG's admin key (--control-plane-api-keys ID:NAME:admin:KEY), sent as a bearer token.
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def _call(self, method: str, path: str, deadline: float, body: Any = None) -> tuple[int, Any]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RouterError(f"{method} {self.url}{path}: not sent, the call's bound ran out", transient=True,
                              answered=False)
        return await admin_call(self.session, method, self.url, path, self.headers, left, body,
                                late="no answer within the call's bound",
                                token_hint=" (an admin key of SMG's --control-plane-api-keys)")

    async def _list(self, deadline: float) -> list[dict[str, Any]]:
        status, data = await self._call("GET", "/workers", deadline)
        if status != 200 or not isinstance(data, dict) or not isinstance(data.get("workers"), list):
            raise RouterError(f"GET {self.url}/workers: {status}: not SMG's worker list ({said(data)}); "
                              "check router.url and router.kind", transient=False)
        return [w for w in data["workers"] if isinstance(w, dict) and isinstance(w.get("url"), str)]

    async def workers(self, timeout: float) -> list[str]:
        return [w["url"] for w in await self._list(time.monotonic() + timeout) if w.get("status") != "draining"]

    async def add(self, worker: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        where = f"POST {self.url}/workers {worker}"
        status, data = await self._call("POST", "/workers", deadline, {"url": worker, "worker_type": self.worker_type})
        if status in (200, 201, 202) and isinstance(data, dict) and isinstance(data.get("worker_id"), str):
            worker_id = data["worker_id"]
        elif status == 409 and (m := _ID.search(said(data))):  # listed, or its add under way: that add is ours
            worker_id = m.group(0)
        else:
            raise RouterError(f"{where}: {status}: {said(data)}", transient=False)
        while True:
            status, data = await self._call("GET", f"/workers/{worker_id}", deadline)
            if status == 404:
                raise RouterError(f"{where}: the router dropped the worker before it was ready", transient=True, answered=True)
            if status != 200 or not isinstance(data, dict):
                raise RouterError(f"GET {self.url}/workers/{worker_id}: {status}: {said(data)}", transient=False)
            state, job = data.get("status"), data.get("job_status") or {}
            if state == "ready":
                return
            if state is None and job.get("status") not in _QUEUED and data.get("is_healthy"):
                return  # sglang-router: no status; the job ended with the worker listed healthy
            if state == "draining":
                raise RouterError(f"{where}: being removed (draining); added again once it is gone", transient=True, answered=True)
            if job.get("job_type") == "AddWorker" and job.get("status") == "failed" and state in (None, "pending"):
                raise RouterError(f"{where}: the router's add failed: {job.get('message')}", transient=True, answered=True)
            if time.monotonic() + POLL >= deadline:
                raise RouterError(f"{where}: queued, not ready within {timeout:g}s (status {state or job.get('status')})",
                                  transient=True, answered=True)
            await asyncio.sleep(POLL)

    async def remove(self, worker: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        want = normalize_url(worker)
        ids = [w["id"] for w in await self._list(deadline)
               if normalize_url(w["url"]) == want and w.get("status") != "draining" and isinstance(w.get("id"), str)]
        for worker_id in ids:
            where = f"DELETE {self.url}/workers/{worker_id} ({worker})"
            status, data = await self._call("DELETE", f"/workers/{worker_id}", deadline)
            if status == 404:
                continue
            if status not in (200, 202, 204):
                raise RouterError(f"{where}: {status}: {said(data)}", transient=False)
            while True:  # queued: until the router stops routing to it
                status, data = await self._call("GET", f"/workers/{worker_id}", deadline)
                if status == 404 or (isinstance(data, dict) and data.get("status") == "draining"):
                    break
                if time.monotonic() + POLL >= deadline:
                    raise RouterError(f"{where}: queued, still routable after {timeout:g}s", transient=True, answered=True)
                await asyncio.sleep(POLL)
