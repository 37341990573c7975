"""The router the daemon feeds, with the real vllm-router binary (harness/router_proc.py: vime's
flags, breaker off) and PROTOCOL STAND-IN engines (tests/support/standin_group.py; not vLLM):
two daemons (two simulated nodes) feeding one router, the router killed and restarted, an
engine registering itself, and bad routers. What is vLLM's (a kill -9 under load, a frozen
EngineCore, a restart verified at the published weights, a drain) still needs its test against
real engines (docs/router.md, Tests).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web

from vime.harness.local_daemon import Daemon, free_port, kill_all, standin_config, standin_model, standin_python
from vime.cluster.routing import LostNodeRemoval, lost_urls
from vime.harness.router_proc import RouterProc
from vime.supervisor.client import SupervisorClient

from support.polling import wait_until
from support.standins import STANDIN_GROUP as STANDIN

PERIOD = 0.5  # drift repair, short for the test


def wait(pred, timeout: float = 20.0, what: str = ""):
    return wait_until(pred, timeout, what, interval=0.05)


def node(tmp: Path, names: tuple[str, ...], router_url: str, **router) -> tuple[Daemon, str, dict[str, str]]:
    """A daemon over stand-in engines feeding the router at `router_url`."""
    tmp.mkdir(parents=True, exist_ok=True)
    python = standin_python(tmp, STANDIN)
    model = standin_model(tmp / "model")
    ports = {n: free_port() for n in names}
    engines = [{"name": n, "model": str(model), "served_model_name": "tiny", "port": p,
                "env": {"STANDIN_MODE_FILE": str(tmp / f"{n}.mode")}} for n, p in ports.items()]
    cfg = standin_config(tmp, python, engines, router={"url": router_url, "period": PERIOD, **router})
    d = Daemon(cfg)
    d.wait_for(lambda e: e.get("event") == "supervisor.ready", 60)
    return d, str(tmp / "run" / "supervisor.sock"), {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}


def routable_urls(sock: str) -> set[str]:
    return {e["url"] for e in SupervisorClient(sock).routable_engines()["engines"]}


@pytest.fixture
def router(tmp_path):
    r = RouterProc(free_port(), tmp_path / "router.log").start()
    try:
        yield r
    finally:
        r.kill()


def test_two_daemons_feed_one_router_each_keeping_its_own_engines(tmp_path, router):
    a = b = None
    try:
        a, sock_a, urls_a = node(tmp_path / "a", ("a0", "a1"), router.url)
        b, sock_b, urls_b = node(tmp_path / "b", ("b0", "b1"), router.url)
        everyone = set(urls_a.values()) | set(urls_b.values())
        wait(lambda: set(router.workers()) == everyone, what="both nodes' engines listed")
        # Each daemon reports the other's engines as drift it leaves alone.
        st = wait(lambda: (s := SupervisorClient(sock_a).status()["router"])["unknown"] == sorted(urls_b.values())
                  and s, what="b's engines shown as drift by a")
        assert st["state"] == "drift", st
        assert sorted(st["ours"]) == ["a0", "a1"]

        # kill -9 one of a's engines: out of the router, b's untouched; back once routable again.
        victim = next(e for e in SupervisorClient(sock_a).status()["engines"] if e["name"] == "a0")
        mark = a.mark()
        os.killpg(victim["pid"], signal.SIGKILL)
        a.wait_for(lambda e: e.get("event") == "router.removed" and e.get("engine") == "a0", 20, after=mark)
        assert urls_a["a0"] not in router.workers()
        assert set(urls_b.values()) <= set(router.workers())
        a.wait_for(lambda e: e.get("event") == "router.added" and e.get("engine") == "a0", 60, after=mark)
        assert urls_a["a0"] in routable_urls(sock_a)
        assert set(router.workers()) == everyone
        # b never removed anything: a's engines are not its own.
        assert not [e for e in b.events if e.get("event") == "router.removed"]

        # b's node is lost: its daemon killed -9, its engines' URLs stay listed with no daemon to
        # own them. The cluster side (what AsyncClusterClient does at a node's loss) takes out the
        # URLs of b's last routable answer; a's stay, and a's daemon never puts b's back.
        last_b = SupervisorClient(sock_b).routable_engines()["engines"]
        b_pgids = set(b.spawned_pids())
        b.kill()
        assert set(urls_b.values()) <= set(router.workers())
        events: list[dict] = []
        removal = LostNodeRemoval(router.url, emit=events.append)
        try:
            out = asyncio.run(_remove_then_close(removal, "b", lost_urls(last_b)))
        finally:
            kill_all([], b_pgids)
        assert out == {u: "removed" for u in sorted(urls_b.values())}, out
        assert [(e["action"], e["node"]) for e in events] == [("removed", "b")] * 2, events
        time.sleep(3 * PERIOD)  # a's drift repair runs meanwhile
        assert set(router.workers()) == set(urls_a.values())
        # A router that is down: each URL's error is returned, nothing raises.
        down = asyncio.run(_remove_then_close(LostNodeRemoval(f"http://127.0.0.1:{free_port()}", timeout=0.5),
                                              "b", sorted(urls_b.values())))
        assert all("is the router running" in why for why in down.values()), down
    finally:
        kill_all([d for d in (a, b) if d is not None])


async def _remove_then_close(removal: LostNodeRemoval, node: str, urls: list[str]) -> dict[str, str]:
    try:
        return await removal.remove(node, urls)
    finally:
        await removal.aclose()


def test_the_router_restarted_empty_is_refilled_and_a_self_registered_engine_is_taken_out(tmp_path, router):
    d = None
    try:
        d, sock, urls = node(tmp_path, ("e0", "e1"), router.url)
        c = SupervisorClient(sock)
        wait(lambda: set(router.workers()) == set(urls.values()), what="both listed")
        # The router dies and comes back empty (external mode): the daemon refills it.
        router.kill()
        wait(lambda: c.status()["router"]["state"] == "unreachable", what="unreachable shown")
        assert {e["state"] for e in c.status()["engines"]} == {"RUNNING"}  # supervision unaffected
        router.start()
        wait(lambda: set(router.workers()) == set(urls.values()), what="refilled after the restart")
        wait(lambda: c.status()["router"]["state"] == "in_sync", what="in sync again")

        # An operator's stop: out of the router before it stops; back once routable again.
        mark = d.mark()
        c.stop("e1")
        assert urls["e1"] not in router.workers()
        removed = d.wait_for(lambda e: e.get("event") == "router.removed" and e.get("engine") == "e1", 5, after=mark)
        stopping = d.transition("e1", "STOPPING", 5, after=mark)
        assert d.events.index(removed) < d.events.index(stopping)
        c.start("e1")
        wait(lambda: set(router.workers()) == set(urls.values()), what="e1 back once routable")

        # A publish neither engine reports: both STALE, both out of the router before the
        # publish is answered.
        mark = d.mark()
        c.publish_weights(1)
        assert router.workers() == []
        # An engine registers itself (as vime's engines do at the end of their init): the
        # daemon takes it out again, since it is not verified at version 1.
        router.add(urls["e1"])  # raises RouterError unless the router took it
        d.wait_for(lambda e: e.get("event") == "router.removed" and e.get("engine") == "e1"
                   and e.get("why") == "not routable", 10, after=mark)
        wait(lambda: router.workers() == [], what="self-registered engine out")
        # e0 restarted at version 1 (the stand-in reports it): listed again, e1 still out.
        (tmp_path / "e0.mode").write_text("version=1")
        c.restart("e0")
        wait(lambda: router.workers() == [urls["e0"]], what="e0 back at version 1")
        assert c.status()["router"]["state"] == "in_sync"
    finally:
        kill_all([d] if d else [])


class BadRouter:
    """A PROTOCOL STAND-IN for a broken router: answers 500, or never answers."""

    def __init__(self, mode: str):
        self.mode, self.port = mode, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        async def handler(_):
            if self.mode == "hang":
                await asyncio.sleep(3600)
            return web.json_response({"error": "boom"}, status=500 if self.mode == "500" else 401)

        async def main():
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", handler)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            ready.set()
            await asyncio.Event().wait()

        self.loop.run_until_complete(main())


@pytest.mark.parametrize("mode, said", [
    ("refused", "is the router running at"),
    ("500", "500: boom"),
    ("hang", "no answer within 1s"),
    ("401", "refused our token; check router.token_file"),
])
def test_a_bad_router_is_reported_and_supervision_goes_on(tmp_path, mode, said):
    url = f"http://127.0.0.1:{free_port()}" if mode == "refused" else BadRouter(mode).url
    d = None
    try:
        d, sock, urls = node(tmp_path, ("e0",), url, timeout=1.0, remove_timeout=0.5)
        c = SupervisorClient(sock)
        # The error shows after the first failed attempt; unreachable once every attempt failed.
        first = wait(lambda: (s := c.status())["router"]["error"] and s, what="the error shown")
        assert said in first["router"]["error"], first["router"]
        st = wait(lambda: (s := c.status())["router"]["state"] == "unreachable" and s, what="unreachable shown")
        assert said in st["router"]["error"] and st["engines"][0]["state"] == "RUNNING", st
        assert d.wait_for(lambda e: e.get("event") == "router.call_failed", 5)["action"].startswith(
            "supervision goes on")
        # A kill -9 is still detected and restarted while the router is down.
        mark = d.mark()
        os.killpg(st["engines"][0]["pid"], signal.SIGKILL)
        d.transition("e0", "RUNNING", 60, after=mark)
        # A publish that leaves e0 STALE waits for its removal at most remove_timeout, then is
        # answered: a router that is down or hangs never holds the trainer's publish.
        said = c.publish_weights(1)["message"]
        assert "stale (not routable until synced): e0" in said and \
            "the router has not confirmed their removal within remove_timeout (0.5s), still retried: e0" in said, said
        metrics = c.metrics()
        assert "vime_router_up 0.0" in metrics and 'vime_router_calls_total{op="list",result="error"}' in metrics
    finally:
        kill_all([d] if d else [])


def test_a_daemon_restarted_after_a_kill_never_takes_its_healthy_engines_out(tmp_path, router):
    """kill -9 of the daemon, then a fresh start on the same journal: the adopted engines are
    checked again before the router is fed, so the router's list never loses them."""
    d = d2 = None
    try:
        d, sock, urls = node(tmp_path, ("e0", "e1"), router.url)
        wait(lambda: set(router.workers()) == set(urls.values()), what="both listed")
        # The journal knows them RUNNING: one killed in the instant before the journal is
        # written is adopted as STARTING, and is rightly kept out until it is checked again.
        journal = tmp_path / "state" / "journal.json"
        wait(lambda: {e.get("state") for e in json.loads(journal.read_text())["engines"].values()} == {"RUNNING"},
             what="the journal records both RUNNING")
        d.kill()
        d2 = Daemon(tmp_path / "sup.toml")
        d2.wait_for(lambda e: e.get("event") == "supervisor.ready", 60)
        seen = []
        deadline = time.monotonic() + 3 * PERIOD + 2
        while time.monotonic() < deadline:
            seen.append(set(router.workers()))
            time.sleep(0.02)
        assert all(s == set(urls.values()) for s in seen), [s for s in seen if s != set(urls.values())][:3]
        assert [e.get("engine") for e in d2.events if e.get("event") == "engine.adopted"], "nothing adopted"
        assert not [e for e in d2.events if e.get("event") == "router.removed"]
    finally:
        kill_all([x for x in (d2, d) if x is not None])


