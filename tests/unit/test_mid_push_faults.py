"""The faults during the step's broadcast (harness/faults.py MID_PUSH): their place in the
catalogue and the soak's schedule, the hook that fires them after bucket k, and the child
process a "trainer that dies mid-push" pushes from (real processes; no engine: the push into
real engines is the long soak's)."""

from __future__ import annotations

import argparse
import sys
import time

import pytest
import torch

from vime.harness import chaos, faults, soak
from vime.supervisor.protocol import Cause


def test_each_mid_push_kind_is_in_the_catalogue_with_its_detection():
    assert faults.MID_PUSH == ("kill-mid-push", "stop-mid-push", "trainer-dies-mid-push")
    for kind in faults.MID_PUSH:
        assert kind in faults.KINDS and kind in faults.MUST_CONFIRM
        assert len(faults.WHAT[kind]) < 30  # the faults table's column
        assert kind not in faults.IN_ROUND and kind not in faults.NO_ENGINE  # pushes run in the gap
    # A kill is an exit, a stopped process answers no probe, the receivers of a dead trainer
    # stay paused past the announced push's deadline.
    assert faults.DETECTED_AS["kill-mid-push"] is Cause.EXIT
    assert faults.DETECTED_AS["stop-mid-push"] is Cause.HANG
    assert faults.DETECTED_AS["trainer-dies-mid-push"] is Cause.PAUSED


def test_a_mid_push_fault_seen_with_another_cause_is_wrong():
    f = faults.Fault("stop-mid-push", 4, engine="engine-1", injected_at=10.0, detected_at=12.0,
                     detected_cause=Cause.EXIT.value)
    assert f.wrong_cause() == "stop-mid-push detected as 'exit', not 'hang'"
    f.detected_cause = Cause.HANG.value
    assert f.wrong_cause() is None


def test_the_long_form_schedules_them_the_ci_short_form_does_not():
    for kind in faults.MID_PUSH:
        assert kind in soak.LONG and kind not in soak.SHORT
    plan = soak.schedule(soak.LONG * 2, seed=7)
    kinds = [f.kind for f in plan]
    assert all(kinds.count(k) == 2 for k in faults.MID_PUSH)
    assert [f.step for f in plan] == sorted(f.step for f in plan) and len({f.step for f in plan}) == len(plan)
    assert not {f.kind for f in soak.schedule(soak.SHORT, seed=7)} & set(faults.MID_PUSH)


def test_after_bucket_fires_once_at_half_and_lets_the_push_go_on():
    fired: list[tuple[int, int]] = []
    hook = faults.AfterBucket(lambda sent, of: fired.append((sent, of)))
    hook("redo", {"receivers": []})
    for i in range(6):
        assert hook("bucket_sent", {"index": i, "of": 6}) is None
    assert fired == [(3, 6)] and hook.fired
    one: list[tuple[int, int]] = []
    early = faults.AfterBucket(lambda sent, of: one.append((sent, of)), after=1)
    early("bucket_sent", {"index": 0, "of": 1})
    assert one == [(1, 1)]


def test_the_child_push_builds_from_a_tensors_file(tmp_path):
    named = [("layer.weight", torch.randn(4, 3)), ("layer.bias", torch.arange(3, dtype=torch.float16))]
    path = faults.save_tensors(named, tmp_path / "push" / "v5.pt")
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    cmd = faults.child_push_command(path, urls, 5, 31.5)
    assert cmd[:4] == [sys.executable, "-m", "vime.harness.faults", "push"]
    sender, got_urls, tensors, version = faults.build_child_push(cmd[4:])
    try:
        assert got_urls == urls and version == 5
        assert list(tensors) == ["layer.weight", "layer.bias"]
        for name, t in named:
            assert torch.equal(tensors[name], t) and tensors[name].dtype == t.dtype
        # Small buckets (so "after bucket k" is inside the transfer); the parent's deadline;
        # no announcement of its own (the parent announced it).
        assert sender.bucket_bytes == faults.CHILD_BUCKET_BYTES and sender.solo_bytes is None
        assert sender.deadline_for(10**9) == pytest.approx(31.5)
        assert sender.announce is None and not sender.reuse_group
    finally:
        sender.close()


