"""Start failures through the real daemon: a permanent one (an argument vLLM refuses, a model
it cannot load) is FATAL at once; a transient one (the port still in use) backs off and is
retried within the start budget, as before.

The daemon spawns its engines as always; `python` points at a script that fails the way
vLLM's API server does at start-up (its last log lines are what process.classify_failure
reads). Each transition on the log carries its cause beside the reason.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from vime.harness.local_daemon import Daemon, free_port, write_config

FAILING_PYTHON = f"""#!{sys.executable}
# Fails as vLLM's API server does at start-up (tests only): prints LINES, exits with STATUS.
import sys, time
time.sleep(0.2)
sys.stderr.write({{lines!r}})
sys.exit({{status}})
"""

PERMANENT = [
    ("api_server.py: error: unrecognized arguments: --no-such-flag\n", 2),
    ("Traceback (most recent call last):\n"
     "OSError: /models/tiny does not appear to have a file named config.json\n", 1),
]
TRANSIENT = ("Traceback (most recent call last):\nOSError: [Errno 98] Address already in use\n", 1)


def failing_python(tmp_path: Path, lines: str, status: int) -> Path:
    p = tmp_path / "failing-python"
    p.write_text(FAILING_PYTHON.format(lines=lines, status=status))
    p.chmod(0o755)
    return p


def start(tmp_path: Path, python: Path, start_retries: int, port: int | None = None) -> Daemon:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "standin"}')
    cfg = write_config(
        tmp_path / "sup.toml",
        supervisor={"runtime_dir": str(tmp_path / "run"), "log_dir": str(tmp_path / "logs"),
                    "python": str(python), "stop_timeout": 2.0},
        health_check={"first_wait": 20.0, "interval": 0.5, "timeout": 0.4, "failure_threshold": 2},
        restart={"start_retries": start_retries, "backoff_initial": 0.2, "backoff_max": 0.5},
        engines=[{"name": "e0", "model": str(model), "served_model_name": "tiny", "port": port or free_port()}],
    )
    return Daemon(cfg)


@pytest.fixture
def daemons():
    started: list[Daemon] = []
    yield started
    for d in started:
        for pgid in d.spawned_pids():
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
        d.kill()


def transitions(d: Daemon, engine: str) -> list[dict]:
    return [e for e in d.events if e.get("event") == "engine.transition" and e.get("engine") == engine]


@pytest.mark.parametrize("lines, status", PERMANENT, ids=["bad-argument", "bad-model"])
def test_a_permanent_start_failure_is_fatal_at_once(tmp_path, daemons, lines, status):
    d = start(tmp_path, failing_python(tmp_path, lines, status), start_retries=5)
    daemons.append(d)
    fatal = d.transition("e0", "FATAL", 30)
    assert fatal["from_state"] == "STARTING"
    assert fatal["cause"] == "start_failed"
    assert "not retried (permanent)" in fatal["reason"]
    assert f"exit status {status} while starting" in fatal["reason"]
    # One start, no BACKOFF, no retry: the budget of 5 was not spent on a config error.
    assert [t["to_state"] for t in transitions(d, "e0")] == ["STARTING", "FATAL"]
    assert d.terminate(30) == 0


def test_a_transient_start_failure_backs_off_until_the_budget_is_spent(tmp_path, daemons):
    d = start(tmp_path, failing_python(tmp_path, *TRANSIENT), start_retries=3)
    daemons.append(d)
    fatal = d.transition("e0", "FATAL", 60)
    assert fatal["cause"] == "start_failed"
    assert fatal["reason"].startswith("start retries exhausted (3); last error: exit status 1 while starting: "
                                      "port still in use")
    seen = [(t["to_state"], t["cause"]) for t in transitions(d, "e0")]
    assert seen == [("STARTING", "start"), ("BACKOFF", "start_failed"), ("STARTING", "retry"),
                    ("BACKOFF", "start_failed"), ("STARTING", "retry"), ("FATAL", "start_failed")]
    assert d.terminate(30) == 0


def test_a_shutdown_while_an_engine_waits_for_its_port_ends_it_stopped(tmp_path, daemons):
    """SIGTERM while the engine's start waits for its port (held here by another socket): no
    process of it exists yet, and the shutdown ends it STOPPED, not left STARTING."""
    import socket
    import time

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        d = start(tmp_path, failing_python(tmp_path, *TRANSIENT), start_retries=1, port=port)
        daemons.append(d)
        d.transition("e0", "STARTING", 30)
        time.sleep(0.5)  # inside the port wait (stop_timeout + 5 s: 7 s)
        assert d.terminate(30) == 0
        last = transitions(d, "e0")[-1]
        assert (last["to_state"], last["cause"]) == ("STOPPED", "shutdown"), last
        assert last["reason"] == "supervisor shut down before its process started"
        assert d.spawned_pids() == []
    finally:
        holder.close()
