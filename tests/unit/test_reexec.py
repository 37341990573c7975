"""The reload's handover ($VIME_SUPERVISOR_HANDOVER) is read only by the process it was meant
for, names only real lock files, and never reaches an engine's environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from vime.supervisor.reexec import HANDOVER_ENV, daemon_argv, inherited


def handover(pid: int, locks: dict[str, int], generation: int = 1) -> dict[str, str]:
    return {HANDOVER_ENV: json.dumps({"pid": pid, "generation": generation, "locks": locks}), "PATH": "/bin"}


def test_a_fresh_start_has_no_handover():
    env = {"PATH": "/bin"}
    assert inherited(env) is None and env == {"PATH": "/bin"}


def test_the_lock_fds_named_are_taken_and_the_variable_removed(tmp_path):
    path = tmp_path / "supervisor.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.set_inheritable(fd, True)  # as the exec left it
        env = handover(os.getpid(), {str(path): fd}, generation=3)
        got = inherited(env)
        assert got is not None and got.generation == 3 and got.locks == {str(path): fd}
        assert HANDOVER_ENV not in env
        assert not os.get_inheritable(fd)  # engines spawned from here on do not get it
    finally:
        os.close(fd)


def test_a_handover_for_another_pid_is_ignored(tmp_path):
    env = handover(os.getpid() + 1, {})
    assert inherited(env) is None and HANDOVER_ENV not in env


def test_an_fd_that_is_not_the_named_file_is_not_taken(tmp_path):
    a, b = tmp_path / "a.lock", tmp_path / "b.lock"
    b.write_text("")
    fd = os.open(a, os.O_RDWR | os.O_CREAT)
    try:
        got = inherited(handover(os.getpid(), {str(b): fd, str(tmp_path / "gone.lock"): fd, "x": 999999}))
        assert got is not None and got.locks == {}
    finally:
        os.close(fd)


def test_garbage_is_ignored():
    for raw in ("not json", "[]", '{"pid": "x"}', json.dumps({"pid": os.getpid(), "generation": "one", "locks": {}})):
        env = {HANDOVER_ENV: raw}
        assert inherited(env) is None and env == {}


def test_the_daemon_is_run_again_by_this_interpreter_with_its_options():
    code = "import json; from vime.supervisor.reexec import daemon_argv; print(json.dumps(daemon_argv()))"
    out = subprocess.run([sys.executable, "-X", "utf8", "-c", code, "--config", "x.toml"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [sys.executable, "-X", "utf8", "-c", code, "--config", "x.toml"]
