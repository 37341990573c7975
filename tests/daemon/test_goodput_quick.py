"""bench/goodput.py --quick, the CI smoke run of the goodput bench (issue 36): the real daemon
spawns emulated engines (harness/emulated_engine.py, protocol stand-ins; not vLLM), the real
rollout client runs the RL-shaped rounds under every policy, faults strike on the clock, and the
bench exits 0 with every figure printed and a JSON that holds each run's ledger, the frozen
timing parameters and the scaled daemon config. No figure's value is asserted beyond the
must-be-zero ones (the bench's exit status) and the fault-free run's ETTR of 1: on a shared
2-core host the runs are usually marked invalid (the time scale not kept), which the JSON says.
With `--weights both` and everything-on's async row (and its baseline, fault-free-async): the
daemon in async mode, one in-flight update per step, every sample judged by the async rule."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADERS = ("ETTR", "useful tok/s", "start s", "recover s", "failures", "cap lost s", "tok lost/fault", "rounds lost",
           "stale", "false restarts", "spares out", "stale regen")
SYNC = ("fault-free", "slime", "defaults", "everything-on")
ASYNC = ("fault-free-async", "everything-on-async")
POLICIES = SYNC + ASYNC


def test_goodput_quick_runs_every_policy_and_prints_every_figure(tmp_path):
    out = tmp_path / "goodput.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "goodput.py"), "--quick", "--weights", "both", "--only",
                        "slime,defaults,everything-on,everything-on-async", "--out", str(out)],
                       capture_output=True, text=True, timeout=460, cwd=tmp_path)
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-4000:]}"
    lines = p.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.strip().startswith("policy"))
    assert all(h in lines[head] for h in HEADERS), lines[head]
    rows = {line.split()[0]: line for line in lines[head + 1:head + 1 + len(POLICIES)]}
    assert set(rows) == set(POLICIES), rows
    for name, row in rows.items():
        cells = row.split("valid", 1)[1].split()
        assert len(cells) >= len(HEADERS), (name, row)  # a cell each, "-" where a figure has no value

    doc = json.loads(out.read_text())
    assert doc["failed"] == [] and doc["must_be_zero"] == []
    assert doc["workload"]["engines"] == 6 and doc["spares"] == 2
    assert set(doc["timing_parameters"]) >= {"boot_s", "first_batch_s", "step_base_s", "push_bytes_per_s"}
    assert all(v["source"] for v in doc["timing_parameters"].values())
    runs = {r["policy"]: r for r in doc["runs"]}
    assert set(runs) == set(POLICIES) and all("error" not in r for r in runs.values())
    for r in runs.values():
        g = r["ledger"]
        assert g["rounds"] - g["rounds_lost"] == doc["workload"]["rounds"]  # the same work in every run
        assert g["wall_s"] > 0 and g["time_to_start_s"] is not None and g["useful_tps"] > 0
        assert r["daemon_config"]["health_check"]["interval"] > 0 and r["intervals_s"]
        assert (r["invalid"] is None) or "smallest scaled interval" in r["invalid"]
    assert runs["fault-free"]["ledger"]["ettr"] == 1.0 and runs["fault-free"]["faults"] == []
    for r in runs.values():  # against its mode's fault-free run of the seed, unless that run was invalid
        assert (r["ledger"]["ettr"] > 0) if r["ettr_invalid"] is None else (r["ledger"]["ettr"] is None), r
    # The same draw for every faulted policy: each met the clock's faults in the same order.
    kinds = [[f["kind"] for f in runs[n]["faults"]] for n in ("slime", "defaults", "everything-on",
                                                               "everything-on-async")]
    shortest = min(len(k) for k in kinds)
    assert all(k[:shortest] == kinds[0][:shortest] for k in kinds)
    # The async rows: the daemon in async mode, each step's version by an in-flight update.
    for n in POLICIES:
        assert runs[n]["weights_mode"] == ("async" if n in ASYNC else "sync")
        assert runs[n]["daemon_config"]["weights"]["mode"] == runs[n]["weights_mode"]
    for n in ASYNC:
        r = runs[n]
        assert r["daemon_config"]["weights"]["max_staleness"] == 1
        assert [u["version"] for u in r["updates"]] == list(range(2, doc["workload"]["rounds"] + 2))
        assert r["wall_vs_sync_fault_free"] > 0 and set(r["samples_cut"]) == {"continued", "spanning_versions"}
    assert runs["fault-free-async"]["ledger"]["ettr"] == 1.0 and runs["fault-free-async"]["faults"] == []
    assert "async rows' wall time / the sync fault-free run's (same seed): fault-free-async" in p.stdout


@pytest.mark.parametrize("weights", ["sync", "async"])
def test_the_stale_mutation_shows_stale_samples(tmp_path, weights):
    # An engine that reports every version it is given but keeps its weights, with no fingerprint
    # published: the daemon routes it, and only the bench's token check sees its samples stale
    # (async: each piece checked against the version its split claims).
    out = tmp_path / "stale.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "goodput.py"), "--quick", "--mutation", "stale",
                        "--weights", weights, "--out", str(out)], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-4000:]}"
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert run["ledger"]["stale_samples"] > 0 and run["faults"] == [] and run["weights_mode"] == weights
    assert "mutation stale caught" in p.stdout
