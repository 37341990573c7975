"""The suite's leak check (tests/support/leaks.py) on tiny pytest sessions of its own: one that
leaves processes behind fails, names and kills them; one that stops what it starts passes; a
process started outside the session is never taken for one of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

LEAKY = '''
import os, subprocess, sys, time
from pathlib import Path

SLEEP = "import time; time.sleep(120)"

def orphan(cmd, **kw):
    """`cmd` started by a child that exits at once: re-parented, no longer our descendant."""
    mid = subprocess.Popen([sys.executable, "-c",
        "import subprocess, sys; p = subprocess.Popen(sys.argv[1:], start_new_session=True, "
        "stdout=sys.stdout, stderr=sys.stderr); print(p.pid, flush=True)", *cmd], stdout=subprocess.PIPE, **kw)
    pid = int(mid.stdout.readline())
    mid.wait()
    return pid

def test_a_child_not_stopped():
    subprocess.Popen([sys.executable, "-c", SLEEP, "child-left"])

def test_an_orphan_marked_by_the_environment():
    Path("pids").open("a").write(f"{orphan([sys.executable, '-c', SLEEP, 'orphan-marked'])}\\n")

def test_an_orphan_with_no_environment_logging_under_tmp_path(tmp_path):
    # As vllm-router: its environment rewritten, re-parented once its daemon is killed.
    with open(tmp_path / "router.log", "w") as log:
        pid = orphan(["/usr/bin/env", "-i", sys.executable, "-c", SLEEP, "orphan-clean"], env={},
                     stderr=log)
    Path("pids").open("a").write(f"{pid}\\n")
'''

TIDY = '''
import subprocess, sys

def test_a_child_stopped():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    p.kill()
    p.wait()
'''


def session(folder: Path, source: str) -> subprocess.CompletedProcess:
    folder.mkdir()
    (folder / "test_tiny.py").write_text(textwrap.dedent(source))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "VIME_TEST_LEAK_GRACE_S": "0.5"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "support.leaks", "-p", "no:cacheprovider",
         "--basetemp", str(folder / "tmp"), "test_tiny.py"],
        cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_session_that_leaves_processes_fails_naming_and_killing_them(tmp_path):
    # The user's own process, started outside the tiny session (not its descendant, not marked
    # with its token, writing nowhere under its basetemp): never taken for one of its own.
    outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "outside"],
                               start_new_session=True)
    try:
        run = session(tmp_path / "leaky", LEAKY)
        out = run.stdout + run.stderr
        assert run.returncode == 1, out
        assert "3 passed" in out and "processes left behind" in out, out
        orphans = [int(x) for x in (tmp_path / "leaky" / "pids").read_text().split()]
        for tag, why in (("child-left", "a descendant of pytest"),
                         ("orphan-marked", "VIME_TEST_SESSION in its environment"),
                         ("orphan-clean", "writes under this session's basetemp")):
            assert any(tag in line and why in line for line in out.splitlines()), (tag, out)
        assert "outside" not in out and str(outside.pid) not in out, out
        for pid in orphans:
            assert f"pid {pid} " in out, out
            deadline = time.monotonic() + 10
            while alive(pid):
                assert time.monotonic() < deadline, f"{pid} still alive: the check did not kill it"
                time.sleep(0.05)
        assert outside.poll() is None, "the check killed a process it did not start"
    finally:
        outside.kill()
        outside.wait()


def test_a_session_that_stops_what_it_starts_passes(tmp_path):
    run = session(tmp_path / "tidy", TIDY)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "processes left behind" not in run.stdout
