"""The paths by which an engine the daemon has not verified could stay in the router, each
closed against the daemon's one routing rule (verified at the current version). A real daemon
over PROTOCOL STAND-IN engines (tests/support/standin_group.py) and a PROTOCOL STAND-IN router
(tests/support/standin_router.py: a POST it finishes after the daemon gave up, a DELETE that
fails, a router that stops answering), its list sampled every 50 ms.

The bound on an engine of ours listed while not routable: the list-watch interval or
remove_timeout, whichever is larger, plus one call (a DELETE, at most remove_timeout), plus
SLACK (two samples and the scheduling of a loaded 2-core machine).
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from vime.harness.local_daemon import (
    Daemon, EventStream, free_port, kill_all, standin_config, standin_model, standin_python)
from vime.supervisor.client import SupervisorClient

from support.polling import wait_until
from support.standin_router import StandinRouter, listed_after, listed_stretches
from support.standins import STANDIN_GROUP as STANDIN

WATCH = 0.3
REMOVE_TIMEOUT = 0.5
SLACK = 0.3
BOUND = max(WATCH, REMOVE_TIMEOUT) + REMOVE_TIMEOUT + SLACK
# The full reconcile far away: what bounds a listing here is the watch alone.
ROUTER = {"period": 30.0, "watch": WATCH, "remove_timeout": REMOVE_TIMEOUT, "timeout": 0.5}


def node(tmp: Path, modes: dict[str, str], router_url: str) -> tuple[Daemon, SupervisorClient, dict[str, str]]:
    python = standin_python(tmp, STANDIN)
    model = standin_model(tmp / "model")
    ports = {n: free_port() for n in modes}
    engines = []
    for n, m in modes.items():
        (tmp / f"{n}.mode").write_text(m)
        engines.append({"name": n, "model": str(model), "served_model_name": "tiny", "port": ports[n],
                        "env": {"STANDIN_MODE_FILE": str(tmp / f"{n}.mode")}})
    d = Daemon(standin_config(tmp, python, engines, router={"url": router_url, **ROUTER}))
    d.wait_for(lambda e: e.get("event") == "supervisor.ready", 60)
    return d, SupervisorClient(str(tmp / "run" / "supervisor.sock")), {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}


class Sampler:
    """The router's list every 50 ms, on a thread."""

    def __init__(self, router: StandinRouter):
        self.router, self.samples = router, []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self.router.workers()))
            time.sleep(0.05)

    def stop(self) -> list[tuple[float, list[str]]]:
        self._stop.set()
        self._t.join(5)
        return self.samples


def test_an_add_that_timed_out_and_completed_later_is_not_left_listed(tmp_path):
    """The router finishes each POST 1.5 s after it came, long after the daemon's call gave
    up (timeout 0.5 s). The engine leaves the routable set (a publish it does not hold) while
    the POSTs are pending: no POST is sent after that, and the adds the router completes later
    are out within the bound."""
    router = StandinRouter(post_delay=1.5)
    d = None
    try:
        d, c, urls = node(tmp_path, {"e0": "ok"}, router.url)
        wait_until(lambda: router.posts, 20, "the daemon's first POST", interval=0.05)
        said = c.publish_weights(1)["message"]  # e0 holds the base weights: STALE
        left = time.monotonic()
        assert "stale (not routable until synced): e0" in said, said
        sampler = Sampler(router)
        time.sleep(1.5 + 3 * 0.5 + BOUND + 1.0)  # every pending POST landed, and the bound after it
        samples = sampler.stop()
        posted = [t for t, _ in router.posts]
        assert posted and all(t <= left + 0.05 for t in posted), ("a POST after e0 left", posted, left)
        late = [t for t, u in router.landed if u == urls["e0"] and t > left]
        assert late, "no add landed after e0 left: the stand-in did not show the path"
        lasted = [listed_after(samples, urls["e0"], t) for t in late]
        assert max(lasted) <= BOUND, (lasted, BOUND)
        assert max(listed_stretches(samples, urls["e0"]), default=0.0) <= BOUND
        assert router.workers() == []
        assert any(e.get("event") == "router.removed" and e.get("engine") == "e0" for e in d.events)
    finally:
        kill_all([d] if d else [])
        router.close()


