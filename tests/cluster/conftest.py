"""One Ray head for every cluster test in the session (about 5 s to start); each module adds
the simulated nodes it needs at addresses of its own and removes them after."""

from __future__ import annotations

import os

import pytest

# Ray's own processes log at INFO to the test's output; errors are enough here.
os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "error")
os.environ.setdefault("RAY_DEDUP_LOGS", "1")

from vime.harness.ray_nodes import RayNodes  # noqa: E402


@pytest.fixture(scope="session")
def ray_head():
    nodes = RayNodes()
    nodes.connect()
    try:
        yield nodes
    finally:
        nodes.shutdown()
