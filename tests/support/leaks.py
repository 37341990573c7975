"""No test leaves a process behind: a pytest plugin (tests/conftest.py loads it) that, once
every fixture is torn down, kills what this session started and is still alive, and fails
the run with a list of them.

Ours, and only ours (a process started outside the session is none of these):
- a descendant of this pytest process;
- a process with SESSION_ENV=<this session's token: pytest's pid and start time> in its
  environment (another session's, an outer one's included, has another token): exported at the
  session's start, so every daemon, engine and helper inherits it, even one re-parented to
  init after its parent was killed;
- a process whose stdout or stderr is a file under this session's basetemp: vllm-router
  overwrites its environment (setproctitle), and once its daemon is killed it is no one's
  descendant, but it still writes to its log in the test's tmp_path.
Each also started after this session did, so a recycled pid is never taken for ours.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from vime.supervisor.engine.process import ProcStat, all_procs, proc_stat

SESSION_ENV = "VIME_TEST_SESSION"
# A process on its way out (SIGKILLed by a teardown, a Ray worker whose raylet is gone) is not
# a leak: the check waits this long (s) for it to go, and only while one is left.
GRACE_ENV = "VIME_TEST_LEAK_GRACE_S"
GRACE_S = 10.0
# Started by the interpreter itself and ended when pytest exits: not a test's.
RUNTIME_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


class Left(NamedTuple):
    pid: int
    pgrp: int
    cmdline: str
    why: str


def _token() -> str:
    me = proc_stat(os.getpid())
    return f"{os.getpid()}:{me.start_time if me else 0}"


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")


def _marked(pid: int, token: str) -> bool:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # another user's, or gone
        return False
    return f"{SESSION_ENV}={token}".encode() in env.split(b"\0")


def _writes_under(pid: int, folder: Path | None) -> bool:
    if folder is None:
        return False
    for fd in (1, 2):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder) + os.sep):
            return True
    return False


def _descendants(procs: list[ProcStat], root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for st in procs:
        children.setdefault(st.ppid, []).append(st.pid)
    found, todo = set(), [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            if pid not in found:
                found.add(pid)
                todo.append(pid)
    return found


def left_behind(token: str, basetemp: Path | None) -> list[Left]:
    """The live processes this session started (module docstring), pytest itself aside."""
    me = os.getpid()
    mine = proc_stat(me)
    since = mine.start_time if mine else 0
    procs = [st for st in all_procs() if st.state != "Z" and st.pid != me and st.start_time >= since]
    below = _descendants(procs, me)
    uid = os.getuid()
    found = []
    for st in procs:
        try:
            if os.stat(f"/proc/{st.pid}").st_uid != uid:
                continue
        except OSError:
            continue
        cmd = _cmdline(st.pid)
        if st.ppid == me and any(h in cmd for h in RUNTIME_HELPERS):
            continue
        why = ("a descendant of pytest" if st.pid in below
               else f"{SESSION_ENV} in its environment" if _marked(st.pid, token)
               else "writes under this session's basetemp" if _writes_under(st.pid, basetemp)
               else None)
        if why:
            found.append(Left(st.pid, st.pgrp, cmd or f"[{st.comm}]", why))
    return found


def kill(left: list[Left]) -> None:
    """SIGKILL each one, and its process group when it leads one (an engine's workers are in
    it); never pytest's own group."""
    ours = os.getpgrp()
    for p in left:
        try:
            if p.pgrp == p.pid and p.pgrp != ours:
                os.killpg(p.pgrp, signal.SIGKILL)
            else:
                os.kill(p.pid, signal.SIGKILL)
        except OSError:
            pass


def pytest_configure(config: pytest.Config) -> None:
    # Our own token even under an outer session: its processes are not this session's.
    config.stash[_TOKEN] = os.environ[SESSION_ENV] = _token()


_TOKEN = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)  # after runner's own: every session fixture is torn down by then
def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    token = config.stash.get(_TOKEN, None)
    if token is None:
        return
    factory = getattr(config, "_tmp_path_factory", None)
    basetemp = getattr(factory, "_basetemp", None)  # None when no test asked for a tmp_path
    deadline = time.monotonic() + float(os.environ.get(GRACE_ENV, GRACE_S))
    while (left := left_behind(token, basetemp)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not left:
        return
    kill(left)
    lines = [f"  pid {p.pid} ({p.why}): {p.cmdline}" for p in left]
    text = (f"{len(left)} process(es) this test session started are still alive after its last "
            f"test (killed now); a test or fixture must stop what it starts:\n" + "\n".join(lines))
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.section("processes left behind", sep="=", red=True, bold=True)
        reporter.write_line(text)
    else:
        print(text)
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
