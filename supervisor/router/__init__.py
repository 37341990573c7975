"""The router in front of the engines (vllm-router, SMG): what the daemon and vime.cluster both
need to drive it, and nothing of the daemon's. A small adapter interface (`Router`), URL
normalization, the pure membership diff (plan.py) and one module per router kind.

The adapters import nothing of ours: the daemon and the cluster side both may import them
(tests/unit/test_layout.py holds the rule). Beside them, the daemon's side of the router, which
this package does not import: the feed (feed.py), the spawned router (child.py) and their one
owner (link.py).
"""

from __future__ import annotations

from typing import Any

from .base import Router, RouterError, normalize_url
from .smg import SmgRouter
from .vllm_router import VllmRouter

__all__ = ["KINDS", "Router", "RouterError", "SmgRouter", "VllmRouter", "make_router", "normalize_url"]

KINDS = ("vllm-router", "smg")  # smg also drives sglang-router 0.3.2 (the same admin routes)


def make_router(kind: str, url: str, session: Any, *, worker_type: str = "regular", token: str | None = None) -> Router:
    """The adapter for `kind` (one of KINDS), calling through the aiohttp `session`."""
    if kind == "vllm-router":
        return VllmRouter(url, session, worker_type=worker_type, token=token)
    if kind == "smg":
        return SmgRouter(url, session, worker_type=worker_type, token=token)
    raise ValueError(f"router kind {kind!r} is not supported (supported: {', '.join(KINDS)})")
