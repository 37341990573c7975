"""bench/ scripts loaded as modules, for the tests of their pure parts (nothing is run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(script: str, *, siblings: bool = False) -> ModuleType:
    """bench/<script>.py as the module `bench_<script>`, registered in sys.modules (its
    dataclasses look their module up); `siblings`: with bench/ on sys.path while it loads, as
    when run (it imports modules beside it)."""
    spec = importlib.util.spec_from_file_location(f"bench_{script}", BENCH / f"{script}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    if siblings:
        sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(mod)
    finally:
        if siblings:
            sys.path.remove(str(BENCH))
    return mod