def test_a_reload_that_drops_an_engine_takes_it_out_of_the_router_first(tmp_path, router):
    """SIGHUP with e1 gone from the config: the old image drains e1 (out of the router) before
    the exec; the next image stops it, and its URL, no longer any daemon's, is not left listed."""
    d = None
    try:
        d, sock, urls = node(tmp_path, ("e0", "e1"), router.url)
        wait(lambda: set(router.workers()) == set(urls.values()), what="both listed")
        cfg = tmp_path / "sup.toml"
        cfg.write_text(_without_engine(cfg.read_text(), "e1"))
        mark = d.mark()
        d.proc.send_signal(signal.SIGHUP)
        drained = d.wait_for(lambda e: e.get("event") == "supervisor.reload_drains", 30, after=mark)
        assert drained["engines"] == ["e1"]
        exec_at = d.wait_for(lambda e: e.get("event") == "supervisor.reexec", 60, after=mark)
        removed = d.wait_for(lambda e: e.get("event") == "router.removed" and e.get("engine") == "e1", 5, after=mark)
        assert d.events.index(removed) < d.events.index(exec_at)
        d.wait_for(lambda e: e.get("event") == "supervisor.started" and e.get("generation") == 1, 60, after=mark)
        wait(lambda: (s := SupervisorClient(sock).status())["router"]["state"] == "in_sync" and s,
             what="the next image in sync")
        assert router.workers() == [urls["e0"]]
        assert SupervisorClient(sock).status()["router"]["unknown"] == []
    finally:
        kill_all([d] if d else [])


def _without_engine(toml: str, name: str) -> str:
    """The config text less the [[engines]] table named `name`."""
    head, *tables = toml.split("[[engines]]")
    keep = [t for t in tables if f'name = "{name}"' not in t]
    return "[[engines]]".join([head, *keep])
