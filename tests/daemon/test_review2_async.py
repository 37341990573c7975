"""Defect demonstration (review2, for the lead): in async mode a publish's re-read of an engine's
/weight_info that cannot be read (a 503, a timeout, a refused connection) relabels the engine as
holding the base weights, so an engine within max_staleness is taken out of routing and must be
synced again, and keeps the false label once the route answers. The push end's re-read
(sync.py) and a recovery (runner.py) keep the label on an unreadable answer; the publish's
(EngineRunner.refresh_version) does not. Strict xfail: it passes (and so fails the suite) once
fixed; then drop the marker. A real daemon over PROTOCOL STAND-IN engines, as in
test_async_faults.py (its Node)."""

from __future__ import annotations

import pytest

from vime.harness.local_daemon import kill_all

from support.polling import wait_until
from support.standin_router import StandinRouter
from test_async_faults import Node


@pytest.mark.xfail(strict=True, reason="engine/runner.py refresh_version: an unreadable /weight_info at a publish "
                                       "is taken as the base weights (prober.weight_version() collapses it to None)")
def test_an_unreadable_weight_info_at_a_publish_leaves_an_engine_within_the_bound_routable(tmp_path):
    router = StandinRouter()
    node = None
    try:
        node = Node(tmp_path, ("e0", "e1"), router)  # both report version=1
        c = node.c
        wait_until(lambda: sorted(node.states().values()) == ["RUNNING", "RUNNING"], 30, "both serving")
        c.publish_weights(1)
        node.modes["e0"].write_text("weights_down")  # /weight_info answers 503; probes still pass
        c.publish_weights(2)  # e0 holds v1: one behind, within max_staleness 1
        assert node.routable() == {"e0": 1, "e1": 1}, c.status()["engines"]
    finally:
        kill_all([node.d] if node else [])
