"""bench/cluster.py --quick runs end to end (its own Ray cluster of 1 and then 2 simulated nodes,
a daemon per node, PROTOCOL STAND-IN engines) and produces its table and JSON with figures that
are numbers at all: positive and finite. No timing is asserted; the figures are the bench's."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]


def positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_quick_bench_prints_its_table_and_writes_sane_json(tmp_path):
    out = tmp_path / "cluster.json"
    env = {**os.environ, "RAY_BACKEND_LOG_LEVEL": "error"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cluster.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"

    data = json.loads(out.read_text())
    assert [r["nodes"] for r in data["runs"]] == [1, 2]
    for run in data["runs"]:
        assert "error" not in run, run["error"]
        assert run["engines"] == 8 * run["nodes"]
        for call in ("round", "routable"):
            row = run["latency"][call]
            for way in ("cluster", "direct_seq", "direct_conc"):
                assert row[way]["n"] == data["args"]["reps"] == len(row[way]["samples_ms"])
                assert positive(row[way]["p50_ms"]) and positive(row[way]["p95_ms"]), (call, way, row[way])
                assert row[way]["p95_ms"] >= row[way]["p50_ms"]
            for k in ("ratio_p50_seq", "ratio_p50_conc", "ratio_p95_seq", "ratio_p95_conc"):
                assert positive(row[k]), (call, k, row[k])
        rm = run["removal"]
        assert [t["observed_by"] for t in rm["trials"]] == ["events", "poll"]
        for t in rm["trials"]:
            assert t["node"].startswith("127.0.0.") and positive(t["seen_s"]), t
            # the stream said the node left (unavailable or lost) and moved the membership
            assert {"membership"} <= {e["event"] for e in t["timeline"]}, t["timeline"]
        if run["nodes"] == 1:  # the one node came back for the second trial, after Ray's verdict
            assert positive(rm["trials"][0]["ray_dead_s"]) and positive(rm["trials"][0]["rejoin_s"])
            assert positive(rm["events"]["ratio_to_ray"])
        else:  # two nodes: the second trial removes the other one
            assert rm["trials"][0]["node"] != rm["trials"][1]["node"]
        assert positive(rm["trials"][1]["poll_call_max_s"]) and rm["trials"][1]["poll_calls"] >= 1
        for mode in ("events", "poll"):
            assert rm[mode]["seen"] == rm[mode]["trials"] == 1 and positive(rm[mode]["median_s"])
        s = run["setup"]
        for k in ("daemons_s", "ray_head_s", "ray_nodes_s", "agents_s", "ray_mib", "ray_head_mib", "daemons_mib",
                  "standins_mib", "ray_per_node_mib"):
            assert positive(s[k]), (k, s)
        assert s["ray_processes"] >= 2 + run["nodes"]  # GCS, the head's raylet, a raylet per node at least
        for k in ("idle_cpu_pct", "idle_cpu_ray_pct", "idle_cpu_daemons_pct", "idle_cpu_standins_pct"):
            assert math.isfinite(s[k]) and s[k] >= 0, (k, s)
        assert len(run["latency"]["load"]) == 2

    text = proc.stdout
    table = text[text.index("cluster client vs direct sockets"):]
    for head in ("cluster p50", "seq p50", "conc p50", "p50/seq", "p50/conc", "event stream", "polling every",
                 "Ray dead", "ray start s", "per node", "idle cpu %", "load", "PROTOCOL STAND-IN"):
        assert head in table, head
    rows = [line.split() for line in table.splitlines()]
    for n in ("1", "2"):
        for call in ("round", "routable"):
            row = next(r for r in rows if r[:3] == [n, str(8 * int(n)), call])
            assert all(positive(float(x)) for x in row[3:-1]), row  # the last column is the load
    assert f"(figures: {out})" in text
    assert positive(data["machine"]["client"]["unavailable_grace"]) and "cluster client defaults:" in table
