"""The benches' one completion request: POST /v1/completions to an engine, answered JSON.
Stdlib only, so a bench's threads need no event loop. Imported as `completion` (a bench runs
as `python bench/NAME.py`, which puts bench/ first on sys.path)."""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def complete(url: str, prompt: str, max_tokens: int, *, timeout: float, model: str = "tiny",
             **sampling: Any) -> dict[str, Any]:
    """The engine at `url` completes `prompt` (`sampling`: more fields of the request body);
    raises OSError (urllib.error.HTTPError for an answer that is not 2xx) when it does not."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, **sampling}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())
