"""restart_load = "dummy" through the daemon: a restart boots on vLLM's dummy weights only when
the trainer's agent is connected to push every tensor; when no push can come, the dummy
incarnation is never served and is restarted reading the model, and the log says why.

The engine is a PROTOCOL STAND-IN (tests/support/standin_group.py, run as the daemon's
`python`): its /weight_info answers what its mode file says, base weights for a dummy boot.
The daemon's decisions (which command line, when to fall back) are ours and run for real;
that a dummy-booted real engine ends RUNNING with the pushed weights is
tests/engine/test_resync_real.py.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from vime.harness.local_daemon import Daemon, free_port, kill_all, standin_config, standin_model, standin_python
from vime.supervisor.client import DaemonUnreachable, SupervisorClient

from support.standins import STANDIN_GROUP as STANDIN



@pytest.fixture
def world(tmp_path):
    python = standin_python(tmp_path, STANDIN)
    model = standin_model(tmp_path / "model")
    mode = tmp_path / "mode"
    mode.write_text("version=1")
    cfg = standin_config(
        tmp_path, python, [{"name": "e0", "model": str(model), "port": free_port(), "env": {"STANDIN_MODE_FILE": str(mode)}}],
        supervisor={"restart_load": "dummy"})
    d = Daemon(cfg)
    w = type("World", (), {})()
    w.daemon, w.mode, w.sock = d, mode, str(tmp_path / "run" / "supervisor.sock")
    try:
        d.transition("e0", "RUNNING", 30)
        SupervisorClient(w.sock).publish_weights(1)
        yield w
    finally:
        kill_all([d])


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().rstrip("\0").split("\0")


class Agent:
    """A trainer agent's event stream (role=agent) that never pushes, read in the background."""

    def __init__(self, sock: str):
        self.requests: list[dict] = []
        self.client = SupervisorClient(sock)
        self.connected = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.connected.wait(10)

    def _read(self) -> None:
        try:
            for ev in self.client.events(role="agent", reconnect=False):
                if ev["event"] == "hello":
                    self.connected.set()
                elif ev["event"] == "sync_request":
                    self.requests.append(ev)
        except DaemonUnreachable:
            pass

    def leave(self) -> None:
        self.client.close()


def test_with_an_agent_a_restart_boots_on_dummy_weights_and_falls_back_when_it_leaves(world):
    d = world.daemon
    agent = Agent(world.sock)
    world.mode.write_text("ok")  # a dummy boot reports base weights: behind v1
    mark = d.mark()
    os.kill(d.last_pid("e0"), signal.SIGKILL)
    spawned = d.wait_for(lambda e: e.get("event") == "engine.spawned", 30, after=mark)
    assert spawned["load"] == "dummy" and cmdline(spawned["pid"])[-2:] == ["--load-format", "dummy"]
    stale = d.transition("e0", "STALE", 30, after=mark)
    assert "weights base, current v1" in stale["reason"]
    d.wait_for(lambda e: e.get("event") == "sync.requested", 10, after=mark)
    assert SupervisorClient(world.sock).routable_engines()["engines"] == []  # never served on dummy weights
    agent.leave()  # the push is not coming
    condemned = d.wait_for(lambda e: e.get("event") == "engine.transition" and e.get("engine") == "e0"
                           and e.get("to_state") == "UNHEALTHY", 20, after=mark)
    assert "dummy weights" in condemned["reason"] and "restarting reading the model" in condemned["reason"]
    again = d.wait_for(lambda e: e.get("event") == "engine.spawned" and e["pid"] != spawned["pid"], 30, after=mark)
    assert again["load"] == "model" and "--load-format" not in cmdline(again["pid"])


def test_without_an_agent_a_restart_reads_the_model(world):
    d = world.daemon
    mark = d.mark()
    os.kill(d.last_pid("e0"), signal.SIGKILL)
    spawned = d.wait_for(lambda e: e.get("event") == "engine.spawned", 30, after=mark)
    assert spawned["load"] == "model" and "--load-format" not in cmdline(spawned["pid"])
    assert d.transition("e0", "RUNNING", 30, after=mark)["reason"].endswith("weights v1, verified")
