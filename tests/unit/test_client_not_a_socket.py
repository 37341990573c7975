"""A --socket (or client socket_path) that names a regular file or a folder: supervisorctl and both
clients say what is there and that it is not the daemon's control socket, at once (waiting will
not turn it into one), instead of calling it a stale socket. A real stale socket (bound, then
its listener gone) keeps its own wording."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest

from vime.supervisor.client import AsyncSupervisorClient, DaemonUnreachable, SupervisorClient
from vime.supervisor.client.cli import EXIT_UNKNOWN

NOT_THE_SOCKET = (" not the vime-supervisor daemon's control socket: give the socket the daemon listens on "
                  "(<runtime_dir>/supervisor.sock; $VIME_SUPERVISOR_SOCKET chooses another)")


def test_supervisorctl_on_a_regular_file_says_it_is_one_and_what_to_pass(tmp_path):
    path = tmp_path / "x"
    path.write_text("x")
    r = subprocess.run([sys.executable, "-m", "vime.supervisor.client.cli", "--socket", str(path), "status"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == EXIT_UNKNOWN, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0] == f"supervisorctl: {path} is a regular file," + NOT_THE_SOCKET
    assert lines[1].startswith("supervisorctl: choose the socket with --socket PATH or $VIME_SUPERVISOR_SOCKET")
    assert r.stdout == ""


@pytest.mark.parametrize("kind", ["a regular file", "a directory"])
def test_both_clients_refuse_a_path_that_is_not_a_socket_without_retrying(tmp_path, kind):
    path = tmp_path / "x"
    path.write_text("x") if kind == "a regular file" else path.mkdir()
    # connect_timeout far above the test's time: the refusal comes at once, not after retries.
    with pytest.raises(DaemonUnreachable) as blocking:
        SupervisorClient(path, connect_timeout=60).status()
    assert blocking.value.message == f"{path} is {kind}," + NOT_THE_SOCKET

    async def aio() -> None:
        client = AsyncSupervisorClient(path, connect_timeout=60)
        try:
            await client.status()
        finally:
            await client.aclose()
    with pytest.raises(DaemonUnreachable) as asynchronous:
        asyncio.run(asyncio.wait_for(aio(), 10))
    assert asynchronous.value.message == blocking.value.message


def test_a_stale_socket_is_still_called_one(tmp_path):
    path = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # the file stays, nothing listens: ECONNREFUSED, as for a regular file
    with pytest.raises(DaemonUnreachable) as e:
        SupervisorClient(path, connect_timeout=0.1).status()
    assert "a stale socket: the daemon is not listening" in e.value.message
    assert "not the vime-supervisor daemon's control socket" not in e.value.message
