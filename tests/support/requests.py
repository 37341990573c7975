"""Plain HTTP calls a test makes to an engine or a router (urllib, no retry: a failure raises)."""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def post(url: str, body: Any = None, timeout: float = 30.0) -> Any:
    """POST `body` as JSON (an empty POST when None): the parsed answer, {} for an empty one."""
    data = b"" if body is None else json.dumps(body).encode()
    headers = {} if body is None else {"Content-Type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(url, data, headers, method="POST"), timeout=timeout) as r:
        return json.loads(r.read() or b"{}")
