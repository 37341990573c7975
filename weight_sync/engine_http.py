"""The one JSON-over-HTTP client of weight_sync (stdlib only): `Call`, a call to an engine that
another thread can cut short, `http_json` for a plain call, and a daemon-thread future."""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import os
import socket
import threading
import urllib.parse
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


class Call:
    """One HTTP call another thread can cut short (`cancel` shuts its socket down), so that a
    call to a stopped engine never outlives the push that made it. `run` answers the decoded
    body or raises HttpFailure (delivered=False when the engine certainly never saw it)."""

    def __init__(self, base_url: str, method: str, path: str, *, body: Any = None,
                 params: dict | None = None, timeout: float, api_key: str | None = None):
        self.url = base_url
        self.method, self.path, self.body, self.params, self.timeout = method, path, body, params, timeout
        self.api_key = api_key
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._cancelled = False

    def run(self) -> Any:
        u = urllib.parse.urlsplit(self.url)
        path = u.path.rstrip("/") + self.path + ("?" + urllib.parse.urlencode(self.params) if self.params else "")
        data = None if self.body is None else json.dumps(self.body).encode()
        headers = {**({"Content-Type": "application/json"} if data else {}), **auth_headers(self.api_key)}
        connection = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        conn = connection(u.hostname or "127.0.0.1", u.port, timeout=self.timeout)
        try:
            try:
                conn.connect()
            except (ConnectionRefusedError, socket.gaierror) as e:  # nothing was sent
                raise HttpFailure(self.method, self.path, cause=e, delivered=False) from None
            with self._lock:
                self._sock = conn.sock
                cancelled = self._cancelled
            if cancelled:
                raise HttpFailure(self.method, self.path, cause=TimeoutError("cut: push over"),
                                  delivered=False)
            conn.request(self.method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except HttpFailure:
            raise
        except (OSError, http.client.HTTPException) as e:
            cause: BaseException = TimeoutError("cut: push over") if self._cancelled else e
            raise HttpFailure(self.method, self.path, cause=cause) from None
        finally:
            conn.close()
        if resp.status >= 400:
            raise HttpFailure(self.method, self.path, status=resp.status,
                              body=raw.decode("utf-8", "replace"))
        return decode_body(raw)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked reading the answer
            except OSError:
                pass


def http_json(base_url: str, method: str, path: str, *, body: Any = None,
              params: dict | None = None, timeout: float, api_key: str | None = None) -> Any:
    """One call, in this thread: the decoded answer, or HttpFailure."""
    return Call(base_url, method, path, body=body, params=params, timeout=timeout, api_key=api_key).run()


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
