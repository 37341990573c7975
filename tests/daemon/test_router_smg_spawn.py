"""[router] kind = "smg", spawn = true: the daemon runs the real SMG (`smg launch`, smg 1.13.0)
as its child, in front of PROTOCOL STAND-IN engines (tests/support/standin_group.py; not vLLM),
as test_router_spawn.py does with vllm-router. One node for the tests below, in order: spawned
in a session of its own and fed; SIGKILLed, restarted and re-filled at once with exactly the
routable engines; a daemon kill -9 and restart that adopts the same SMG; a shutdown that takes
the engines out of its list, then stops it last and leaves nothing of its group.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from vime.harness.local_daemon import Daemon, free_port, standin_config, standin_model, standin_python
from vime.supervisor.client import SupervisorClient
from vime.supervisor.engine.process import live_group_members, proc_stat
from vime.supervisor.router.smg import SPAWN_ARGS

from support.polling import wait_until
from support.smg_proc import available
from support.standins import STANDIN_GROUP as STANDIN

PERIOD = 30.0  # longer than any wait below: a refill seen within it was woken by SMG's return


def wait(pred, timeout: float = 20.0, what: str = ""):
    return wait_until(pred, timeout, what, interval=0.05)


def routed(url: str) -> list[str] | None:
    """What SMG may route to (GET /workers less the draining), None while it does not answer."""
    try:
        with urllib.request.urlopen(url + "/workers", timeout=2) as r:
            return sorted(w["url"] for w in json.load(r)["workers"] if w.get("status") != "draining")
    except OSError:
        return None


class Node:
    def __init__(self, tmp: Path):
        python = standin_python(tmp, STANDIN)
        model = standin_model(tmp / "model")
        self.ports = {n: free_port() for n in ("e0", "e1")}
        self.urls = {n: f"http://127.0.0.1:{p}" for n, p in self.ports.items()}
        self.url = f"http://127.0.0.1:{free_port()}"
        engines = [{"name": n, "model": str(model), "served_model_name": "tiny", "port": p,
                    "env": {"STANDIN_MODE_FILE": str(tmp / f"{n}.mode")}} for n, p in self.ports.items()]
        args = [*SPAWN_ARGS, "--prometheus-port", str(free_port())]  # 29000 may be taken
        self.config = standin_config(tmp, python, engines, restart={"backoff_initial": 0.2},
                                     router={"url": self.url, "kind": "smg", "spawn": True, "args": args,
                                             "period": PERIOD})
        self.sock = str(tmp / "run" / "supervisor.sock")
        self.daemons: list[Daemon] = []
        self.routers: set[int] = set()
        self.daemon: Daemon

    def start(self) -> Daemon:
        d = Daemon(self.config)
        self.daemons.append(d)
        d.wait_for(lambda e: e.get("event") == "supervisor.ready", 60)
        return d

    def client(self) -> SupervisorClient:
        return SupervisorClient(self.sock)

    def process(self) -> dict:
        st = self.client().status()["router"]["process"]
        if st.get("pid"):
            self.routers.add(st["pid"])
        return st

    def routable(self) -> list[str]:
        return sorted(e["url"] for e in self.client().routable_engines()["engines"])


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    if available("smg"):
        pytest.skip(available("smg"))
    n = Node(tmp_path_factory.mktemp("smg-spawn"))
    try:
        n.daemon = n.start()
        yield n
    finally:
        for d in n.daemons:
            d.kill()
            n.routers |= {e["pid"] for e in d.events if e.get("event") == "router.spawned"}
        for pid in n.routers | {p for d in n.daemons for p in d.spawned_pids()}:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


def test_the_daemon_spawns_smg_in_its_own_session_and_feeds_it(node):
    wait(lambda: routed(node.url) == sorted(node.urls.values()), 60, "both engines listed")
    proc = node.process()
    assert proc["state"] == "running" and not proc["adopted"] and proc["restarts"] == 0, proc
    st = proc_stat(proc["pid"])
    assert st is not None and st.pgrp == proc["pid"] and os.getsid(proc["pid"]) == proc["pid"]
    assert st.comm == "smg::router"  # SMG's own name for itself: how an orphan of ours is known
    spawned = [e for e in node.daemon.events if e.get("event") == "router.spawned"]
    assert spawned and spawned[0]["cmd"][1:3] == ["launch", SPAWN_ARGS[0]], spawned
    assert node.client().status()["router"]["kind"] == "smg"


def test_a_killed_smg_is_restarted_and_refilled_with_exactly_the_routable_engines(node):
    c = node.client()
    c.stop("e1")  # not routable: the refilled SMG must not list it
    wait(lambda: routed(node.url) == [node.urls["e0"]], what="e1 out")
    old = node.process()["pid"]
    mark = node.daemon.mark()
    os.killpg(old, signal.SIGKILL)
    killed = time.monotonic()
    exited = node.daemon.wait_for(lambda e: e.get("event") == "router.exited", 10, after=mark)
    assert exited["pid"] == old and exited["how"] == "killed by SIGKILL" and exited["restart_in"] == 0
    wait(lambda: routed(node.url) == node.routable() == [node.urls["e0"]], 15, "refilled with e0 alone")
    assert time.monotonic() - killed < PERIOD / 2
    new = node.process()
    assert new["pid"] != old and new["state"] == "running" and new["restarts"] == 1
    c.start("e1")
    wait(lambda: routed(node.url) == node.routable() == sorted(node.urls.values()), 30, "e1 back")


def test_a_daemon_killed_and_restarted_adopts_smg(node):
    pid = node.process()["pid"]
    node.daemon.kill()
    assert proc_stat(pid) is not None  # SMG outlives the daemon: its own session
    node.daemon = node.start()
    proc = node.process()
    assert proc["pid"] == pid and proc["adopted"], proc
    events = node.daemon.events
    assert [e.get("after") for e in events if e.get("event") == "router.adopted"] == ["a daemon restart"]
    assert not [e for e in events if e.get("event") == "router.spawned"]
    wait(lambda: routed(node.url) == sorted(node.urls.values()), what="still listed")


def test_shutdown_takes_the_engines_out_then_stops_smg_last(node):
    d = node.daemon
    pid = node.process()["pid"]
    mark = d.mark()
    assert d.terminate(60) == 0
    events = [e.get("event") for e in d.events[mark:]]
    stopped = events.index("router.stopped")
    removed = [i for i, e in enumerate(events) if e == "router.removed"]
    assert {d.events[mark + i]["engine"] for i in removed} == {"e0", "e1"} and max(removed) < stopped, events
    assert not live_group_members(pid)
    journal = json.loads((node.config.parent / "state" / "journal.json").read_text())
    assert "router" not in journal
