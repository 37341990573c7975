"""supervisorctl as operators use supervisord's: all and globs, tail -N / -f, signal, pid, avail,
version, maintail, start/restart waiting, and the exit statuses (supervisord 4.3's LSB codes).

Every check runs the real command (`python -m vime.supervisor.client.cli`, or the installed
`supervisorctl` script) in a subprocess against a real daemon (`python -m vime.supervisor`, its
stderr appended to a file, so `maintail` has a log to read). The daemon supervises:

  e0, e1   spawned by the daemon: PROTOCOL STAND-INS for vLLM servers (tests/support/standin_ctl.py: /health,
           /v1/completions, /weight_info; GET /say?text=X prints X to its log; SIGHUP prints
           "SIGHUP received"); each boots in well under a second
  flaky    the same stand-in, told by a mode file to fail its start ("fail") or to take 3 s
           ("slow")
  far      attached to a port where nothing listens: never running
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest

from vime.harness.local_daemon import free_port, live_pids_in_groups, standin_python, write_config
from vime.supervisor.client import BadRequest, ConflictError, SupervisorClient
from vime.supervisor.client.cli import select, start_outcome, transition_outcome

from support.standins import STANDIN_CTL

REPO = Path(__file__).resolve().parents[2]
# far (attached, nothing listening) stays STARTING this long: the status test reads it as a start
# in progress; every ctl call is a new interpreter, seconds apart on a loaded machine.
FIRST_WAIT = 60.0
SPAWNED = ("e0", "e1", "flaky")
ENGINES = (*SPAWNED, "far")


# -- helpers ---------------------------------------------------------------------------------


def ctl(*args: str, sock, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "VIME_SUPERVISOR_SOCKET"}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "vime.supervisor.client.cli", "--socket", str(sock), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=full)


def ctl_popen(*args: str, sock) -> subprocess.Popen:
    # SIGINT at its default, as for a command in a terminal's foreground (a test run in the
    # background of a non-interactive shell inherits it ignored, and Ctrl-C would not reach).
    return subprocess.Popen([sys.executable, "-m", "vime.supervisor.client.cli", "--socket", str(sock), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


class Lines:
    """A stream's lines, read on a thread, so a test can wait for one with a timeout."""

    def __init__(self, stream):
        self.q: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=lambda: [self.q.put(ln) for ln in stream], daemon=True).start()

    def until(self, pred, timeout: float = 15.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.q.get(timeout=0.2)
            except queue.Empty:
                continue
            self.seen.append(line)
            if pred(line):
                return line
        raise AssertionError(f"no such line within {timeout}s; saw: {self.seen[-20:]}")


def interrupt(proc: subprocess.Popen) -> int:
    try:
        proc.send_signal(signal.SIGINT)
        return proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def engines(client: SupervisorClient) -> dict[str, dict]:
    return {e["name"]: e for e in client.status()["engines"]}


def wait_state(client: SupervisorClient, name: str, states: set[str], timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        e = engines(client)[name]
        if e["state"] in states:
            return e
        assert time.monotonic() < deadline, f"{name} is {e['state']} ({e['reason']}), not {states}"
        time.sleep(0.1)


def all_running(client: SupervisorClient) -> None:
    for name in SPAWNED:
        wait_state(client, name, {"RUNNING"})


def say(e: dict, text: str) -> None:
    urllib.request.urlopen(f"{e['url']}/say?text={text}", timeout=5).read()


def log_events(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def wait_socket(sock: Path, proc: subprocess.Popen, log: Path, timeout: float = 30.0) -> SupervisorClient:
    client, deadline = SupervisorClient(str(sock), connect_timeout=0.2), time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the daemon exited {proc.returncode}: {log.read_text()[-3000:]}"
        try:
            client.status()
            return SupervisorClient(str(sock))
        except Exception:  # noqa: BLE001 - not listening yet
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)


def stop_daemon(proc: subprocess.Popen, log: Path) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    groups = {e["pid"] for e in log_events(log) if e.get("event") == "engine.spawned"}
    for pid, _, _ in live_pids_in_groups(groups):
        os.kill(pid, signal.SIGKILL)


# -- the module's daemon ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("ctl-habits")
    standin = standin_python(root, STANDIN_CTL)
    model = root / "model"  # the config check wants a directory with config.json
    model.mkdir()
    (model / "config.json").write_text("{}")
    modes = {name: root / f"{name}.mode" for name in SPAWNED}
    cfg = write_config(
        root / "supervisor.toml",
        supervisor={"runtime_dir": str(root / "run"), "log_dir": str(root / "logs"), "stop_timeout": 3.0,
                    "python": str(standin)},
        health_check={"first_wait": FIRST_WAIT, "interval": 0.5, "timeout": 0.4},
        restart={"start_retries": 2, "backoff_initial": 0.2, "backoff_max": 0.5},
        warmup={"requests": 0},
        engines=[*({"name": n, "model": str(model), "port": free_port(), "env": {"STANDIN_MODE_FILE": str(modes[n])}}
                   for n in SPAWNED),
                 {"name": "far", "url": f"http://127.0.0.1:{free_port()}"}],
    )
    log = root / "daemon.log"
    with open(log, "ab") as f:  # the daemon's stderr is this file: maintail reads it
        proc = subprocess.Popen([sys.executable, "-m", "vime.supervisor", "--config", str(cfg)],
                                stdout=f, stderr=f, stdin=subprocess.DEVNULL)
    try:
        sock = root / "run" / "supervisor.sock"
        client = wait_socket(sock, proc, log)
        all_running(client)
        yield SimpleNamespace(proc=proc, sock=sock, log=log, modes=modes, client=client)
    finally:
        stop_daemon(proc, log)


# -- names: all, NAME:*, globs (pure) --------------------------------------------------------------


def test_select_names_all_groups_and_globs():
    es = [{"name": n, "state": s} for n, s in (("e0", "RUNNING"), ("e1", "STOPPED"), ("x", "RUNNING"))]
    running = lambda e: e["state"] == "RUNNING"  # noqa: E731

    def names(args, applies=lambda e: True):
        sel = select(args, es, applies)
        return [e["name"] for e in sel.engines], sel.missing_lines()

    assert names(["all"]) == (["e0", "e1", "x"], [])
    assert names(["all"], running) == (["e0", "x"], [])  # all takes what the verb applies to
    assert names(["e1"], running) == (["e1"], [])  # a full name is always tried
    assert names(["e*", "x", "e0"]) == (["e0", "e1", "x"], [])  # once each, in the order named
    assert names(["e*"], running) == (["e0"], [])
    assert names(["e[1]", "?0"]) == (["e1", "e0"], [])
    assert names(["e0:*", "x:", "e1:e1"]) == (["e0", "x", "e1"], [])  # each engine is a group of one
    assert names(["nope", "z*", "z:*", "e0:e1"]) == ([], [
        "nope: ERROR (no such process)", "z*: ERROR (no such process)", "z: ERROR (no such group)",
        "e0:e1: ERROR (no such process)"])
    assert names(["E0"]) == ([], ["E0: ERROR (no such process)"])  # case matters, as names do


def test_start_outcome_reads_the_incarnation_it_waits_for():
    e = lambda state, inc, **kw: {"state": state, "incarnation": inc, "reason": "why", **kw}  # noqa: E731
    assert start_outcome(e("STARTING", 4), 4) is None
    assert start_outcome(e("RUNNING", 4), 4) == (True, "")
    assert start_outcome(e("STALE", 4), 4) == (True, "")  # up, weights to be synced
    assert start_outcome(e("BACKOFF", 4), 4) == (False, "BACKOFF: why")
    assert start_outcome(e("FATAL", 4), 4) == (False, "FATAL: why")
    assert start_outcome(e("STOPPING", 4, uptime=None), 4) is None  # a failing start's stop
    assert start_outcome(e("STOPPING", 4, uptime=3.0), 4) == (True, "")  # it was up
    assert start_outcome(e("EXITED", 3), 4) is None  # the last one still being cleaned up
    assert start_outcome(e("STOPPED", 3, state_age=0.5), 4, 2.0) == (False, "STOPPED: why")  # a stop cancelled it
    assert start_outcome(e("STOPPED", 3, state_age=3.0), 4, 2.0) is None  # a restart's own stop, before
    assert start_outcome(e("RUNNING", 5), 4) == (False, "RUNNING as incarnation 5: why")


def test_transition_outcome_reads_the_incarnation_it_waits_for():
    ev = lambda to, inc, ts=10.0: {"event": "transition", "to_state": to, "incarnation": inc, "reason": "why",  # noqa: E731
                                   "ts": ts}
    assert transition_outcome(ev("STARTING", 4), 4) is None
    assert transition_outcome(ev("STOPPING", 4), 4) is None  # a failing start's stop: where does it end
    assert transition_outcome(ev("RUNNING", 4), 4) == (True, "")
    assert transition_outcome(ev("STALE", 4), 4) == (True, "")
    assert transition_outcome(ev("BACKOFF", 4), 4) == (False, "BACKOFF: why")
    assert transition_outcome(ev("STOPPED", 3), 4, 9.0) == (False, "STOPPED: why")  # a stop cancelled the start
    assert transition_outcome(ev("STOPPED", 3, ts=8.0), 4, 9.0) is None  # a restart's own stop, before
    assert transition_outcome(ev("EXITED", 3), 4) is None  # the last incarnation's end
    assert transition_outcome(ev("RUNNING", 5), 4) == (False, "RUNNING as incarnation 5: why")


# -- status, avail, version, pid -----------------------------------------------------------------


def test_status_all_globs_and_exit_statuses(fleet):
    all_running(fleet.client)
    p = ctl("status", "all", sock=fleet.sock)
    # far (attached, never answered) is STARTING: as supervisord's, a start in progress exits 0
    # (3 is for STOPPED, EXITED, FATAL: test_stop_all_start_all, test_client_ctl)
    assert p.returncode == 0, p
    assert [ln.split()[0] for ln in p.stdout.splitlines()] == list(ENGINES)
    for args in (["e*"], ["e0:*", "e1"], ["?1", "flaky:flaky"]):
        p = ctl("status", *args, sock=fleet.sock)
        assert p.returncode == 0 and p.stderr == "", (args, p)
    p = ctl("status", "e*", "far:*", sock=fleet.sock)
    assert p.returncode == 0 and [ln.split()[0] for ln in p.stdout.splitlines()] == ["e0", "e1", "far"]
    p = ctl("status", "e0", "nope*", "nope:*", sock=fleet.sock)
    assert p.returncode == 4, p
    assert p.stdout.split()[0] == "e0"
    assert p.stderr.splitlines()[:2] == ["nope*: ERROR (no such process)", "nope: ERROR (no such group)"]


def test_avail_and_version(fleet):
    p = ctl("avail", sock=fleet.sock)
    assert p.returncode == 0, p
    assert p.stdout.splitlines() == ["%-32s %-9s %-9s %s" % (n, "in use", "manual" if n == "far" else "auto", "999:999")
                                     for n in ENGINES]
    p = ctl("version", sock=fleet.sock)
    assert (p.returncode, p.stdout) == (0, metadata.version("vime-supervisor") + "\n"), p
    p = ctl("avail", "e0", sock=fleet.sock)  # takes no arguments: a usage error
    assert p.returncode == 2


def test_pid(fleet):
    all_running(fleet.client)
    by = engines(fleet.client)
    p = ctl("pid", sock=fleet.sock)
    assert (p.returncode, p.stdout) == (0, f"{fleet.proc.pid}\n"), p
    p = ctl("pid", "e0", sock=fleet.sock)
    assert (p.returncode, p.stdout) == (0, f"{by['e0']['pid']}\n"), p
    p = ctl("pid", "all", sock=fleet.sock)  # one per engine, 0 for none; all: no failure for that
    assert p.returncode == 0 and p.stdout.split() == [str(by[n]["pid"] or 0) for n in ENGINES], p
    p = ctl("pid", "far", sock=fleet.sock)
    assert (p.returncode, p.stdout) == (1, "0\n") and "far: attached" in p.stderr, p
    p = ctl("pid", "nope", sock=fleet.sock)
    assert (p.returncode, p.stdout, p.stderr) == (1, "", "No such process nope\n")


# -- tail ----------------------------------------------------------------------------------------


def test_tail_bytes_and_channels(fleet):
    all_running(fleet.client)
    path = Path(fleet.client.engine_log("e0").path)
    data = path.read_bytes()  # the stand-in writes nothing unasked: the log stands still
    assert len(data) > 300
    p = ctl("tail", "-100", "e0", sock=fleet.sock)
    assert p.returncode == 0 and p.stdout.encode() == data[-100:], p
    p = ctl("tail", "e0", sock=fleet.sock)  # supervisord's default, 1600 bytes
    assert p.returncode == 0 and p.stdout.encode() == data[-1600:]
    p = ctl("tail", "-n", "7", "e0", "stderr", sock=fleet.sock)  # one log holds both channels
    assert p.returncode == 0 and p.stdout.encode() == data[-7:]
    p = ctl("tail", "e0", "stdlog", sock=fleet.sock)
    assert p.returncode == 2 and "stdlog" in p.stderr
    p = ctl("tail", "far", sock=fleet.sock)
    assert p.returncode == 1 and p.stderr.startswith("far: ERROR (far has no log yet"), p


def test_tail_follow_prints_lines_written_later(fleet):
    all_running(fleet.client)
    e = engines(fleet.client)["e0"]
    proc = ctl_popen("tail", "-f", "--interval", "0.2", "e0", sock=fleet.sock)
    out, err = Lines(proc.stdout), Lines(proc.stderr)
    try:
        err.until(lambda ln: ln == "==> Press Ctrl-C to exit <==\n")
        out.until(lambda ln: "stand-in pid" in ln)  # the tail so far
        for word in ("later-1", "later-2"):
            say(e, word)
            out.until(lambda ln: ln == f"{word}\n")
    finally:
        assert interrupt(proc) == 0
    assert [ln for ln in out.seen if ln.startswith("later-")] == ["later-1\n", "later-2\n"]  # each once


def test_tail_follow_goes_on_to_the_next_incarnation(fleet):
    all_running(fleet.client)
    before = engines(fleet.client)["e1"]
    proc = ctl_popen("tail", "-f", "--interval", "0.2", "e1", sock=fleet.sock)
    out = Lines(proc.stdout)
    try:
        out.until(lambda ln: f"stand-in pid {before['pid']}" in ln)
        fleet.client.restart("e1")
        header = out.until(lambda ln: "(new incarnation)" in ln)
        assert header == f"==> {fleet.log.parent / 'logs'}/e1.{before['incarnation'] + 1}.log (new incarnation) <==\n"
        after = wait_state(fleet.client, "e1", {"RUNNING"})
        out.until(lambda ln: f"stand-in pid {after['pid']}" in ln)
    finally:
        assert interrupt(proc) == 0


# -- signal --------------------------------------------------------------------------------------


def test_signal_hup_reaches_the_engine_and_is_logged_with_its_sender(fleet):
    all_running(fleet.client)
    e = engines(fleet.client)["e0"]
    proc = subprocess.Popen([sys.executable, "-m", "vime.supervisor.client.cli", "--socket", str(fleet.sock), "signal",
                             "HUP", "e0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out, err) == (0, "e0: signalled\n", "")
    deadline = time.monotonic() + 10
    while "SIGHUP received" not in fleet.client.engine_log("e0"):
        assert time.monotonic() < deadline, fleet.client.engine_log("e0")
        time.sleep(0.1)
    after = engines(fleet.client)["e0"]
    assert (after["state"], after["pid"], after["incarnation"]) == ("RUNNING", e["pid"], e["incarnation"])
    audit = [ev for ev in log_events(fleet.log) if ev.get("event") == "control.signal"]
    assert audit and audit[-1]["engine"] == "e0" and audit[-1]["signal"] == "SIGHUP" and audit[-1]["pid"] == e["pid"]
    assert audit[-1]["caller_uid"] == os.getuid() and audit[-1]["caller_pid"] == proc.pid


def test_signal_term_ends_the_engine_and_supervision_restarts_it(fleet):
    all_running(fleet.client)
    e = engines(fleet.client)["e1"]
    p = ctl("signal", "15", "e1", sock=fleet.sock)  # by number, as supervisord takes it too
    assert (p.returncode, p.stdout) == (0, "e1: signalled\n"), p
    deadline = time.monotonic() + 20
    while True:
        now = engines(fleet.client)["e1"]
        if now["state"] == "RUNNING" and now["incarnation"] > e["incarnation"]:
            break
        assert time.monotonic() < deadline, now
        time.sleep(0.1)
    assert now["pid"] != e["pid"] and now["restarts"] == e["restarts"] + 1


def test_signal_refusals(fleet):
    all_running(fleet.client)
    pid = engines(fleet.client)["e0"]["pid"]
    p = ctl("signal", "NOPE", "e0", sock=fleet.sock)  # refused before anything is sent
    assert (p.returncode, p.stdout) == (1, "") and "no such signal 'NOPE'" in p.stderr, p
    with pytest.raises(BadRequest) as e:  # the daemon refuses it too
        fleet.client.signal("e0", "SIGNOPE")
    assert (e.value.status, e.value.code) == (400, "bad_signal")
    for bad in (0, 99, "-1"):
        with pytest.raises(BadRequest):
            fleet.client.signal("e0", bad)
    assert engines(fleet.client)["e0"]["pid"] == pid
    p = ctl("signal", "HUP", "far", sock=fleet.sock)
    assert p.returncode == 1 and p.stderr.startswith("far: ERROR (far is attached"), p
    with pytest.raises(ConflictError) as c:
        fleet.client.signal("far", "HUP")
    assert (c.value.status, c.value.code) == (409, "conflict")
    p = ctl("signal", "HUP", "nope", sock=fleet.sock)
    assert p.returncode == 1 and p.stderr.startswith("nope: ERROR (no such process)\n"), p


def test_signal_all_and_a_stopped_engine(fleet):
    all_running(fleet.client)
    p = ctl("signal", "HUP", "all", sock=fleet.sock)  # the spawned engines with a process; far is skipped
    assert p.returncode == 0 and sorted(p.stdout.splitlines()) == [f"{n}: signalled" for n in sorted(SPAWNED)], p
    p = ctl("stop", "flaky", sock=fleet.sock)
    assert (p.returncode, p.stdout) == (0, "flaky: stopped\n"), p
    try:
        p = ctl("signal", "HUP", "flaky", sock=fleet.sock)  # named in full: not running
        assert (p.returncode, p.stderr) == (7, "flaky: ERROR (not running)\n"), p
        with pytest.raises(ConflictError) as c:
            fleet.client.signal("flaky", "HUP")
        assert c.value.code == "not_running"
        p = ctl("pid", "flaky", sock=fleet.sock)
        assert (p.returncode, p.stdout) == (7, "0\n"), p
        p = ctl("signal", "HUP", "f*", sock=fleet.sock)  # a pattern skips it (and far): nothing to do
        assert (p.returncode, p.stdout, p.stderr) == (0, "", ""), p
    finally:
        p = ctl("start", "flaky", sock=fleet.sock)
        assert (p.returncode, p.stdout) == (0, "flaky: started\n"), p


# -- start/stop/restart: all, globs, waiting ------------------------------------------------------


def test_stop_all_start_all(fleet):
    all_running(fleet.client)
    p = ctl("stop", "all", sock=fleet.sock)  # far (attached) is not one to stop
    assert p.returncode == 0 and sorted(p.stdout.splitlines()) == [f"{n}: stopped" for n in sorted(SPAWNED)], p
    assert ctl("status", "e*", sock=fleet.sock).returncode == 3
    p = ctl("stop", "all", sock=fleet.sock)  # nothing left to stop
    assert (p.returncode, p.stdout, p.stderr) == (0, "", "")
    p = ctl("stop", "far", sock=fleet.sock)  # named in full: refused
    assert p.returncode == 1 and p.stderr.startswith("far: ERROR (far is attached"), p
    p = ctl("start", "all", sock=fleet.sock)  # waits: each line once that engine is up
    assert p.returncode == 0 and sorted(p.stdout.splitlines()) == [f"{n}: started" for n in sorted(SPAWNED)], p
    assert all(e["state"] == "RUNNING" for n, e in engines(fleet.client).items() if n != "far")
    p = ctl("start", "e0", sock=fleet.sock)  # supervisord's "already started", exit status 0
    assert (p.returncode, p.stdout, p.stderr) == (0, "", "e0: ERROR (already started)\n"), p
    p = ctl("start", "all", sock=fleet.sock)
    assert (p.returncode, p.stdout, p.stderr) == (0, "", "")
    p = ctl("stop", "nope*", sock=fleet.sock)
    assert (p.returncode, p.stderr.splitlines()[0]) == (1, "nope*: ERROR (no such process)"), p


def test_restart_globs_wait_by_default(fleet):
    all_running(fleet.client)
    before = engines(fleet.client)
    p = ctl("restart", "e*", sock=fleet.sock)
    assert p.returncode == 0, p
    assert sorted(p.stdout.splitlines()) == ["e0: started", "e0: stopped", "e1: started", "e1: stopped"]
    assert p.stdout.index("e0: stopped") < p.stdout.index("e0: started")
    after = engines(fleet.client)
    for n in ("e0", "e1"):  # up again when the command returned
        assert after[n]["state"] == "RUNNING" and after[n]["incarnation"] == before[n]["incarnation"] + 1
    p = ctl("restart", "--no-wait", "e0", sock=fleet.sock)
    assert p.returncode == 0 and re.fullmatch(r"e0: starting \(incarnation \d+\)\n", p.stdout), p


def test_a_failed_start_is_reported_as_supervisords(fleet):
    all_running(fleet.client)
    fleet.modes["flaky"].write_text("fail")
    try:
        p = ctl("restart", "flaky", sock=fleet.sock)
        assert p.returncode == 7, p  # LSB "not running", as supervisord's spawn error / abnormal termination
        assert p.stdout == "flaky: stopped\n"
        assert p.stderr.startswith("flaky: ERROR (abnormal termination) BACKOFF: start failed (1/2): exit status 1 "
                                   "while starting: boom: failing on purpose"), p
        wait_state(fleet.client, "flaky", {"FATAL"})  # the daemon's own retry fails too
        p = ctl("start", "flaky", sock=fleet.sock)
        assert p.returncode == 7 and p.stderr.startswith("flaky: ERROR (abnormal termination)"), p
        wait_state(fleet.client, "flaky", {"FATAL"})
    finally:
        fleet.modes["flaky"].write_text("ok")
    p = ctl("start", "flaky", sock=fleet.sock)  # a fresh start budget
    assert (p.returncode, p.stdout) == (0, "flaky: started\n"), p


def test_a_start_that_outlasts_the_wait(fleet):
    all_running(fleet.client)
    fleet.modes["flaky"].write_text("slow")  # 3 s before it listens
    try:
        p = ctl("restart", "--wait-timeout", "0.5", "flaky", sock=fleet.sock)
        assert p.returncode == 1, p
        assert p.stderr == ("flaky: ERROR (not started within 0.5s: still STARTING; `supervisorctl status flaky` "
                            "shows how it goes on)\n"), p
    finally:
        fleet.modes["flaky"].write_text("ok")
    wait_state(fleet.client, "flaky", {"RUNNING"})


# -- maintail ------------------------------------------------------------------------------------


def test_maintail_reads_the_daemons_log_file(fleet):
    p = ctl("maintail", "-200", sock=fleet.sock)
    assert p.returncode == 0 and 0 < len(p.stdout.encode()) <= 200, p
    assert p.stdout in fleet.log.read_text()
    p = ctl("maintail", "-1000000", sock=fleet.sock)
    assert '"event": "control.listening"' in p.stdout
    proc = ctl_popen("maintail", "-f", "--interval", "0.2", sock=fleet.sock)
    out = Lines(proc.stdout)
    try:
        time.sleep(0.5)  # its first tail is read: what follows comes from the polls
        fleet.client.signal("e0", "HUP")  # the daemon logs it (control.signal)
        line = out.until(lambda ln: '"control.signal"' in ln)
        assert json.loads(line)["engine"] == "e0"
    finally:
        assert interrupt(proc) == 0


def test_maintail_without_a_log_file_names_the_journal(tmp_path):
    """A daemon whose stderr is the systemd journal (JOURNAL_STREAM names it): no log file, and
    the command that reads the journal."""
    r, w = os.pipe()
    st = os.fstat(w)
    cfg = write_config(tmp_path / "supervisor.toml",
                       supervisor={"runtime_dir": str(tmp_path / "run"), "log_dir": str(tmp_path / "logs")},
                       health_check={"first_wait": 5.0, "interval": 1.0, "timeout": 0.5},
                       engines=[{"name": "far", "url": f"http://127.0.0.1:{free_port()}"}])
    proc = subprocess.Popen([sys.executable, "-m", "vime.supervisor", "--config", str(cfg)], stdout=w, stderr=w,
                            stdin=subprocess.DEVNULL, env={**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
    os.close(w)
    log = tmp_path / "daemon.log"
    with open(log, "wb") as sink:
        def pump() -> None:  # drained, so the daemon never blocks on a full pipe
            for chunk in iter(lambda: os.read(r, 65536), b""):
                sink.write(chunk)
                sink.flush()

        drain = threading.Thread(target=pump, daemon=True)
        drain.start()
        try:
            wait_socket(tmp_path / "run" / "supervisor.sock", proc, log)
            sock = tmp_path / "run" / "supervisor.sock"
            p = ctl("maintail", sock=sock)
            assert p.returncode == 1 and p.stdout == "", p  # supervisord's status for "no log file"
            first, second = p.stderr.splitlines()
            assert first == "vime-supervisor: ERROR (no log file)"
            assert re.fullmatch(r"supervisorctl: the daemon logs to the systemd journal, not to a file; read it "
                                r"with: journalctl -u \S+", second), second
            assert second.endswith("journalctl -u vime-supervisor") or second.endswith(".service")
            p = ctl("maintail", "-f", sock=sock)
            assert p.returncode == 1 and re.search(r"journalctl -u \S+ -f$", p.stderr.splitlines()[1]), p
        finally:
            stop_daemon(proc, log)
            drain.join(5)
            os.close(r)


def test_daemon_log_file_says_what_stderr_is(tmp_path):
    """The three answers of control.daemon_log_file, each in a process whose stderr is that."""
    code = "import sys; from vime.supervisor.control import daemon_log_file; print(daemon_log_file())"
    logfile = tmp_path / "err.log"
    with open(logfile, "w") as f:
        p = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=f, text=True, timeout=60)
    assert p.stdout.strip() == repr((str(logfile), ""))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    path, why = eval(p.stdout)  # noqa: S307 - our own repr of a tuple of str
    assert path is None and "which is a pipe, not a file" in why and "journalctl -u vime-supervisor" in why


# -- the installed script --------------------------------------------------------------------------


def test_the_installed_supervisorctl_has_the_new_verbs(fleet):
    script = Path(sys.executable).parent / "supervisorctl"
    if not script.exists():
        pytest.skip(f"{script} not installed (pip install -e .)")
    env = {k: v for k, v in os.environ.items() if k not in ("VIME_SUPERVISORCTL", "PYTHONPATH")}
    env["VIME_SUPERVISOR_SOCKET"] = str(fleet.sock)
    for argv, rc, out in ((["pid"], 0, f"{fleet.proc.pid}\n"), (["version"], 0, metadata.version("vime-supervisor") + "\n")):
        p = subprocess.run([str(script), *argv], capture_output=True, text=True, timeout=60, cwd="/", env=env)
        assert (p.returncode, p.stdout) == (rc, out), (argv, p)
