"""The reload's handover ($VIME_SUPERVISOR_HANDOVER) is read only by the process it was meant
for, names only real lock files and the very listening socket the previous image served on,
and never reaches an engine's environment."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from vime.supervisor.reexec import HANDOVER_ENV, daemon_argv, inherited, socket_identity


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


def listening(path) -> tuple[socket.socket, tuple[int, int]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(8)
    st = os.lstat(path)
    return sock, (st.st_dev, st.st_ino)


def with_listener(named: dict) -> dict[str, str]:
    return {HANDOVER_ENV: json.dumps({"pid": os.getpid(), "generation": 1, "locks": {}, "listener": named})}


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def test_the_listening_socket_named_is_taken_and_still_queues_calls(tmp_path):
    path = tmp_path / "s.sock"
    sock, bound = listening(path)
    named = socket_identity(sock, str(path), bound)
    fd = sock.detach()  # as the exec leaves it: a bare descriptor
    got = inherited(with_listener(named))
    try:
        assert got is not None and got.listener_refused is None and got.listener.fileno() == fd
        assert not got.listener.get_inheritable()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.connect(str(path))
            conn, _ = got.listener.accept()
            conn.close()
    finally:
        if got is not None and got.listener is not None:
            got.listener.close()


def test_a_listener_whose_file_was_replaced_is_not_handed_over(tmp_path):
    path = tmp_path / "s.sock"
    sock, bound = listening(path)
    with sock:
        os.unlink(path)
        path.write_text("")
        with pytest.raises(OSError, match="no longer the file"):
            socket_identity(sock, str(path), bound)


def test_a_named_fd_that_is_not_the_socket_is_refused_and_left_open(tmp_path):
    path = tmp_path / "s.sock"
    sock, bound = listening(path)
    other, _ = listening(tmp_path / "other.sock")
    with sock, other:
        named = socket_identity(sock, str(path), bound)
        for fd in (other.fileno(), 0, 987654):  # another listening socket, stdin, no fd at all
            got = inherited(with_listener({**named, "fd": fd}))
            assert got is not None and got.listener is None and f"fd {fd} is not" in got.listener_refused
        assert is_open(other.fileno()) and is_open(0)  # not ours to close


def test_the_socket_itself_failing_a_check_is_refused_and_closed(tmp_path):
    # Bound but not listening; then listening but its file replaced since the handover was written.
    path = tmp_path / "s.sock"
    quiet = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    quiet.bind(str(path))
    st = os.lstat(path)
    named = socket_identity(quiet, str(path), (st.st_dev, st.st_ino))
    fd = quiet.detach()
    got = inherited(with_listener(named))
    assert got.listener is None and got.listener_refused == f"fd {fd} is not listening" and not is_open(fd)

    path2 = tmp_path / "t.sock"
    sock, bound = listening(path2)
    named = socket_identity(sock, str(path2), bound)
    os.unlink(path2)
    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).bind(str(path2))  # another socket's file there now
    fd = sock.detach()
    got = inherited(with_listener(named))
    assert got.listener is None and "was replaced" in got.listener_refused and not is_open(fd)


def test_a_malformed_listener_entry_is_refused():
    for bad in ({"fd": 3}, "3", {"fd": "x", "path": "p", "sock_dev": 1, "sock_ino": 1, "dev": 1, "ino": 1}):
        got = inherited(with_listener(bad))
        assert got is not None and got.listener is None and "malformed" in got.listener_refused
