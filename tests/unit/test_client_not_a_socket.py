"""A --socket (or client socket_path, or $VIME_SUPERVISOR_SOCKET) that cannot be the daemon's
socket: empty, longer than AF_UNIX allows, under a regular file, or naming a regular file, a
folder or a FIFO. supervisorctl and both clients say so at once (waiting will not turn it into
one), in one line, with code bad_socket_path (a daemon that is down reads "unreachable"), instead
of retrying or calling it a stale socket. A real stale socket (bound, then its listener gone)
keeps its own wording."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest

from vime.supervisor.client import AsyncSupervisorClient, ClientCode, DaemonUnreachable, SupervisorClient, dispatch
from vime.supervisor.client.cli import EXIT_UNKNOWN, main

NOT_THE_SOCKET = (" not the vime-supervisor daemon's control socket: give the socket the daemon listens on "
                  "(<runtime_dir>/supervisor.sock; $VIME_SUPERVISOR_SOCKET chooses another)")


def test_supervisorctl_on_a_regular_file_says_it_is_one_and_what_to_pass(tmp_path):
    path = tmp_path / "x"
    path.write_text("x")
    r = subprocess.run([sys.executable, "-m", "vime.supervisor.client.cli", "--socket", str(path), "status"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == EXIT_UNKNOWN, r.stderr
    lines = r.stderr.splitlines()
    assert lines == [f"supervisorctl: {path} is a regular file," + NOT_THE_SOCKET]  # it says what to give
    assert r.stdout == ""


EMPTY = ("the control socket path is empty (--socket '', socket_path='' or $VIME_SUPERVISOR_SOCKET set to ''): "
         "give the socket the daemon listens on (<runtime_dir>/supervisor.sock), or leave "
         "$VIME_SUPERVISOR_SOCKET unset for /run/vime-supervisor/supervisor.sock")


def refusals(path) -> tuple[DaemonUnreachable, DaemonUnreachable]:
    """Both clients' refusal of path (None: their default), each with connect_timeout far above
    the test's time: the refusal comes at once, not after retries."""
    with pytest.raises(DaemonUnreachable) as blocking:
        SupervisorClient(path, connect_timeout=60).status()

    async def aio() -> None:
        client = AsyncSupervisorClient(path, connect_timeout=60)
        try:
            await client.status()
        finally:
            await client.aclose()
    with pytest.raises(DaemonUnreachable) as asynchronous:
        asyncio.run(asyncio.wait_for(aio(), 10))
    return blocking.value, asynchronous.value


def long_path(tmp_path, size: int) -> str:
    return str(tmp_path) + "/" + "s" * (size - len(os.fsencode(str(tmp_path))) - 1)


@pytest.mark.parametrize("kind", ["a regular file", "a directory", "a FIFO (named pipe)", "empty", "too long",
                                  "under a regular file"])
def test_both_clients_refuse_a_path_that_cannot_be_the_socket_at_once(tmp_path, kind):
    path: str = str(tmp_path / "x")
    if kind == "a regular file":
        (tmp_path / "x").write_text("x")
        expected = f"{path} is a regular file," + NOT_THE_SOCKET
    elif kind == "a directory":
        (tmp_path / "x").mkdir()
        expected = f"{path} is a directory," + NOT_THE_SOCKET
    elif kind == "a FIFO (named pipe)":
        os.mkfifo(path)
        expected = f"{path} is a FIFO (named pipe)," + NOT_THE_SOCKET
    elif kind == "empty":
        path, expected = "", EMPTY
    elif kind == "too long":
        path = long_path(tmp_path, 108)
        expected = (f"{path} is 108 bytes, longer than a Unix socket path may be (107 bytes): put the daemon's "
                    f"runtime_dir on a shorter path, or connect through a shorter symlink to the socket")
    else:
        (tmp_path / "x").write_text("x")
        path = str(tmp_path / "x" / "supervisor.sock")
        expected = (f"{path} cannot be a socket: {tmp_path / 'x'} is a regular file, not a folder; give the socket "
                    f"the daemon listens on (<runtime_dir>/supervisor.sock; $VIME_SUPERVISOR_SOCKET chooses another)")
    for e in refusals(path):
        assert (e.message, e.code) == (expected, ClientCode.BAD_SOCKET_PATH)


def test_a_path_of_107_bytes_is_not_refused_as_too_long(tmp_path):
    path = long_path(tmp_path, 107)
    with pytest.raises(DaemonUnreachable) as e:
        SupervisorClient(path, connect_timeout=0).status()
    assert (e.value.code, "no such socket" in e.value.message) == (ClientCode.UNREACHABLE, True)


def test_an_empty_socket_variable_is_refused_not_read_as_the_default(monkeypatch, capsys):
    monkeypatch.setenv("VIME_SUPERVISOR_SOCKET", "")
    for e in refusals(None):
        assert (e.message, e.code) == (EMPTY, ClientCode.BAD_SOCKET_PATH)
    assert main(["status"]) == EXIT_UNKNOWN
    assert capsys.readouterr().err.splitlines() == ["supervisorctl: " + EMPTY]


def test_supervisorctl_refuses_an_empty_socket_option_in_one_line(monkeypatch, capsys):
    monkeypatch.delenv("VIME_SUPERVISOR_SOCKET", raising=False)
    assert main(["--socket", "", "--connect-timeout", "60", "status"]) == EXIT_UNKNOWN
    out = capsys.readouterr()
    assert (out.err.splitlines(), out.out) == (["supervisorctl: " + EMPTY], "")


def test_a_stale_socket_is_still_called_one(tmp_path):
    path = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # the file stays, nothing listens: ECONNREFUSED, as for a regular file
    with pytest.raises(DaemonUnreachable) as e:
        SupervisorClient(path, connect_timeout=0.1).status()
    assert "a stale socket: the daemon is not listening" in e.value.message
    assert "not the vime-supervisor daemon's control socket" not in e.value.message


def test_an_empty_socket_variable_is_answered_by_ours_beside_a_supervisord_config(tmp_path):
    """The dispatcher would otherwise read it as our default socket, find none, and hand an
    ambiguous `status` to supervisord: ours refuses the empty variable instead."""
    conf = tmp_path / "supervisord.conf"
    conf.write_text("[supervisord]\n")
    assert dispatch.choose(["status"], {"VIME_SUPERVISOR_SOCKET": ""}, installed=True, searchpaths=[str(conf)]) == (
        dispatch.VIME, "$VIME_SUPERVISOR_SOCKET is set and empty")
    assert dispatch.choose(["reread"], {"VIME_SUPERVISOR_SOCKET": ""}, installed=True,
                           searchpaths=[str(conf)])[0] == dispatch.SUPERVISORD  # its own action: still its