def other_name_for_loopback() -> str:
    """A third spelling of 127.0.0.1: this machine's hostname where it resolves there (as on
    most CI machines), else 127.1 (the short IPv4 form every resolver reads as 127.0.0.1)."""
    name = socket.gethostname()
    try:
        if "127.0.0.1" in {i[4][0] for i in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)}:
            return name
    except OSError:
        pass
    return "127.1"


def test_a_self_registration_under_any_spelling_is_ours_and_out_within_the_watch(tmp_path):
    """e0 is not routable (STALE after a publish it does not hold); the RL framework registers
    it as localhost, LOCALHOST with a slash, and a third spelling of its host: each is ours,
    never unknown, and out within the bound. Then a drain whose DELETE fails says so, and a
    router that stops answering is logged at its first failed attempt."""
    router = StandinRouter()
    d = None
    try:
        d, c, urls = node(tmp_path, {"e0": "ok", "e1": "version=1"}, router.url)
        wait_until(lambda: sorted(router.workers()) == sorted(urls.values()), 30, "both listed", interval=0.05)
        c.publish_weights(1)
        assert router.workers() == [urls["e1"]]
        port = urls["e0"].rsplit(":", 1)[1]
        sampler = Sampler(router)
        spellings = [f"http://localhost:{port}", f"http://LOCALHOST:{port}/", f"http://{other_name_for_loopback()}:{port}"]
        added = {}
        for url in spellings:
            added[url] = time.monotonic()
            router.add(url)
            time.sleep(BOUND + 0.5)
        samples = sampler.stop()
        for url in spellings:
            lasted = listed_after(samples, url, added[url])
            assert lasted <= BOUND, (url, lasted, BOUND)
            assert max(listed_stretches(samples, url), default=0.0) <= BOUND
        assert router.workers() == [urls["e1"]]
        removed = [e for e in d.events if e.get("event") == "router.removed" and e.get("why") == "not routable"]
        assert {e["url"] for e in removed} == set(spellings) and {e["engine"] for e in removed} == {"e0"}, removed
        assert c.status()["router"]["unknown"] == []

        # A drain whose DELETE fails reports what the router answered.
        router.fail_deletes = True
        said = c.stop("e1")["message"]
        assert "not removed from the router" in said and "503" in said, said
        router.fail_deletes = False
        wait_until(lambda: router.workers() == [] and c.status()["router"]["error"] is None, 15,
                   "e1 out, and no call retrying, once DELETEs are answered", interval=0.05)

        # The router stops answering: logged and evented at the first failed attempt (each
        # attempt costs timeout, 0.5 s), with what holds meanwhile, before every attempt failed.
        stream = EventStream(str(tmp_path / "run" / "supervisor.sock"))
        wait_until(lambda: stream.of("hello"), 10, "the event stream open")
        mark = d.mark()
        router.hang = True
        first = d.wait_for(lambda e: e.get("event") == "router.not_answering", 10, after=mark)
        assert "no answer within 0.5s" in first["error"] and first["attempt"] == 1, first
        assert "still probed" in first["keeps"] and "cannot change" in first["cannot"], first
        failed = d.wait_for(lambda e: e.get("event") == "router.call_failed", 10, after=mark)
        assert d.events.index(first) < d.events.index(failed)
        ev = wait_until(lambda: stream.of("router_error", final=False), 5, "router_error at the first attempt")[0]
        assert ev["attempt"] == 1 and ev["keeps"] == first["keeps"] and ev["cannot"] == first["cannot"], ev
    finally:
        router.hang = False
        kill_all([d] if d else [])
        router.close()
