"""restart_immediately: a dead engine boots during the round but joins routing only in the gap."""

from __future__ import annotations

import os
import signal

import pytest

from vime.supervisor.client import SupervisorClient
from vime.harness.local_daemon import ENGINE_ARGS, ENGINE_ENV, Daemon, free_port, live_pids_in_groups, write_config

pytestmark = pytest.mark.engine
BOOT = 240


@pytest.fixture(scope="module")
def daemon(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("immediate")
    cfg = write_config(
        root / "supervisor.toml",
        supervisor={"runtime_dir": str(root / "run"), "log_dir": str(root / "logs"), "stop_timeout": 5.0,
                    "restart_immediately": True},
        health_check={"first_wait": float(BOOT), "interval": 2.0, "timeout": 10.0, "failure_threshold": 3},
        engine_defaults={"args": ENGINE_ARGS, "env": ENGINE_ENV},
        engines=[{"name": "solo", "model": str(tiny_model), "served_model_name": "tiny", "port": free_port()}],
    )
    d = Daemon(cfg)
    yield d
    pids = set(d.spawned_pids())
    assert d.terminate(60) == 0
    assert live_pids_in_groups(pids) == []


def test_boots_during_the_round_routed_only_after_it(daemon):
    daemon.transition("solo", "RUNNING", BOOT)
    client = SupervisorClient(daemon.sock)
    client.start_round(1)
    mark = daemon.mark()
    os.kill(daemon.last_pid("solo"), signal.SIGKILL)
    daemon.transition("solo", "EXITED", 10, after=mark)
    daemon.transition("solo", "STARTING", 15, after=mark)  # at once, inside the round
    held = daemon.transition("solo", "STALE", BOOT, after=mark)
    assert "held out of routing until round 1 ends" in held["reason"]
    assert client.routable_engines()["engines"] == []
    assert not any(e.get("to_state") == "RUNNING" for e in daemon.events[mark:])
    client.end_round(1)
    running = daemon.transition("solo", "RUNNING", 15, after=mark)
    assert running["reason"].startswith("round 1 ended")
    assert [e["name"] for e in client.routable_engines()["engines"]] == ["solo"]
