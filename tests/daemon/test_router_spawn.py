"""[router] spawn = true: the daemon runs the router as its child, in front of PROTOCOL STAND-IN
engines (tests/support/standin_group.py; not vLLM), for each kind: the real vllm-router (PyPI
0.1.17; vime's flags, harness/router_proc.py: breaker off, a long request timeout) and the real
SMG (`smg launch`, smg 1.13.0; SPAWN_ARGS).

One node per kind is shared by the tests below, in order: spawned in a session of its own and
fed; the router SIGKILLed, restarted and re-filled at once with the routable engines and nothing
else; a daemon kill -9 + restart that keeps (adopts) the same router process; a shutdown that
takes the engines out of its list, then stops it last and leaves nothing of its group. For
vllm-router also: a SIGHUP reload that keeps the same router; a journal whose router entry names
another program (left alone) while the real router, named by none, is found on the port and
replaced; a SIGSTOPped router restarted past silent_timeout; its own log saying both workers
left before it was stopped; a missing binary refused by --check-config.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vime.harness.local_daemon import Daemon, free_port, standin_config, standin_model, standin_python
from vime.harness.router_proc import VIME_FLAGS
from vime.supervisor.client import SupervisorClient
from vime.supervisor.engine.process import live_group_members, proc_stat
from vime.supervisor.router import KINDS
from vime.supervisor.router.smg import SPAWN_ARGS

from support.polling import wait_until
from support.smg_proc import available
from support.standins import STANDIN_GROUP as STANDIN

REPO = Path(__file__).resolve().parents[2]
# Longer than any wait below: a refill seen within it was woken by the router's return.
PERIOD = 30.0
SILENT = 10.0  # router.silent_timeout: long enough that a loaded host's slow answer is not silence
# Each kind's flags, with its metrics on a port of its own (29000 may be taken).
ARGS = {"vllm-router": (*VIME_FLAGS, "--prometheus-host", "127.0.0.1"), "smg": SPAWN_ARGS}
COMM = {"smg": "smg::router"}  # SMG's own name for itself: how an orphan of ours is known
only_vllm_router = pytest.mark.parametrize("node", ["vllm-router"], indirect=True)


def wait(pred, timeout: float = 20.0, what: str = ""):
    return wait_until(pred, timeout, what, interval=0.05)


def workers(url: str) -> list[str] | None:
    """What the router may route to: its GET /workers (SMG's less the draining), None while it
    does not answer."""
    try:
        with urllib.request.urlopen(url + "/workers", timeout=2) as r:
            return sorted(w["url"] for w in json.load(r)["workers"] if w.get("status") != "draining")
    except OSError:
        return None


class Node:
    def __init__(self, tmp: Path, kind: str):
        python = standin_python(tmp, STANDIN)
        model = standin_model(tmp / "model")
        self.kind = kind
        self.ports = {n: free_port() for n in ("e0", "e1")}
        self.urls = {n: f"http://127.0.0.1:{p}" for n, p in self.ports.items()}
        self.url = f"http://127.0.0.1:{free_port()}"
        engines = [{"name": n, "model": str(model), "served_model_name": "tiny", "port": p,
                    "env": {"STANDIN_MODE_FILE": str(tmp / f"{n}.mode")}} for n, p in self.ports.items()]
        args = [*ARGS[kind], "--prometheus-port", str(free_port())]
        self.config = standin_config(tmp, python, engines, restart={"backoff_initial": 0.2},
                                     router={"url": self.url, "kind": kind, "spawn": True, "args": args,
                                             "period": PERIOD, "silent_timeout": SILENT})
        self.sock = str(tmp / "run" / "supervisor.sock")
        self.log = tmp / "logs" / "router.log"
        self.daemons: list[Daemon] = []  # every daemon started, and
        self.routers: set[int] = set()  # every router pid seen: for the teardown
        self.daemon: Daemon  # the one running now (started by the fixture)

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


@pytest.fixture(scope="module", params=KINDS)
def node(request, tmp_path_factory):
    kind = request.param
    if kind == "smg" and available("smg"):
        pytest.skip(available("smg"))
    n = Node(tmp_path_factory.mktemp(f"spawn-{kind}"), kind)
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


def test_the_daemon_spawns_the_router_in_its_own_session_and_feeds_it(node):
    wait(lambda: workers(node.url) == sorted(node.urls.values()), 60, "both engines listed")
    proc = node.process()
    assert proc["state"] == "running" and not proc["adopted"] and proc["restarts"] == 0, proc
    st = proc_stat(proc["pid"])
    # Its own session (what marks it ours); the engines lead their own groups in the daemon's
    # session (one scheduling autogroup with it).
    assert st is not None and st.pgrp == proc["pid"] and os.getsid(proc["pid"]) == proc["pid"]
    session = os.getsid(node.daemon.proc.pid)
    for e in node.client().status()["engines"]:
        engine = proc_stat(e["pid"]) if e["pid"] else None
        assert engine is not None and engine.pgrp == e["pid"] and os.getsid(e["pid"]) == session, e
    if node.kind in COMM:
        assert st.comm == COMM[node.kind]
    if node.kind == "smg":
        spawned = [e for e in node.daemon.events if e.get("event") == "router.spawned"]
        assert spawned and spawned[0]["cmd"][1:3] == ["launch", SPAWN_ARGS[0]], spawned
    journal = json.loads((node.config.parent / "state" / "journal.json").read_text())
    assert journal["router"]["pid"] == proc["pid"] and journal["router"]["start_time"] == st.start_time
    assert node.client().status()["router"]["kind"] == node.kind
    # supervisorctl status shows the router's process.
    out = subprocess.run([sys.executable, "-m", "vime.supervisor.client.cli", "--socket", node.sock, "status"],
                         capture_output=True, text=True, timeout=30, cwd=REPO).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith(f"router:{node.kind}"))
    assert "IN_SYNC" in line and f"spawned pid {proc['pid']} running" in line, line


def test_a_killed_router_is_restarted_and_refilled_with_exactly_the_routable_engines(node):
    c = node.client()
    c.stop("e1")  # not routable: the refilled router must not list it
    wait(lambda: workers(node.url) == [node.urls["e0"]], what="e1 out")
    old = node.process()["pid"]
    mark = node.daemon.mark()
    os.killpg(old, signal.SIGKILL)
    killed = time.monotonic()
    exited = node.daemon.wait_for(lambda e: e.get("event") == "router.exited", 10, after=mark)
    assert exited["pid"] == old and exited["how"] == "killed by SIGKILL" and exited["restart_in"] == 0
    # Restarted empty, re-filled at once (the feed is woken; its period is far longer).
    wait(lambda: workers(node.url) == node.routable() == [node.urls["e0"]], 15, "refilled with e0 alone")
    assert time.monotonic() - killed < PERIOD / 2
    new = node.process()
    assert new["pid"] != old and new["state"] == "running" and new["restarts"] == 1
    assert "vime_router_restarts_total 1.0" in c.metrics()
    c.start("e1")
    wait(lambda: workers(node.url) == node.routable() == sorted(node.urls.values()), 30, "e1 back")


@only_vllm_router
def test_a_reload_keeps_the_same_router(node):
    d, c = node.daemon, node.client()
    pid = node.process()["pid"]
    mark = d.mark()
    d.proc.send_signal(signal.SIGHUP)
    seen = []
    deadline = time.monotonic() + 60
    while not [e for e in d.events[mark:] if e.get("event") == "supervisor.started"]:
        assert time.monotonic() < deadline, "no reload within 60s"
        seen.append(workers(node.url))
        time.sleep(0.05)
    wait(lambda: c.status()["daemon"]["reloads"] == 1, 60, what="reloaded")
    proc = node.process()
    events = d.events[mark:]
    assert proc["pid"] == pid and proc["adopted"], (proc, [e for e in events if "router" in e.get("event", "")])
    assert [e.get("after") for e in events if e.get("event") == "router.adopted"] == ["a reload"]
    assert not [e for e in events if e.get("event") in ("router.spawned", "router.exited")]
    # Served throughout: the router never lost an engine (None: a read slower than 2 s, on a
    # loaded host, says nothing of the list).
    listed = [s for s in seen if s is not None]
    assert listed and all(s == sorted(node.urls.values()) for s in listed), seen


def test_a_daemon_killed_and_restarted_adopts_the_router_instead_of_spawning_another(node):
    pid = node.process()["pid"]
    node.daemon.kill()
    assert proc_stat(pid) is not None  # the router outlives the daemon: its own session
    node.daemon = node.start()
    proc = node.process()
    assert proc["pid"] == pid and proc["adopted"], proc
    events = node.daemon.events
    assert [e.get("after") for e in events if e.get("event") == "router.adopted"] == ["a daemon restart"]
    assert not [e for e in events if e.get("event") == "router.spawned"]
    wait(lambda: workers(node.url) == sorted(node.urls.values()), what="still listed")


@only_vllm_router
def test_a_router_no_journal_names_is_stopped_and_a_journaled_stranger_left_alone(node):
    """The daemon killed; its journal's router entry then names another program (a hand edit):
    that program, which does not hold the router's port, is never signalled, and the real
    router, named by no journal now, is found on the port, stopped and replaced."""
    pid = node.process()["pid"]
    node.daemon.kill()
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        path = node.config.parent / "state" / "journal.json"
        journal = json.loads(path.read_text())
        st = proc_stat(stranger.pid)
        assert st is not None
        journal["router"] = {**journal["router"], "pid": stranger.pid, "start_time": st.start_time}
        path.write_text(json.dumps(journal))
        node.daemon = d = node.start()
        orphan = d.wait_for(lambda e: e.get("event") == "router.orphan_stopped", 60)
        assert orphan["pid"] == pid and not live_group_members(pid)
        why = [e["why"] for e in d.events if e.get("event") == "router.not_adopted"]
        assert why and "does not listen on the journal's port" in why[0], why
        assert stranger.poll() is None  # never signalled
        wait(lambda: (p := node.process())["state"] == "running" and p["pid"] != pid and not p["adopted"],
             60, "a fresh router")
        wait(lambda: workers(node.url) == sorted(node.urls.values()), 30, "the fresh router refilled")
    finally:
        stranger.kill()
        stranger.wait()


@only_vllm_router
def test_a_router_that_stops_answering_is_restarted_and_refilled(node):
    """SIGSTOP: the process runs as far as /proc says, and answers nothing. Past
    router.silent_timeout it is stopped (SIGTERM, then SIGKILL) and started again."""
    d = node.daemon
    old = node.process()["pid"]
    mark = d.mark()
    os.killpg(old, signal.SIGSTOP)
    silent = d.wait_for(lambda e: e.get("event") == "router.silent", SILENT + 30, after=mark)
    assert silent["pid"] == old
    wait(lambda: (p := node.process())["state"] == "running" and p["pid"] != old, 60, "started again")
    assert not live_group_members(old)
    wait(lambda: workers(node.url) == sorted(node.urls.values()), 30, "refilled")


def test_shutdown_takes_the_engines_out_then_stops_the_router_last(node):
    d = node.daemon
    pid = node.process()["pid"]
    mark = d.mark()
    assert d.terminate(60) == 0
    after = d.events[mark:]
    events = [e.get("event") for e in after]
    stopped = events.index("router.stopped")
    removed = [i for i, e in enumerate(events) if e == "router.removed"]
    assert {after[i]["engine"] for i in removed} == {"e0", "e1"} and max(removed) < stopped, events
    assert max(i for i, e in enumerate(events) if e == "engine.transition") < stopped
    assert not live_group_members(pid)  # (an adopted router is init's to reap)
    journal = json.loads((node.config.parent / "state" / "journal.json").read_text())
    assert "router" not in journal


@only_vllm_router
def test_the_router_log_says_both_workers_left_before_its_stop(node):
    """vllm-router's own log, after the shutdown above."""
    text = node.log.read_text(errors="replace")
    term = text.rindex("terminate signal")
    assert all(text.rfind(f"Removed worker: {u}", 0, term) != -1 for u in node.urls.values()), text[-3000:]


def test_a_bad_binary_is_a_clear_check_config_error(tmp_path):
    model = standin_model(tmp_path / "model")
    cfg = standin_config(tmp_path, Path(sys.executable), [{"name": "e0", "model": str(model), "port": free_port()}],
                         router={"url": f"http://127.0.0.1:{free_port()}", "spawn": True,
                                 "binary": str(tmp_path / "no-such-router")})
    r = subprocess.run([sys.executable, "-m", "vime.supervisor", "--config", str(cfg), "--check-config"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
    assert f"router.binary: {tmp_path / 'no-such-router'} is not an executable file" in r.stderr, r.stderr
