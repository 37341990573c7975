from __future__ import annotations

import os
from pathlib import Path

import pytest

from vime.trainer.tiny_model import build_tiny_model

# The session fails when a process it started outlives its last test (support/leaks.py).
pytest_plugins = ["support.leaks"]


@pytest.fixture(scope="session", autouse=True)
def shared_engine_caches(tmp_path_factory):
    """Real engines spawned by test daemons share one compiler cache per engine name and model
    for the session (harness.write_config reads it): without it every daemon's first boot
    compiles from nothing, about 15 s per engine here. A test that needs cold caches sets
    its own engine_cache_dir."""
    if not os.environ.get("VIME_TEST_ENGINE_CACHE"):
        os.environ["VIME_TEST_ENGINE_CACHE"] = str(tmp_path_factory.mktemp("engine-cache"))
    yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """One tiny Llama for the whole session (built locally, seeded, ~6 s)."""
    cache = os.environ.get("VIME_TINY_MODEL_CACHE")
    out = Path(cache) if cache else tmp_path_factory.getbasetemp() / "tiny-model"
    return build_tiny_model(out)
