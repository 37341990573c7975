"""Small JSON-over-HTTP helper (urllib, stdlib only) and a daemon-thread future."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any


class HttpFailure(Exception):
    """One HTTP call failed. delivered=False: the engine certainly never saw the request."""

    def __init__(self, method: str, path: str, *, status: int | None = None, body: str = "",
                 cause: BaseException | None = None, delivered: bool = True):
        self.method, self.path, self.status, self.body = method, path, status, body
        self.cause, self.delivered = cause, delivered
        what = f"HTTP {status}: {body[:600]}" if status is not None else f"{type(cause).__name__}: {cause}"
        super().__init__(f"{method} {path} -> {what}")


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """`Authorization: Bearer KEY` for an engine started with an API key: `api_key`, else
    $VIME_ENGINE_API_KEY (what the rollout client reads too); none when neither is set.
    vLLM 0.32 asks for it on /v1 only, not on the weight routes, where it is harmless."""
    key = api_key if api_key is not None else os.environ.get("VIME_ENGINE_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def http_json(base_url: str, method: str, path: str, *, body: Any = None,
              params: dict | None = None, timeout: float, api_key: str | None = None) -> Any:
    url = base_url.rstrip("/") + path
    if params:
        url += "?" + urllib.parse.urlencode(params)
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data else {}
    req = urllib.request.Request(url, data=data, method=method, headers={**headers, **auth_headers(api_key)})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        try:
            text = e.read().decode("utf-8", "replace")
        except Exception:  # noqa: BLE001
            text = ""
        raise HttpFailure(method, path, status=e.code, body=text, cause=e) from None
    except urllib.error.URLError as e:
        refused = isinstance(e.reason, (ConnectionRefusedError, socket.gaierror))
        raise HttpFailure(method, path, cause=e.reason if isinstance(e.reason, BaseException) else e,
                          delivered=not refused) from None
    except (TimeoutError, socket.timeout, ConnectionError, OSError) as e:
        raise HttpFailure(method, path, cause=e) from None
    return decode_body(raw)


def decode_body(raw: bytes) -> Any:
    """An engine's answer: None if empty, the JSON if it is JSON, else the text."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


def run_in_thread(fn: Callable, *args, name: str = "weight-sync", **kwargs) -> cf.Future:
    """Run fn in a daemon thread (never joined at interpreter exit, unlike ThreadPoolExecutor:
    a thread stuck on a dead peer must not hang the trainer's exit)."""
    fut: cf.Future = cf.Future()

    def body():
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001
            fut.set_exception(e)

    threading.Thread(target=body, name=name, daemon=True).start()
    return fut
