"""bench/weight_push.py --fleet, its short form: tiny sizes, up to 2 stand-in receivers."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the stand-ins need vLLM")
def test_fleet_short_form_prints_the_table_and_the_fault_rows():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "weight_push.py"), "--fleet", "1,2",
                          "--fleet-mb", "8", "--bucket-mb", "1", "--repeat", "1",
                          "--fault-rendezvous-s", "2"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    table = out.stdout.split("\n\n")[-1].splitlines()
    assert table[0].split()[:3] == ["receivers", "bcast", "s"]
    rows = {line.split()[0]: line.split() for line in table[2:] if line[:1].isdigit() or line.lstrip()[:1].isdigit()}
    assert set(rows) == {"1", "2"} and float(rows["2"][5]) == pytest.approx(1.58, abs=0.01)
    for sig in ("SIGKILL", "SIGSTOP"):
        line = next(x for x in table if x.startswith(sig))
        assert "survivors at the version 1/1" in line and "faulted one unreachable" in line, line
