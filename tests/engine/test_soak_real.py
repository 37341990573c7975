"""The chaos soak, short form: the RL loop on two real engines under the daemon while a seeded
schedule kills the daemon (restarted as systemd would), restarts it after a torn journal
(kill -9, journal corrupted, then start) in a round gap, disconnects the trainer mid-round,
crashes an engine at start and poisons a checkpoint reload, with fuzzed requests at the control
socket all along. Every check of harness/soak.py must hold, exactly. The long form is
`python -m vime.harness.soak --long` (every fault kind, twice, the clean restart among them).
"""

from __future__ import annotations

import json

import pytest

from vime.harness.soak import SHORT, run_soak
from vime.harness.timeline import load_run, png_size

pytestmark = [pytest.mark.engine, pytest.mark.soak]


def test_soak_short_form(tiny_model, tmp_path):
    result = run_soak(tmp_path / "soak", seed=7, steps=12, kinds=SHORT, model=tiny_model)
    print(result.format())
    failed = {name: detail for name, (ok, detail) in result.checks.items() if not ok}
    assert not failed, failed
    # Every check the soak promises was made (none skipped for lack of data).
    assert len(result.checks) == 10, sorted(result.checks)
    f = result.figures
    assert f["faults injected"] == f["faults survived (recovered)"] == len(SHORT)
    assert f["rounds lost"] == 0 and f["stale responses"] == 0
    assert f["steps (rounds)"] >= 12 and f["requests answered"] == f["steps (rounds)"] * 8
    saved = json.loads((tmp_path / "soak" / "soak.json").read_text())
    assert all(c["ok"] for c in saved["checks"].values())
    # The corrupt-journal restart happened, and left no old engine behind.
    restarts = [x for x in saved["faults"] if x["kind"] == "daemon" and "then start" in x["note"]]
    assert len(restarts) == 1 and all(x["confirmed"] for x in restarts), restarts
    # The picture of the run (harness/timeline.py), drawn from what it recorded: a valid PNG with
    # every fault placed on it.
    w, h = png_size(tmp_path / "soak" / "timeline.png")
    assert w >= 600 and h >= 150 and (tmp_path / "soak" / "timeline.png").stat().st_size > 10_000
    assert len(load_run(tmp_path / "soak").faults) == len(SHORT)
