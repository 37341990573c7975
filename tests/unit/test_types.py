"""mypy over the `vime` package, with the configuration in pyproject.toml ([tool.mypy]): the
contract trainers import (protocol, states, errors, the client) strictly, the rest at mypy's
default level. mypy comes with the `check` extra, which CI installs."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_finds_no_errors():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed: pip install -e '.[check]'")
    # From the root, so pyproject's [tool.mypy] (files = src/vime) is the configuration; the
    # cache is the checkout's .mypy_cache (ignored by git), so a second run takes seconds.
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, f"mypy exited {r.returncode}:\n{r.stdout}{r.stderr}"


def test_no_override_sets_strict():
    # mypy reads `strict = true` in a [[tool.mypy.overrides]] table as the global flag: every
    # module would be checked strictly, not only the ones named. The override spells the
    # per-module strict flags out instead.
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert "strict" not in cfg, "strict for the whole package: the contract's override is then moot"
    overrides = cfg.get("overrides", [])
    assert not [o["module"] for o in overrides if "strict" in o]
    contract = next(o for o in overrides if "vime.supervisor.protocol" in o["module"])
    assert contract.get("disallow_untyped_defs") and contract.get("disallow_any_generics")
    assert {"vime.supervisor.states", "vime.supervisor.errors", "vime.supervisor.client",
            "vime.supervisor.client.*"} <= set(contract["module"])
