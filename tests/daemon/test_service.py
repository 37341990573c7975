"""Running as a service: sd_notify on a real datagram socket, the journal, metrics (the unit
file: test_systemd_unit.py).

The daemon here supervises an engine stand-in (harness/standin_engine.py: it speaks vLLM's
health/completion protocol; no vLLM behaviour is tested here, the real-engine tests cover it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vime.supervisor import journal
from vime.supervisor.sdnotify import Notifier
from vime.supervisor.client import SupervisorClient
from vime.harness.local_daemon import Daemon, free_port, write_config

from support.standins import standin_server

ROOT = Path(__file__).resolve().parents[2]


def dgram(path_or_abstract: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + path_or_abstract[1:] if path_or_abstract.startswith("@") else path_or_abstract)
    s.settimeout(0.5)
    return s


def drain(sock: socket.socket, until: str, timeout: float) -> list[str]:
    """Messages received until one contains `until` (each message may hold several lines)."""
    got, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = sock.recv(4096).decode()
        except socket.timeout:
            continue
        got.append(msg)
        if until in msg:
            return got
    raise AssertionError(f"no {until!r} within {timeout}s; got {got}")


# -- sd_notify ------------------------------------------------------------------------------

def test_notifier_is_silent_without_notify_socket():
    n = Notifier(env={})
    assert not n.enabled and n.watchdog_interval is None
    assert n.notify("READY=1") is False


@pytest.mark.parametrize("abstract", [False, True])
def test_notifier_writes_to_a_real_datagram_socket(tmp_path, abstract):
    addr = f"@vime-test-{os.getpid()}-{time.monotonic_ns()}" if abstract else str(tmp_path / "notify.sock")
    with dgram(addr) as sock:
        n = Notifier(env={"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "4000000"})
        assert n.watchdog_interval == 2.0
        n.ready("1/1 engines RUNNING, no round yet, weights base")
        n.status("1/1 engines RUNNING, no round yet, weights base")  # unchanged: not re-sent
        n.status("0/1 engines RUNNING, round 3, weights v2")
        n.watchdog()
        n.stopping()
        msgs = [sock.recv(4096).decode() for _ in range(4)]
    assert msgs == ["READY=1\nSTATUS=1/1 engines RUNNING, no round yet, weights base",
                    "STATUS=0/1 engines RUNNING, round 3, weights v2", "WATCHDOG=1",
                    "STOPPING=1\nSTATUS=stopping engines"]


def test_a_notify_socket_nobody_drains_drops_messages_and_never_blocks(tmp_path):
    """A full queue (systemd slow, or a test's socket nobody reads) must not block the daemon's
    event loop: the send fails at once and the message is dropped."""
    addr = str(tmp_path / "notify.sock")
    with dgram(addr):  # bound, never read
        n = Notifier(env={"NOTIFY_SOCKET": addr})
        done = threading.Event()
        sent: list[bool] = []

        def flood() -> None:
            sent.extend(n.notify(f"STATUS=message {i}") for i in range(5000))
            done.set()

        threading.Thread(target=flood, daemon=True).start()
        assert done.wait(10), "a send blocked on the full queue"
        n.close()
    assert sent[0] is True and sent[-1] is False  # accepted until the queue was full, then dropped


def test_watchdog_belongs_to_the_pid_it_names():
    assert Notifier(env={"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}).watchdog_interval is None


@pytest.fixture
def standin():
    with standin_server(free_port()) as url:
        yield url


def service_config(tmp_path: Path, url: str) -> Path:
    return write_config(
        tmp_path / "sup.toml",
        supervisor={"runtime_dir": str(tmp_path / "run"), "log_dir": str(tmp_path / "logs")},
        health_check={"first_wait": 10.0, "interval": 0.5, "timeout": 0.4, "failure_threshold": 2},
        engines=[{"name": "standin-0", "url": url, "served_model_name": "tiny"}],
    )


def test_daemon_notifies_systemd_in_order(tmp_path, standin):
    addr = str(tmp_path / "notify.sock")
    with dgram(addr) as sock:
        d = Daemon(service_config(tmp_path, standin), env={"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "600000"})
        try:
            before_ready = drain(sock, "READY=1", 20)
            assert "READY=1\nSTATUS=1/1 engines RUNNING, no round yet, weights base" in before_ready
            # READY comes only after the socket listens and the engine's first start concluded.
            assert (tmp_path / "run" / "supervisor.sock").exists()
            client = SupervisorClient(str(tmp_path / "run" / "supervisor.sock"))
            client.start_round(412)
            assert "STATUS=1/1 engines RUNNING, round 412, weights base" in drain(sock, "round 412", 5)
            assert "WATCHDOG=1" in drain(sock, "WATCHDOG=1", 2)  # every WATCHDOG_USEC/2 = 0.3 s
            d.proc.send_signal(signal.SIGTERM)
            assert drain(sock, "STOPPING=1", 10)[-1].startswith("STOPPING=1")
            assert d.proc.wait(20) == 0
        finally:
            d.kill()


# -- the journal ----------------------------------------------------------------------------

def test_journal_round_trip_and_corruption(tmp_path):
    path = tmp_path / "journal.json"
    assert journal.load(path) is None
    data = {"format": journal.FORMAT, "round": 4, "round_open": True, "weight_version": 9,
            "checkpoint": None, "engines": {"e": {"pid": 1, "start_time": 5}}}
    journal.write_atomic(path, data)
    assert journal.load(path) == data
    assert not (tmp_path / "journal.json.tmp").exists()
    path.write_text('{"format": 1, "engines": {')
    with pytest.raises(journal.JournalError, match="not valid JSON"):
        journal.load(path)
    path.write_text(json.dumps({"format": 99, "engines": {}}))
    with pytest.raises(journal.JournalError, match="not a format-1 journal"):
        journal.load(path)


def test_daemon_restores_round_and_version_and_survives_a_corrupt_journal(tmp_path, standin):
    cfg = service_config(tmp_path, standin)
    sock = str(tmp_path / "run" / "supervisor.sock")
    d = Daemon(cfg)
    try:
        d.wait_for(lambda e: e.get("event") == "supervisor.ready", 20)
        client = SupervisorClient(sock)
        client.start_round(3)
        client.end_round(3)
        client.start_round(4)
        client.publish_weights(0)  # the stand-in reports the base weights: published as v0 it goes STALE
        time.sleep(0.5)  # the journal is written within 0.1 s of a change
    finally:
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
    state = json.loads((tmp_path / "state" / "journal.json").read_text())
    assert (state["round"], state["round_open"], state["weight_version"]) == (4, True, 0)

    d = Daemon(cfg)  # as systemd would, after kill -9
    try:
        restored = d.wait_for(lambda e: e.get("event") == "journal.restored", 20)
        assert (restored["round"], restored["round_open"], restored["weight_version"]) == (4, True, 0)
        status = SupervisorClient(sock).status()
        assert (status["round"], status["round_open"], status["weight_version"]) == (4, True, 0)
        with pytest.raises(Exception, match="round 4 is still open"):
            SupervisorClient(sock).start_round(5)  # nothing lost: the trainer must end round 4
    finally:
        d.kill()

    (tmp_path / "state" / "journal.json").write_text("{ not json")
    d = Daemon(cfg)
    try:
        bad = d.wait_for(lambda e: e.get("event") == "journal.unusable", 20)
        assert "not valid JSON" in bad["error"] and bad["action"] == "clean start"
        assert Path(bad["moved_to"]).exists()  # kept for a post-mortem, not deleted
        d.wait_for(lambda e: e.get("event") == "supervisor.ready", 20)
        assert SupervisorClient(sock).status()["round"] is None
    finally:
        d.kill()


# -- metrics --------------------------------------------------------------------------------

def test_metrics_parse_with_prometheus_client(tmp_path, standin):
    d = Daemon(service_config(tmp_path, standin))
    try:
        d.wait_for(lambda e: e.get("event") == "supervisor.ready", 20)
        client = SupervisorClient(str(tmp_path / "run" / "supervisor.sock"))
        client.start_round(1)
        families = {f.name: f for f in text_string_to_metric_families(client.metrics())}
    finally:
        d.kill()
    states = {s.labels["state"]: s.value for s in families["vime_engine_state"].samples}
    assert states["RUNNING"] == 1.0 and sum(states.values()) == 1.0
    assert families["vime_round"].samples[0].value == 1.0
    assert families["vime_routable_engines"].samples[0].value == 1.0
    assert families["vime_engine_restarts"].type == "counter"
    assert families["vime_engine_probe_latency_seconds"].samples[0].value > 0
    hist = {s.name: s for s in families["vime_probe_latency_seconds"].samples if not s.labels.get("le")}
    assert families["vime_probe_latency_seconds"].type == "histogram"
    assert hist["vime_probe_latency_seconds_count"].value >= 1 and hist["vime_probe_latency_seconds_sum"].value > 0
    assert {"vime_detection_to_routable_seconds", "vime_sync_duration_seconds", "vime_syncs"} <= set(families)


@pytest.mark.skipif(shutil.which("hadolint") is None and not Path(sys.executable).with_name("hadolint").exists(),
                    reason="hadolint not installed")
def test_dockerfile_lints():
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    r = subprocess.run([exe, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr

