"""The fleet broadcast (weight_sync.broadcast.FleetSender) into stand-in receivers (seconds).

Stand-ins: `python -m vime.harness.loopback --keep` processes, each the real
GlooWeightTransferEngine receive path behind vLLM's HTTP routes with a model stub that keeps
what it receives (GET /stand_in digests it and counts the "model" reloads). Real processes and
sockets, so a receiver can be SIGKILLed or SIGSTOPped in the middle of a broadcast.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from vime.weight_sync.broadcast import FleetSender
from vime.weight_sync.sender import push_deadline

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is None, reason="the stand-ins need vLLM")


def start_stand_ins(n: int) -> list[tuple[subprocess.Popen, str]]:
    """n stand-in receivers, started together (each imports vLLM: seconds)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    procs = [subprocess.Popen([sys.executable, "-m", "vime.harness.loopback", "--keep"], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
             for _ in range(n)]
    out = []
    for p in procs:
        line = p.stdout.readline() if p.stdout else ""
        assert line.startswith("READY"), line
        out.append((p, f"http://127.0.0.1:{int(line.split()[1])}"))
    return out


def stop_stand_ins(procs) -> None:
    for p, _ in procs:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            except ProcessLookupError:
                pass
        p.wait(10)


@pytest.fixture(scope="module")
def stand_ins():
    """Eight: the first three for most tests, all of them for the stall test's chain."""
    procs = start_stand_ins(8)
    yield procs
    stop_stand_ins(procs)


def state(url: str) -> dict:
    with urllib.request.urlopen(url + "/stand_in", timeout=10) as r:
        return json.loads(r.read())


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest() \
        if t.numel() else ""


def model(seed: int, n: int = 6, shape=(64, 48)) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    pairs = [(f"layers.{i}.w", torch.randn(*shape, generator=g)) for i in range(n)]
    return pairs + [("norm.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
                    ("step", torch.tensor(seed))]


def fleet_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("fleet-")]


def test_broadcast_delivers_every_byte_reuses_the_group_and_rebuilds_on_a_new_set(stand_ins):
    urls = [u for _, u in stand_ins[:3]]
    with FleetSender(bucket_bytes=4096, solo_bytes=None, rendezvous_s=20) as fs:
        for version in (1, 2):
            pairs = model(version)
            res = fs.push(urls, pairs, version)
            assert [r.status for r in res.values()] == ["ok"] * 3, res
            assert all(r.group_inits == (1 if version == 1 else 0) for r in res.values())
            for u in urls:
                st = state(u)
                assert st["version"] == str(version) and not st["paused"] and st["poisoned"] is None
                assert st["received"] == {n: digest(t) for n, t in pairs}, u
                assert st["reloads_begun"] == st["reloads_ended"] == version  # one per push
        assert fs.group_inits == 1 and fs.members == tuple(urls)
        res = fs.push(urls[:2], model(3), 3)  # the set changed: a new group
        assert all(r.ok and r.group_inits == 1 for r in res.values()) and fs.group_inits == 2
        assert state(urls[2])["version"] == "2"
        res = fs.push(urls, model(4), 4)  # and back
        assert all(r.ok for r in res.values()) and fs.group_inits == 3
    assert fleet_threads() == []


def test_the_example_loops_pusher_broadcasts_and_resyncs_one(stand_ins):
    from vime.trainer.rl_loop import Pusher

    urls = [u for _, u in stand_ins[:3]]
    p = Pusher()
    try:
        assert p.push_many(urls, model(11), 11) == {u: "ok" for u in urls}
        assert p.fleet.members == tuple(urls)
        assert p.push(urls[0], model(12), 12) == "ok"  # a resync over its own group...
        assert p.fleet.members == ()  # ...replaces the fleet's in that engine: rebuilt next
        assert p.push_many(urls, model(13), 13) == {u: "ok" for u in urls}
        assert urls[0] not in p.senders and all(state(u)["version"] == "13" for u in urls)
    finally:
        p.close()


def test_push_deadline_grows_with_the_bytes(monkeypatch):
    assert push_deadline(0) == 30.0 and push_deadline(500_000_000) == 40.0
    monkeypatch.setenv("VIME_PUSH_FLOOR_MBPS", "100")
    monkeypatch.setenv("VIME_PUSH_RENDEZVOUS_S", "5")
    assert push_deadline(1_000_000_000) == 15.0
    assert FleetSender().deadline_for(2_000_000_000) == 25.0
    assert FleetSender(transfer_timeout=7).deadline_for(10**12) == 7.0
    monkeypatch.setenv("VIME_PUSH_FLOOR_MBPS", "0")
    with pytest.raises(ValueError):
        push_deadline(1)


def test_a_bad_backend_or_stall_window_says_what_works():
    with pytest.raises(ValueError, match="gloo.*nccl"):
        FleetSender(backend="mpi")
    with pytest.raises(ValueError, match="stall_s must be positive"):
        FleetSender(stall_s=0)


BIG = [(f"layers.{i}.w", torch.full((512, 1024), float(i))) for i in range(12)]  # 2 MiB each


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_a_receiver_faulted_mid_broadcast_costs_that_receiver_only(stand_ins, sig):
    """Rank 2 of 4 is faulted after bucket 1. The push fails within its bound, the survivors are
    redone at the version, the faulted one reported, and nothing is left running in the trainer."""
    procs = stand_ins
    try:
        urls = [u for _, u in procs[:3]]
        victim_proc, victim = procs[1]
        before = fleet_threads()

        seen: dict[str, float] = {}

        def fault(step, info):
            seen.setdefault(step, time.monotonic())
            if step == "bucket_sent" and info["index"] == 1 and "fault" not in seen:
                seen["fault"] = time.monotonic()
                os.kill(victim_proc.pid, getattr(signal, sig))

        reloads = {u: state(u)["reloads_begun"] for u in urls}
        # The group is built under a generous bound (a loaded machine's rendezvous can take
        # seconds), then the faulted push runs on it under a tight one: the fault lands in a
        # transfer.
        fs = FleetSender(bucket_bytes=1 << 20, floor_mbps=50, rendezvous_s=60, http_timeout=3)
        assert fs.push(urls, model(0), 0)[victim].ok
        fs.rendezvous_s = 6
        # The stall window inside the deadline (7 s by default, more than this whole push's
        # deadline): a survivor stalled behind the faulted rank fails its hop and answers before
        # the attempt ends, as it does under a real push's deadline of 30 s or more.
        fs.stall_s = 3
        deadline = fs.deadline_for(sum(t.numel() * t.element_size() for _, t in BIG))
        fs.progress = fault
        t0 = time.monotonic()
        res = fs.push(urls, BIG, 5)
        took = time.monotonic() - t0
        fs.progress = None
        assert res[victim].status == "unreachable" and not res[victim].ok, res[victim]
        for u in (urls[0], urls[2]):
            assert res[u].ok and res[u].redone, res[u]
            st = state(u)
            assert st["version"] == "5" and st["poisoned"] is None and not st["paused"]
            assert st["received"]["layers.11.w"] == digest(BIG[11][1])
            # The failed staged receive never touched the model: one reload per loaded push.
            assert st["reloads_begun"] == st["reloads_ended"] == reloads[u] + 2
        # The collective fails within the push's deadline (SIGKILL: at once, from the closed
        # sockets); the whole push, redo included, within two deadlines and the HTTP grace
        # (a survivor stalled behind a stopped peer waits out its per-receive timeout).
        print(f"{sig}: failed {seen['transfer_failed'] - seen['fault']:.2f}s after the fault, "
              f"push {took:.2f}s, deadline {deadline:.2f}s")
        assert seen["transfer_failed"] - t0 < deadline + 1
        assert took < 2 * deadline + 10, took
        fs.close()
        t_end = time.monotonic() + 5
        while fleet_threads() != before and time.monotonic() < t_end:
            time.sleep(0.1)
        assert fleet_threads() == before
    finally:  # replace the faulted one for the next test
        stop_stand_ins([procs[1]])
        procs[1] = start_stand_ins(1)[0]


def test_staged_receive_failure_leaves_the_model_untouched():
    from vime.harness.loopback import LoopbackEngine

    eng = LoopbackEngine(keep=True)
    try:
        fs = FleetSender(bucket_bytes=1 << 20, rendezvous_s=10)
        assert fs.push([eng.url], model(1), 1)[eng.url].ok

        def boom(step, info):
            if step == "bucket_sent" and info["index"] == 2:
                raise RuntimeError("injected mid-broadcast")

        fs.progress = boom
        r = fs.push([eng.url], BIG, 2, redo=False)[eng.url]
        assert r.status == "intact" and not r.ok and not r.poisoned, r
        assert "not loaded" in str(r.error)
        e = eng.engine
        assert e.poisoned is None and e.reloads_begun == 1 and not e._in_session and e.group is None
        assert eng.version == "1" and not eng.paused  # old weights, serving again
        assert dict(eng.received)["layers.0.w"].shape == (64, 48)  # nothing of v2 loaded
        fs.progress = None
        assert fs.push([eng.url], BIG, 3)[eng.url].ok and eng.version == "3"  # safe to push again
        fs.close()
    finally:
        eng.close()


def test_a_receiver_that_never_joins_the_group_costs_only_itself(stand_ins):
    """A receiver that answers /get_world_size and /health but never completes its
    /init_weight_transfer_engine (a wedged worker; a stand-in HTTP server here) holds every
    other receiver's rendezvous: the ones that did join (seen in the group's store) are intact
    and redone over a new group; the wedged one alone is reported."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    release = threading.Event()

    class Wedged(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _answer(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._answer({"world_size": 1} if self.path == "/get_world_size" else {})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/init_weight_transfer_engine":
                release.wait(120)  # never joins
            self._answer({})

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Wedged)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    wedged = f"http://127.0.0.1:{srv.server_address[1]}"
    good = [u for _, u in stand_ins[:2]]
    try:
        fs = FleetSender(bucket_bytes=1 << 20, rendezvous_s=6, http_timeout=5)
        res = fs.push([*good, wedged], model(7), 7)
        assert res[wedged].status == "unreachable" and "init_weight_transfer_engine" in str(res[wedged].error)
        for u in good:
            assert res[u].ok and res[u].redone, res[u]
            assert state(u)["version"] == "7"
        assert fs.members == tuple(good)
        fs.close()
    finally:
        release.set()
        srv.shutdown()


def wait_serving(url: str, within: float = 30) -> None:
    """A receiver continued after a SIGSTOP: answering again, then its session ended (a
    /start_weight_update that reached it late opened one) and resumed (a push it failed left it
    paused): what a restart does for a real engine."""
    end = time.monotonic() + within
    while True:
        try:
            state(url)
            break
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)
    try:
        urllib.request.urlopen(urllib.request.Request(url + "/finish_weight_update", method="POST"),
                               timeout=10).read()
    except urllib.error.HTTPError:
        pass  # no session open
    urllib.request.urlopen(urllib.request.Request(url + "/resume", method="POST"), timeout=10).read()


def stop_and_go(pid: int, stop_s: float, go_s: float, halt: threading.Event) -> None:
    """A slow but alive receiver: stopped stop_s of every stop_s + go_s, until halted."""
    try:
        while not halt.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(pid, signal.SIGCONT)
            halt.wait(go_s)
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_receiver_stopped_mid_chain_costs_the_others_about_the_stall_window(stand_ins):
    """A chain of 8: the 4th receiver SIGSTOPped mid-push, the 6th slow but alive (stopped 0.3 s
    of every 0.5 s all along). The stopped one's progress reports stop, so it alone is judged
    stopped, about a window after the fault (not after the 30 s deadline), its call cut, and the
    7 others, the slow one and the ones starved behind the stopped one included, end verified at
    the version, within the announced bound: no healthy receiver condemned."""
    urls = [u for _, u in stand_ins]
    victim_proc, victim = stand_ins[3]
    slow_proc, slow = stand_ins[5]
    stall = 3.0
    fs = FleetSender(bucket_bytes=1 << 20, rendezvous_s=30, http_timeout=5, stall_s=stall)
    seen: dict[str, float] = {}
    victim_rank = 4  # the trainer is rank 0; one rank per stand-in

    def fault(step, info):
        seen.setdefault(step, time.monotonic())
        if step == "bucket_sent" and info["index"] == 2 and "fault" not in seen:
            # Stop it once it has reported (the trainer's send thread waits here: the others
            # keep reporting meanwhile, so the pause is no stall), so its reports are judged.
            end = time.monotonic() + 10
            while victim_rank not in fs.last_watch.seen and time.monotonic() < end:
                time.sleep(0.05)
            seen["reported"] = float(victim_rank in fs.last_watch.seen)
            seen["fault"] = time.monotonic()
            os.kill(victim_proc.pid, signal.SIGSTOP)
        if (step == "transfer_failed" and victim in info["stopped"]
                or step == "stopped" and info["receiver"] == victim):
            seen["judged_stopped"] = time.monotonic()

    halt = threading.Event()
    cycler = threading.Thread(target=stop_and_go, args=(slow_proc.pid, 0.3, 0.2, halt), daemon=True)
    try:
        assert all(r.ok for r in fs.push(urls, model(20), 20).values())  # the group, built
        cycler.start()
        t0 = time.monotonic()
        res = fs.push(urls, BIG, 21)
        healthy = time.monotonic() - t0
        # The slow one is not stalled: the healthy push never failed, nothing was redone.
        assert [u for u in urls if not res[u].ok or res[u].redone] == [], res
        longest = fs.last_watch.longest_wait_s()
        deadline, bound = res[urls[0]].deadline_s, res[urls[0]].bound_s
        fs.progress = fault
        t0 = time.monotonic()
        res = fs.push(urls, model(22, n=12, shape=(512, 1024)), 22)
        took = time.monotonic() - t0
    finally:
        halt.set()
        cycler.join(10)
        os.kill(victim_proc.pid, signal.SIGCONT)
        fs.close()
    assert "fault" in seen, "the fault never fired"
    assert seen["reported"] and seen.get("judged_stopped"), seen  # found by its reports
    assert res[victim].status == "unreachable" and not res[victim].ok, res[victim]
    # Every other one verified at the version: redone, or (before the stopped one in the chain)
    # loaded whole before the fault; every one behind it was starved, so redone.
    assert [u for u in urls if u != victim and not res[u].ok] == [], res
    assert all(res[u].redone for u in urls[4:]), res
    for u in urls:
        if u != victim:
            assert state(u)["version"] == "22"
    failed = seen["transfer_failed"] - seen["fault"]
    judged = seen["judged_stopped"] - seen["fault"]
    print(f"stall window {stall}s: the transfer failed {failed:.2f}s and the stopped one was judged "
          f"{judged:.2f}s after the fault, push {took:.2f}s (healthy {healthy:.2f}s, its longest hop "
          f"wait {longest:.2f}s; deadline {deadline:.1f}s, bound {bound:.1f}s)")
    # Within about the window: the transfer fails on a neighbour's hop window or on the
    # judgement; the judgement comes a window after its last report was seen, which was written
    # at most a report period (0.75 s) before the fault and read at most a period after.
    assert failed < stall + 1.5, failed
    assert judged < stall + 2 * 0.75 + 1, judged
    # The whole push: the window, the cut, and the redo over 7 (its rendezvous and a push: a
    # healthy push into 8 is its measure, with room for a busy host): far under the deadline.
    assert took < stall + 2.5 + 3 * healthy + 8 < deadline, (took, healthy)
    assert took < bound
    wait_serving(victim)
    assert state(victim)["version"] == "21"  # its staged receive failed: intact


PHASES = ["init_weight_transfer_engine", "pause", "start_weight_update", "bucket_sent",
          "finish_weight_update"]


@pytest.mark.parametrize("phase", PHASES)
def test_a_push_never_passes_its_announced_bound(stand_ins, phase):
    """The middle of 3 receivers SIGSTOPped as the push enters each phase: the whole push,
    redo included, ends within the bound it announced; the other two are verified at the
    version, the stopped one reported."""
    urls = [u for _, u in stand_ins[:3]]
    victim_proc, victim = stand_ins[1]
    announced: list[float] = []
    fs = FleetSender(bucket_bytes=1 << 20, rendezvous_s=30, http_timeout=2, stall_s=2,
                     announce=lambda receivers, nbytes, bound: announced.append(bound))
    version = 30 + PHASES.index(phase)
    seen: dict[str, float] = {}

    def fault(step, info):
        if step == phase and "fault" not in seen and (step != "bucket_sent" or info["index"] == 1):
            seen["fault"] = time.monotonic()
            os.kill(victim_proc.pid, signal.SIGSTOP)

    try:
        assert all(r.ok for r in fs.push(urls, model(version), f"{version}-warm").values())
        fs.rendezvous_s = 3  # a tight bound for the faulted push (the group is built)
        if phase == "init_weight_transfer_engine":
            fs.drop_group()
        fs.progress = fault
        t0 = time.monotonic()
        res = fs.push(urls, BIG, version)
        took = time.monotonic() - t0
    finally:
        os.kill(victim_proc.pid, signal.SIGCONT)
        fs.close()
    assert "fault" in seen, "the fault never fired"
    bound = announced[-1]
    assert res[victim].bound_s == bound
    print(f"{phase}: push {took:.2f}s, announced bound {bound:.2f}s")
    assert took <= bound, (took, bound)
    assert not res[victim].ok and res[victim].status in ("unreachable", "poisoned"), res[victim]
    for u in (urls[0], urls[2]):
        assert res[u].ok and state(u)["version"] == str(version), res[u]
    wait_serving(victim)
