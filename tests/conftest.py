from __future__ import annotations

import os
from pathlib import Path

import pytest

from vime.trainer.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """One tiny Llama for the whole session (built locally, seeded, ~6 s)."""
    cache = os.environ.get("VIME_TINY_MODEL_CACHE")
    out = Path(cache) if cache else tmp_path_factory.getbasetemp() / "tiny-model"
    return build_tiny_model(out)
