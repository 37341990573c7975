"""The router in front of the engines (vllm-router first): what the daemon and vime.cluster both
need to drive it, and nothing of the daemon's. A small adapter interface (`Router`), URL
normalization, the pure membership diff (plan.py) and one module per router kind.

Imports nothing of ours: the daemon (supervisor/routerfeed.py) and the cluster side both may
import it (tests/unit/test_layout.py holds the rule).
"""

from __future__ import annotations

from typing import Any

from .base import Router, RouterError, normalize_url
from .vllm_router import VllmRouter

__all__ = ["KINDS", "Router", "RouterError", "VllmRouter", "make_router", "normalize_url"]

KINDS = ("vllm-router",)  # smg and sglang-router follow behind the same interface


def make_router(kind: str, url: str, session: Any, *, worker_type: str = "regular", token: str | None = None) -> Router:
    """The adapter for `kind` (one of KINDS), calling through the aiohttp `session`."""
    if kind == "vllm-router":
        return VllmRouter(url, session, worker_type=worker_type, token=token)
    raise ValueError(f"router kind {kind!r} is not supported (supported: {', '.join(KINDS)})")
