"""Logs as journald reads them: under systemd (JOURNAL_STREAM names stderr's dev:inode) each
JSON line starts with its sd-daemon priority, `<3>` for a FATAL engine, `<4>` for a
detection, `<6>` for routine; the lines carry pid, round and how a process ended; each
control-socket action leaves one audit line with the caller's uid and pid. Without
JOURNAL_STREAM, or with one naming another stream, lines are plain JSON.

The bytes are checked where journald would read them: the daemon's stderr, a file here, whose
dev:inode the test gives as JOURNAL_STREAM (systemd gives its socket's). Engines are protocol
stand-ins (tests/support/standin_group.py); one fails at start as vLLM does for a bad argument.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from vime.harness.local_daemon import free_port, write_config
from vime.supervisor.client import SupervisorClient

from support.standins import STANDIN_GROUP as STANDIN

from test_client_ctl import wait_state

LINE = re.compile(r"<([0-7])>(\{.*\})")


def journal_stream(path: Path) -> str:
    st = os.stat(path)
    return f"{st.st_dev}:{st.st_ino}"


def read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def parsed(path: Path) -> list[tuple[int, dict]]:
    """(priority, event) of every line; each line must carry a priority."""
    out = []
    for line in read_lines(path):
        m = LINE.fullmatch(line)
        assert m, f"a line without a priority prefix: {line!r}"
        out.append((int(m.group(1)), json.loads(m.group(2))))
    return out


def wait_line(path: Path, pred, timeout: float = 30) -> tuple[int, dict]:
    deadline = time.monotonic() + timeout
    while True:
        for prio, ev in parsed(path):
            if pred(ev):
                return prio, ev
        assert time.monotonic() < deadline, "no such line; log tail:\n" + "\n".join(read_lines(path)[-20:])
        time.sleep(0.1)


def transition(engine: str, to: str):
    return lambda e: e.get("event") == "engine.transition" and e.get("engine") == engine and e.get("to_state") == to


@pytest.fixture(scope="module")
def journald(tmp_path_factory):
    """One daemon under a stand-in journal: engine `doomed` fails its start for good (FATAL),
    `good` is killed with SIGKILL through the control socket inside round 1 (a detection)."""
    root = tmp_path_factory.mktemp("journald")
    # The engines' interpreter: vLLM's argument error for `doomed` (a permanent start failure),
    # the stand-in server for the others.
    python = root / "standin-python"
    python.write_text(f"""#!/bin/sh
if [ "$(cat "$STANDIN_MODE_FILE")" = fail ]; then
    echo "api_server.py: error: unrecognized arguments: --no-such-flag" >&2
    exit 2
