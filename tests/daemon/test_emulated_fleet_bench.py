"""bench/emulated_fleet.py's short form runs to its end: the real daemon spawns emulated engines
(harness/emulated_engine.py, protocol stand-ins; not vLLM), every one becomes routable, and the
JSON holds the boot, memory and loop-lag figures with the timing parameters and their sources.
No timing is asserted: the figures are the bench's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_emulated_fleet_short_form(tmp_path):
    out = tmp_path / "fleet.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "emulated_fleet.py"), "--engines", "2", "--seconds", "1",
                        "--time-scale", "0.01", "--json", str(out)], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    r = json.loads(out.read_text())
    assert r["engines"] == 2 and r["all_routable_s"] > 0
    assert r["boot_s"]["median"] >= r["scaled_boot_s"] > 0  # spawn to RUNNING includes the scaled boot
    assert r["engine_rss_mib"]["median"] > 0 and r["engine_pss_mib"]["sum"] > 0 and r["daemon_rss_mib"] > 0
    assert r["status_round_trip_ms"]["calls"] > 0 and r["probe_failures"] == 0 and r["fleet_cpu_pct_of_a_core"] >= 0
    assert r["parameters"]["time_scale"] == 0.01 and all(v["source"] for v in r["parameters"]["parameters"].values())
    assert "2 emulated engines under the real daemon" in p.stdout and "daemon loop lag" in p.stdout
