"""The demo and the RL loop end honestly (issue 12, item 4): engines that cannot start, lost
rounds, SIGINT and SIGTERM end the run with a summary of what went wrong, a non-zero exit status,
and no process left behind.

Cheap on purpose: no vLLM engine boots here. The daemon is the real one (`python -m vime.supervisor`)
and the demo and the loop run as their own processes (`python -m vime.harness.demo`,
`python -m vime.trainer.rl_loop`, and `python -m vime.harness.chaos` where a fault makes it wait for
a whole fleet); the engines' interpreter (`supervisor.python` in the config, the
demo's --python) is a shell script that stands in for vLLM: one that fails at once the way a
broken install does, or one that starts a child and never answers (an engine still booting,
in its own process group like a real one, with a member besides its leader). Which processes
must be gone afterwards is read from what the run recorded: the daemon's `engine.spawned`
events (each engine leads its own process group) and the demo's demo.json.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vime.supervisor.client import SupervisorClient
from vime.harness.demo import demo_config
from vime.harness.local_daemon import Daemon, live_pids_in_groups
from vime.harness.timeline import png_size

from support.polling import wait_until as until

BROKEN = """#!/bin/sh
echo "Traceback (most recent call last):" >&2
echo "ModuleNotFoundError: No module named 'vllm' (stand-in for a broken engine install)" >&2
exit 1
"""

BOOTING = """#!/bin/sh
echo "stand-in engine $$: loading the model (it never answers)"
sleep 600 &
sleep 600
"""


def script(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    p.chmod(0o755)
    return str(p)


def fake_model(tmp_path: Path) -> Path:
    """Enough of a model directory for the daemon's config check (the stand-ins never read it)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def spawned(out: Path) -> list[int]:
    """Engine pids (= process groups) from the daemon's own log of the run."""
    pids = []
    for line in (out / "daemon.log").read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and ev.get("event") == "engine.spawned":
            pids.append(ev["pid"])
    return pids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def demo(tmp_path: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vime.harness.demo", "--out", str(tmp_path / "run"), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=Path(__file__).resolve().parents[2])


def _last_resort(out: Path) -> None:
    """A test that failed with the demo still running: stop what it started (by recorded pids)."""
    try:
        daemon_pid = json.loads((out / "demo.json").read_text())["daemon_pid"]
        if daemon_pid and alive(daemon_pid):
            os.kill(daemon_pid, signal.SIGKILL)
    except (OSError, ValueError, KeyError):
        pass
    if (out / "daemon.log").exists():
        for _, pgid, _ in live_pids_in_groups(set(spawned(out))):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass


def assert_nothing_left(out: Path) -> None:
    record = json.loads((out / "demo.json").read_text())
    groups = set(spawned(out)) | set(record["engine_pids"])
    assert live_pids_in_groups(groups) == []
    assert not alive(record["daemon_pid"])


# -- engines that cannot start ---------------------------------------------------------------


def test_demo_whose_engines_cannot_start_exits_nonzero_quickly_with_a_summary(tmp_path):
    t0 = time.monotonic()
    proc = demo(tmp_path, "--model", str(fake_model(tmp_path)), "--python", script(tmp_path, "broken.sh", BROKEN))
    out, _ = proc.communicate(timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 1, out
    assert took < 60, f"{took:.0f}s: it waited for engines that could not come up"
    assert "WHAT WENT WRONG" in out
    # It stops at the first FATAL engine (the other may still be in BACKOFF).
    assert "went FATAL while booting: start retries exhausted (3)" in out, out
    assert "No module named 'vllm'" in out  # the engine's own error, from its log, in the reason
    run = tmp_path / "run"
    record = json.loads((run / "demo.json").read_text())
    assert record["ok"] is False and record["exit_status"] == 1 and record["daemon_exit"] == 0
    assert len(spawned(run)) >= 3  # the FATAL one tried its 3 starts
    assert_nothing_left(run)
    # The picture of the failed run (harness/timeline.py): its starts, backoffs and the FATAL one.
    assert f"timeline.png (the picture of the run): {run / 'timeline.png'}" in out
    w, h = png_size(run / "timeline.png")
    assert w >= 600 and h >= 150 and (run / "timeline.png").stat().st_size > 10_000


def test_demo_with_a_model_that_does_not_exist_exits_nonzero_with_the_daemons_error(tmp_path):
    proc = demo(tmp_path, "--model", str(tmp_path / "no-such-model"))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert "WHAT WENT WRONG" in out and "the daemon exited with status 2 before the engines were up" in out
    assert "no-such-model" in out and "nothing was started" in out


# -- signals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_the_demo_while_engines_boot_leaves_no_process(tmp_path, sig):
    proc = demo(tmp_path, "--model", str(fake_model(tmp_path)), "--python", script(tmp_path, "boot.sh", BOOTING))
    run = tmp_path / "run"
    try:
        # The three engines (two to serve, the spare) spawned, each a group of three processes
        # (the script and two sleeps).
        until(lambda: (run / "daemon.log").exists() and len(spawned(run)) == 3
              and len(live_pids_in_groups(set(spawned(run)))) == 9, 30, "the three stand-in engines up")
        groups = set(spawned(run))
        daemon_pid = json.loads((run / "demo.json").read_text())["daemon_pid"]
        assert alive(daemon_pid)
        time.sleep(6)  # past the first progress report
        t0 = time.monotonic()
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            _last_resort(run)
    assert proc.returncode == 128 + sig, out
    assert took < 20, f"{took:.0f}s from the signal to the exit"
    assert f"interrupted by {sig.name}" in out and "WHAT WENT WRONG" in out
    # While they booted, the demo said what they were doing: state, reason, last log line.
    assert "waiting for the engines to boot" in out and "STARTING" in out
    assert "log: stand-in engine" in out
    assert live_pids_in_groups(groups) == [] and not alive(daemon_pid)
    assert_nothing_left(run)
    # The daemon stopped its engines itself (SIGTERM), no last-resort kill was needed.
    assert "daemon exit status 0; engine processes left 0" in out


@pytest.fixture
def booting_daemon(tiny_model, tmp_path):
    """A real daemon whose two engines boot for ever (stand-ins); the loop never gets one."""
    cfg = demo_config(tmp_path, tiny_model, python=script(tmp_path, "boot.sh", BOOTING))
    daemon = Daemon(cfg, own_group=True)
    try:
        for name in ("engine-0", "engine-1"):
            daemon.transition(name, "STARTING", 30)
        yield daemon, str(tmp_path / "run" / "supervisor.sock")
    finally:
        groups = set(daemon.spawned_pids())
        rc, left = daemon.stop_all(30)
        assert rc == 0 and left == [] and live_pids_in_groups(groups) == []


def rl_loop(tiny_model, sock: str, out: Path, *flags: str, module: str = "vime.trainer.rl_loop") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, "--model", str(tiny_model), "--socket", sock,
                             "--out", str(out), "--num-rollout", "3", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def chaos_loop(tiny_model, sock: str, out: Path, *flags: str) -> subprocess.Popen:
    """The example loop with a fault due (harness/chaos.py): it waits for a whole fleet first."""
    return rl_loop(tiny_model, sock, out, *flags, module="vime.harness.chaos")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_the_loop_in_a_long_wait(booting_daemon, tiny_model, tmp_path, sig):
    """The chaos loop waits (up to --fault-wait 300 s) for a whole fleet before its fault: a signal
    ends that wait at once, and the loop exits with the summary, having left no round open."""
    daemon, sock = booting_daemon
    proc = chaos_loop(tiny_model, sock, tmp_path / "out", "--kill-at", "1", "--fault-wait", "300")
    try:
        until(lambda: (tmp_path / "out").exists(), 60, "the loop started")
        until(lambda: SupervisorClient(sock).status()["engines"] and _waiting(proc), 90, "the loop waiting")
        t0 = time.monotonic()
        proc.send_signal(sig)
        out = _all_output(proc, 60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, out
    assert took < 15, f"{took:.0f}s from the signal to the exit"
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["stopped"] == f"interrupted by {sig.name}" and summary["signal"] == sig
    assert f"STOPPED EARLY: interrupted by {sig.name}" in out
    assert SupervisorClient(sock).status()["round_open"] is False


_READERS: dict[int, tuple[list[str], threading.Thread]] = {}


def _lines(proc: subprocess.Popen) -> list[str]:
    """The output so far, read by a thread of its own: select() on the pipe cannot see lines
    already taken into the reader's buffer."""
    if proc.pid not in _READERS:
        buf: list[str] = []
        reader = threading.Thread(target=lambda: buf.extend(proc.stdout), daemon=True)
        reader.start()
        _READERS[proc.pid] = (buf, reader)
    return _READERS[proc.pid][0]


def _waiting(proc: subprocess.Popen) -> bool:
    """True once the loop printed that it waits for a whole fleet."""
    return any("waiting (gap) for every engine" in ln for ln in list(_lines(proc)))


def _all_output(proc: subprocess.Popen, timeout: float) -> str:
    """Everything it printed, once it has exited (within `timeout`)."""
    proc.wait(timeout)
    buf, reader = _READERS[proc.pid]
    reader.join(10)
    return "".join(buf)


def test_loop_stops_at_the_first_lost_round(booting_daemon, tiny_model, tmp_path):
    """No engine ever routable: the first round is lost (NoEngineAvailable) and the loop stops
    there, exit 1, instead of losing every round after it."""
    daemon, sock = booting_daemon
    proc = rl_loop(tiny_model, sock, tmp_path / "out")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [s["lost"] for s in summary["steps"]] == [True]
    assert summary["stopped"].startswith("stopped after step 1: 1 round(s) lost") and "NoEngineAvailable" in out
    assert SupervisorClient(sock).status()["round_open"] is False


def test_loop_stops_when_an_engine_goes_fatal(tiny_model, tmp_path):
    """With --stop-on-fatal (the demo's), a wait for a whole fleet ends as soon as an engine is
    FATAL, with its reason, instead of lasting its bound (--fault-wait 300 s)."""
    cfg = demo_config(tmp_path, tiny_model, python=script(tmp_path, "broken.sh", BROKEN))
    daemon = Daemon(cfg, own_group=True)
    sock = str(tmp_path / "run" / "supervisor.sock")
    try:
        daemon.transition("engine-0", "STARTING", 30)
        t0 = time.monotonic()
        proc = chaos_loop(tiny_model, sock, tmp_path / "out", "--kill-at", "1", "--fault-wait", "300", "--stop-on-fatal")
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        groups = set(daemon.spawned_pids())
        rc, left = daemon.stop_all(30)
    assert proc.returncode == 1, out
    assert took < 60, f"{took:.0f}s"
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert "FATAL: start retries exhausted" in summary["stopped"] and "No module named 'vllm'" in summary["stopped"]
    assert rc == 0 and left == [] and live_pids_in_groups(groups) == []