fi
exec "{sys.executable}" "{STANDIN}" "$@"
""")
    python.chmod(0o755)
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    modes = {"good": "ok", "doomed": "fail"}
    for name, mode in modes.items():
        (root / f"mode-{name}").write_text(mode)
    cfg = write_config(
        root / "supervisor.toml",
        supervisor={"runtime_dir": str(root / "run"), "log_dir": str(root / "logs"), "stop_timeout": 2.0,
                    "python": str(python)},
        health_check={"first_wait": 15.0, "interval": 0.5, "timeout": 0.4, "failure_threshold": 2},
        warmup={"requests": 0},
        engines=[{"name": n, "model": str(model), "port": free_port(),
                  "env": {"STANDIN_MODE_FILE": str(root / f"mode-{n}")}} for n in modes],
    )
    err = root / "daemon.err"
    with open(err, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "vime.supervisor", "--config", str(cfg)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=f,
                                env={**os.environ, "JOURNAL_STREAM": journal_stream(err)})
    try:
        wait_line(err, lambda e: e.get("event") == "control.listening")
        client = SupervisorClient(str(root / "run" / "supervisor.sock"))
        wait_line(err, transition("doomed", "FATAL"))
        pid = wait_state(client, "good", {"RUNNING"}, timeout=30)["pid"]
        client.start_round(1)
        client.signal("good", "KILL")
        wait_line(err, transition("good", "EXITED"))
        with pytest.raises(Exception, match="no engine named 'nope'"):
            client.stop("nope")  # refused: audited too
        client.end_round(1)  # the dead engine restarts in the gap
        wait_line(err, lambda e: transition("good", "RUNNING")(e) and e.get("incarnation") == 2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        yield SimpleNamespace(lines=parsed(err), pid=pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def only(lines: list[tuple[int, dict]], pred) -> tuple[int, dict]:
    found = [(p, e) for p, e in lines if pred(e)]
    assert len(found) == 1, found
    return found[0]


def test_priorities_follow_what_needs_an_operator(journald):
    prio, fatal = only(journald.lines, transition("doomed", "FATAL"))
    assert (prio, fatal["level"]) == (3, "error")
    prio, detection = only(journald.lines, lambda e: transition("good", "EXITED")(e) and e["from_state"] == "RUNNING")
    assert (prio, detection["level"]) == (4, "warning")
    # Falling below min_healthy inside a round: the round is in danger.
    prio, floor = only(journald.lines, lambda e: e.get("event") == "fleet.below_min_healthy" and e.get("round") == 1)
    assert (prio, floor["level"]) == (3, "error")
    prio, started = only(journald.lines, lambda e: e.get("event") == "supervisor.started")
    assert (prio, started["level"]) == (6, "info")
    # Each line's prefix is its level's priority, whatever logged it.
    levels = {"debug": 7, "info": 6, "warning": 4, "error": 3}
    assert all(p == levels[e["level"]] for p, e in journald.lines)


def test_lines_carry_pid_round_and_how_the_process_ended(journald):
    _, fatal = only(journald.lines, transition("doomed", "FATAL"))
    assert fatal["exit_code"] == 2 and isinstance(fatal["pid"], int) and "round" not in fatal
    _, detection = only(journald.lines, lambda e: transition("good", "EXITED")(e) and e["from_state"] == "RUNNING")
    assert (detection["pid"], detection["signal"], detection["round"]) == (journald.pid, "SIGKILL", 1)
    assert "exit_code" not in detection
    _, running = only(journald.lines, lambda e: transition("good", "RUNNING")(e) and e["incarnation"] == 1)
    assert running["pid"] == journald.pid and "signal" not in running and "exit_code" not in running


def test_each_control_action_is_one_audit_line_with_the_caller(journald):
    me = {"caller_uid": os.getuid(), "caller_pid": os.getpid()}
    for event, fields in (("control.round_start", {"round": 1, "status": 200, "changed": True}),
                          ("control.signal", {"engine": "good", "signal": "SIGKILL", "pid": journald.pid,
                                              "status": 200}),
                          ("control.stop", {"engine": "nope", "status": 404, "error": "unknown_engine"}),
                          ("control.round_end", {"round": 1, "status": 200})):
        prio, line = only(journald.lines, lambda e: e.get("event") == event)
        assert prio == 6 and line.items() >= {**me, **fields}.items(), line
    # Reads (the status polls above) are not audited.
    control = {e["event"] for _, e in journald.lines if e.get("event", "").startswith("control.")}
    assert control == {"control.listening", "control.round_start", "control.signal", "control.stop",
                       "control.round_end"}


EMIT = """
import logging, structlog
from vime.supervisor import logs
logs.configure("debug")
log = structlog.get_logger("t")
log.debug("d"); log.info("i"); log.warning("w"); log.error("e")
logging.getLogger("aiohttp.server").error("from a library")
"""


def emit(tmp_path: Path, journal: str | None) -> list[str]:
    """Lines of a process that configures the daemon's logging, its stderr a file."""
    err = tmp_path / "err"
    err.write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    if journal is not None:
        env["JOURNAL_STREAM"] = journal_stream(err) if journal == "it" else journal
    with open(err, "ab") as f:
        subprocess.run([sys.executable, "-c", EMIT], stderr=f, env=env, check=True, timeout=60)
    return read_lines(err)


def test_the_stdlib_lines_get_priorities_too(tmp_path):
    lines = emit(tmp_path, "it")
    assert [ln[:3] for ln in lines] == ["<7>", "<6>", "<4>", "<3>", "<3>"], lines
    assert json.loads(lines[-1][3:])["event"] == "from a library"


@pytest.mark.parametrize("journal", [None, "another-stream"], ids=["unset", "names-another-stream"])
def test_without_the_journal_lines_are_plain_json(tmp_path, journal):
    # "another-stream": a process started from a unit's shell inherits JOURNAL_STREAM while its
    # stderr goes elsewhere (a pipe, a file): no prefix there.
    lines = emit(tmp_path, None if journal is None else "0:1")
    assert len(lines) == 5 and all(ln.startswith("{") and json.loads(ln) for ln in lines), lines