def _fake_child(body: str) -> list[str]:
    return [sys.executable, "-c", "import json, sys, time\n" + body]


def test_kill_child_after_kills_the_push_once_half_its_buckets_are_sent(tmp_path):
    marker = tmp_path / "went-on"
    cmd = _fake_child(
        "for i in range(4):\n"
        "    print(json.dumps({'step': 'bucket_sent', 'index': i, 'of': 4}), flush=True)\n"
        "    time.sleep(0.3)\n"
        f"open({str(marker)!r}, 'w').close()\n")
    killed, what = faults.kill_child_after(cmd, timeout=30)
    assert killed and what == "killed -9 after 2 of 4 buckets"
    time.sleep(1.0)
    assert not marker.exists()  # it never reached the end


def test_kill_child_after_says_so_when_the_push_ends_first_or_prints_nothing():
    killed, what = faults.kill_child_after(_fake_child("print('not json')\n"), timeout=30)
    assert not killed and what == "the child push ended before the fault"
    t0 = time.monotonic()
    killed, what = faults.kill_child_after(_fake_child("time.sleep(60)\n"), timeout=1.0)
    assert not killed and "within 1s" in what and time.monotonic() - t0 < 15


def test_the_chaos_loop_takes_any_kind_it_injects_alone_by_name():
    args = chaos.build_parser().parse_args(["--model", "m", "--socket", "s", "--kill-at", "3",
                                            "--fault", "kill-mid-push@5", "--fault", "trainer-dies-mid-push@9"])
    assert args.fault == [("kill-mid-push", 5), ("trainer-dies-mid-push", 9)]
    for kind in faults.MID_PUSH:
        assert chaos.parse_fault(f"{kind}@2") == (kind, 2)
    for bad in ("kill-mid-push", "nope@3", "kill-mid-push@0", "kill-mid-push@x", "daemon@4", "crash-start@2"):
        with pytest.raises(argparse.ArgumentTypeError):
            chaos.parse_fault(bad)


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="the stand-ins need vLLM")
def test_a_trainer_killed_mid_push_leaves_every_receiver_paused_on_its_old_weights(tmp_path):
    """The child push into two stand-in receivers (harness/loopback.py: the real gloo receive
    path behind vLLM's routes), killed -9 after half its buckets: each receiver is left paused
    (nobody resumes it: the daemon's push deadline must condemn it), on its old version, its
    model untouched (staged receive), and still answering."""
    import json
    import os
    import signal
    import subprocess
    import urllib.request
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    procs = [subprocess.Popen([sys.executable, "-m", "vime.harness.loopback", "--keep"], cwd=root, env=env,
                              stdout=subprocess.PIPE, text=True, start_new_session=True) for _ in range(2)]

    def state(url: str) -> dict:
        with urllib.request.urlopen(url + "/stand_in", timeout=10) as r:
            return json.loads(r.read())

    try:
        urls = []
        for p in procs:
            line = p.stdout.readline() if p.stdout else ""
            assert line.startswith("READY"), line
            urls.append(f"http://127.0.0.1:{int(line.split()[1])}")
        before = {u: state(u) for u in urls}
        g = torch.Generator().manual_seed(3)
        named = [(f"layers.{i}.w", torch.randn(256, 256, generator=g)) for i in range(12)]  # 12 buckets
        path = faults.save_tensors(named, tmp_path / "v7.pt")
        cmd = faults.child_push_command(path, urls, 7, 30.0)
        killed, what = faults.kill_child_after(cmd, timeout=120)
        assert killed and what.startswith("killed -9 after 6 of "), what
        time.sleep(2.0)  # the receivers' collective fails on the dead peer's closed sockets
        for u in urls:
            st = state(u)
            assert st["paused"] and st["version"] == before[u]["version"], st
            assert st["reloads_begun"] == before[u]["reloads_begun"], st  # the model never touched
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
