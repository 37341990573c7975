"""The stand-in benchmarks' short forms run to their end: bench/fleet_scale.py,
bench/descriptors.py and bench/control_latency.py, each over PROTOCOL STAND-IN engines
(harness/standin_engine.py) and the real daemon, print every row they were asked for, with
figures that are numbers, and exit 0. No timing is asserted: the figures are the benches'."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bench(tmp_path: Path, name: str, *args: str) -> str:
    p = subprocess.run([sys.executable, str(ROOT / "bench" / name), *args], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    assert "FAILED" not in p.stdout, p.stdout
    return p.stdout


def numbers(row: str) -> list[float]:
    out = [float(x) for x in row.split()]
    assert all(math.isfinite(x) for x in out), row
    return out


def test_fleet_scale_short_form(tmp_path):
    out = bench(tmp_path, "fleet_scale.py", "--engines", "8", "--seconds", "1")
    assert "open-file limit (this bench, the daemon, the stand-ins)" in out
    for n in (8,):  # printed as each fleet is measured, then in the table
        assert f"measured {n} engines, lean probes" in out and f"measured {n} engines, aiohttp probes" in out
    table = out[out.index("fleet scale: one daemon"):].splitlines()
    rows = {int(r.split()[0]): r.split() for r in table if r.split() and r.split()[0].isdigit()}
    assert set(rows) == {8}
    for n, row in rows.items():
        # a 1 s window holds a few clock ticks of the daemon's CPU: the bench prints no ratio of those
        assert ((row[3] == "-" and "(ratio -: under" in out)
                or (row[3] != "-" and math.isfinite(float(row[3])))), row
        _, cpu, base, rss, probes, expected, failed, late, up = numbers(" ".join(row[:3] + row[4:]))
        assert cpu >= 0 and base >= 0 and rss > 0 and up > 0
        assert expected == n and probes > 0 and failed >= 0 and late >= 0


def test_descriptors_short_form(tmp_path):
    out = bench(tmp_path, "descriptors.py", "--attached", "4", "--spawned", "2", "--warmup", "2")
    rows = {" ".join(r.split()[:2]): r.split()[2:] for r in out.splitlines() if r.split()[1:2] in (["attached"], ["spawned"])}
    assert set(rows) == {"4 attached", "2 spawned"}, out
    for key, row in rows.items():
        peak, steady, estimate, ratio = numbers(" ".join(row))
        assert 0 < steady <= peak and estimate > 0
        assert ratio <= 1.0, f"{key}: the daemon held more descriptors than --check-config allows for\n{out}"


def test_control_latency_short_form(tmp_path):
    out = bench(tmp_path, "control_latency.py", "--engines", "0", "8", "--calls", "20")
    rows = [r.split() for r in out.splitlines() if r.split()[:1] in (["0"], ["8"])]
    assert sorted((r[0], r[1]) for r in rows) == [("0", "round"), ("0", "status"), ("8", "round"), ("8", "status")]
    for r in rows:
        assert all(x > 0 for x in numbers(" ".join(r[2:]))), r
