"""Abuse of the control socket: ten thousand generated requests, oversized and truncated
bodies, slow clients, many clients at once. The daemon never crashes, a rejected request
changes nothing, its memory and file descriptors stay bounded.

The daemon is the real `python -m vime.supervisor` with attached engines nobody listens on (no vLLM
boots; see test_control_socket.py, whose raw clients and generators this reuses). Who may
connect (a foreign uid refused with 403, the socket 0660) is tested there.

    VIME_ABUSE_EXAMPLES=50000 pytest tests/daemon/test_socket_abuse.py     # a longer fuzz
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings

from test_control_socket import (  # noqa: F401  (the fixtures are used by name)
    call,
    daemon,
    known_state,
    non_json_lines,
    requests,
    send_generated,
    stable,
    status,
)

EXAMPLES = int(os.environ.get("VIME_ABUSE_EXAMPLES", "10300"))  # ~10,100 reach the daemon


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fewest_fds(pid: int, readings: int = 5) -> int:
    seen = []
    for _ in range(readings):
        seen.append(open_fds(pid))
        time.sleep(0.05)
    return min(seen)


def connect(sock: str, timeout: float = 10.0) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(sock)
            return s
        except BlockingIOError:  # the listen backlog is full: the kernel says wait, as to anyone
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def read_response(s: socket.socket) -> tuple[int, bytes]:
    out = b""
    while b"\r\n\r\n" not in out:
        chunk = s.recv(65536)
        if not chunk:
            break
        out += chunk
    head, _, rest = out.partition(b"\r\n\r\n")
    code = int(head.split()[1]) if head else 0
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    return code, rest


@pytest.fixture(scope="module")
def abuse(known_state):
    d = known_state
    snap = stable(status(d.sock))
    # Warm up (first requests allocate caches) before the memory baseline.
    for _ in range(200):
        status(d.sock)
    return d, snap, rss_kib(d.proc.pid)


def test_ten_thousand_generated_requests(abuse):
    d, snap, _ = abuse
    raw_mark, ev_mark = len(d.raw), d.mark()
    counts = {"sent": 0, "skipped": 0}
    codes: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(req=requests())
    def one(req):
        if (answer := send_generated(d, req, snap)) is None:
            counts["skipped"] += 1
            return
        code = answer[0]
        counts["sent"] += 1
        codes[code] = codes.get(code, 0) + 1
        if counts["sent"] % 50 == 0:  # the full comparison costs a call: every 50th, and at the end
            assert stable(status(d.sock)) == snap

    one()
    print(f"\nfuzz: {counts['sent']} requests sent ({counts['skipped']} generated ones would have changed "
          f"state and were not sent); answers by status: {dict(sorted(codes.items()))}")
    assert counts["sent"] >= EXAMPLES * 0.95, counts
    assert d.proc.poll() is None
    assert stable(status(d.sock)) == snap
    assert not [e for e in d.events[ev_mark:] if e.get("event") == "control.handler_failed"]
    assert non_json_lines(d, raw_mark) == []


@pytest.mark.parametrize("declared,sent", [(1 << 20, 1 << 20), (100 << 20, 4096), (64 * 1024 + 1, 64 * 1024 + 1)])
def test_oversized_bodies_are_refused(abuse, declared, sent):
    d, snap, _ = abuse
    s = connect(d.sock)
    with s:
        s.sendall(b"POST /v1/weights HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {declared}\r\n\r\n".encode())
        try:
            s.sendall(b"{" + b" " * (sent - 1))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon answered and closed before reading it all: fine
        code, body = read_response(s)
    assert code == 413, body[:200]
    assert json.loads(body)["error"]["code"]
    assert stable(status(d.sock)) == snap


def test_truncated_bodies_and_chunks_change_nothing(abuse):
    d, snap, _ = abuse
    cases = [
        b'POST /v1/weights HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"version": 99',
        b'POST /v1/rounds/99/start HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{',
        b'POST /v1/weights HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n{"version": 99',
        b'POST /v1/weights HTTP/1.1\r\nHost: x\r\nContent-Le',
    ]
    for data in cases:
        s = connect(d.sock)
        s.sendall(data)
        s.close()  # gone mid-request
    time.sleep(0.3)
    assert d.proc.poll() is None
    assert stable(status(d.sock)) == snap


def test_slow_clients_do_not_block_others(abuse):
    """200 clients each holding a half-sent request: everyone else is still served at once,
    and when they leave the daemon's descriptors return to what they were."""
    d, snap, _ = abuse
    # The daemon's heartbeat opens and closes probe connections of its own (its engines are
    # attached to ports nobody listens on), so one reading can be a descriptor or two high.
    fds_before = fewest_fds(d.proc.pid)
    slow = []
    for i in range(200):
        s = connect(d.sock)
        s.sendall(b"POST /v1/weights HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n{\"vers" if i % 2
                  else b"GET /v1/sta")
        slow.append(s)
    deadline = time.monotonic() + 10  # the daemon accepts them all (the kernel's backlog is 128)
    while open_fds(d.proc.pid) < fds_before + 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_fds(d.proc.pid) >= fds_before + 200, "the daemon did not accept all 200"
    t0 = time.monotonic()
    for _ in range(20):
        assert stable(status(d.sock)) == snap
    served = time.monotonic() - t0
    assert served < 10, f"20 status calls took {served:.1f}s behind 200 slow clients"
    # One more, a byte at a time (slowloris), is answered when it is complete.
    s = connect(d.sock)
    with s:
        for b in b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n":
            s.sendall(bytes([b]))
            time.sleep(0.005)
        code, body = read_response(s)
    assert code == 200 and json.loads(body)["engines"]
    for s in slow:
        s.close()
    deadline = time.monotonic() + 10
    while open_fds(d.proc.pid) > fds_before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_fds(d.proc.pid) <= fds_before + 2
    assert stable(status(d.sock)) == snap


def test_many_clients_at_once(abuse):
    d, snap, _ = abuse
    errors: list[BaseException] = []
    answered = [0]
    lock = threading.Lock()

    def client(i: int) -> None:
        try:
            for j in range(25):
                if (i + j) % 3:
                    code, _, body = call(d.sock, "GET", "/v1/status")
                    assert code == 200 and json.loads(body)["engines"]
                else:  # a stale round: refused, nothing changes
                    code, hdrs, body = call(d.sock, "POST", "/v1/rounds/1/start")
                    assert code == 409, body
                with lock:
                    answered[0] += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert answered[0] == 64 * 25
    assert stable(status(d.sock)) == snap


def test_memory_stays_bounded(abuse):
    """Runs after the others in this module: all that abuse grew the daemon by little."""
    d, snap, rss0 = abuse
    rss1 = rss_kib(d.proc.pid)
    print(f"\ndaemon RSS {rss0 / 1024:.1f} MiB before the abuse, {rss1 / 1024:.1f} MiB after")
    assert rss1 - rss0 < 40 * 1024, (rss0, rss1)
    assert d.proc.poll() is None
    assert stable(status(d.sock)) == snap
