"""The control socket against a real daemon: who may connect, and what bad input gets back.

The daemon is `python -m vime.supervisor` as a child process (harness/local_daemon.Daemon) with
attached engines whose url nobody listens on, so no vLLM boots: they go EXITED after
first_wait and stay there, which keeps `status` still between requests. Clients here are raw
(http.client or a plain AF_UNIX socket), never the project's own client.

A rejected request must change nothing: every bad-input test compares `status` (less its
clock-driven fields) before and after.
"""

from __future__ import annotations

import errno
import grp
import gzip
import http.client
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vime.harness.local_daemon import Daemon, free_port, write_config

from support.daemons import start_answering, stop_removing_run_dir

NOBODY = 65534
ENGINES = ("e0", "e1")
FIRST_WAIT = 5.0


# -- raw clients ------------------------------------------------------------------------------


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 10.0):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self.unix_path)
        self.sock = s


def call(sock: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
         *, stream: bool = False) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection. stream=True reads only the status and headers."""
    conn = UnixHTTPConnection(sock)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = b"" if stream else resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


def raw_exchange(sock: str, data: bytes, timeout: float = 10.0) -> bytes:
    """Send bytes as they are, read until the daemon closes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(sock)
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def status(sock: str) -> dict:
    code, headers, body = call(sock, "GET", "/v1/status")
    assert code == 200, body
    return json.loads(body)


VOLATILE_ENGINE = {"state_age", "uptime", "last_probe", "last_probe_latency", "probes", "probe_failures", "late_probes"}


def stable(s: dict) -> dict:
    """status without what moves with the clock alone."""
    out = {k: v for k, v in s.items() if k != "daemon"}
    out["daemon"] = {k: v for k, v in s["daemon"].items() if k != "uptime"}
    out["engines"] = [{k: v for k, v in e.items() if k not in VOLATILE_ENGINE} for e in s["engines"]]
    return out


def assert_json_error(code: int, headers: dict, body: bytes, *, want_status: int | None = None,
                      want_code: str | None = None, mentions: str | None = None) -> dict:
    if want_status is not None:
        assert code == want_status, (code, body)
    assert code >= 400, (code, body)
    assert headers.get("content-type", "").startswith("application/json"), (headers, body)
    doc = json.loads(body)
    assert set(doc) == {"error"}, doc
    err = doc["error"]
    assert isinstance(err, dict) and set(err) == {"code", "message"}, doc
    assert isinstance(err["code"], str) and err["code"], doc
    assert isinstance(err["message"], str) and err["message"], doc
    if want_code is not None:
        assert err["code"] == want_code, doc
    if mentions is not None:
        assert mentions in err["message"], doc
    return err


def non_json_lines(d: Daemon, since: int) -> list[str]:
    """Lines the daemon printed after index `since` of d.raw that are not one JSON object
    (its log is JSON, one object a line: a traceback there is a bug)."""
    bad = []
    for line in list(d.raw)[since:]:
        try:
            if isinstance(json.loads(line), dict):
                continue
        except ValueError:
            pass
        bad.append(line)
    return bad


# -- daemons ------------------------------------------------------------------------------------


def runtime_dir() -> str:
    """Under /tmp, traversable by everyone: only the socket's own mode then decides who gets in
    (pytest's tmp dirs are 0700, which would refuse another uid before the socket does)."""
    path = tempfile.mkdtemp(prefix="vime-ctl-", dir="/tmp")
    os.chmod(path, 0o755)
    return path


def start_daemon(root: Path, run: str, **supervisor) -> Daemon:
    root.mkdir(parents=True, exist_ok=True)
    cfg = write_config(
        root / "supervisor.toml",
        supervisor={"runtime_dir": run, "log_dir": str(root / "logs"), "stop_timeout": 2.0, **supervisor},
        health_check={"first_wait": FIRST_WAIT, "interval": 1.0, "timeout": 0.5},
        engines=[{"name": n, "url": f"http://127.0.0.1:{free_port()}"} for n in ENGINES],
    )
    return start_answering(cfg, status)


def stop_daemon(d: Daemon) -> None:
    stop_removing_run_dir(d, 20)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """The module's daemon; both attached engines already EXITED (nothing listens on their urls),
    so status does not move by itself during the tests."""
    d = start_daemon(tmp_path_factory.mktemp("ctl"), runtime_dir())
    try:
        deadline = time.monotonic() + FIRST_WAIT + 30
        while {e["state"] for e in status(d.sock)["engines"]} != {"EXITED"}:
            assert time.monotonic() < deadline, status(d.sock)
            time.sleep(0.2)
        yield d
    finally:
        stop_daemon(d)


@pytest.fixture(scope="module")
def known_state(daemon):
    """Round 5 started and ended, weights version 10 published: through the API."""
    for method, path, body in [("POST", "/v1/rounds/5/start", None), ("POST", "/v1/rounds/5/end", None),
                               ("POST", "/v1/weights", b'{"version": 10}')]:
        code, _, data = call(daemon.sock, method, path, body, {"Content-Type": "application/json"})
        assert code == 200, (path, data)
    s = status(daemon.sock)
    assert (s["round"], s["round_open"], s["weight_version"]) == (5, False, 10)
    return daemon


# -- 1. the socket file -------------------------------------------------------------------------


def test_socket_is_0660_under_runtime_dir(daemon):
    st_ = os.stat(daemon.sock)
    assert stat.S_ISSOCK(st_.st_mode)
    assert stat.S_IMODE(st_.st_mode) == 0o660, oct(stat.S_IMODE(st_.st_mode))
    assert st_.st_uid == os.getuid()
    assert os.path.dirname(os.path.realpath(daemon.sock)) == os.path.realpath(daemon.run_dir)
    listening = [e for e in daemon.events if e.get("event") == "control.listening"]
    assert listening and listening[0]["socket"] == daemon.sock


# -- 2. peers: SO_PEERCRED, socket group ----------------------------------------------------------

# Runs as another uid: stdlib only, so any Python 3 that uid can execute will do.
CLIENT = r"""
import json, socket, sys
path, method, target = sys.argv[1], sys.argv[2], sys.argv[3]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(path)
except OSError as e:
    print("RESULT " + json.dumps({"errno": e.errno, "error": str(e)}))
    sys.exit(0)
s.sendall(("%s %s HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
           % (method, target)).encode())
out = b""
while True:
    chunk = s.recv(65536)
    if not chunk:
        break
    out += chunk
head, _, body = out.partition(b"\r\n\r\n")
lines = head.decode("latin-1").split("\r\n")
headers = dict(l.split(": ", 1) for l in lines[1:] if ": " in l)
print("RESULT " + json.dumps({"status": int(lines[0].split()[1]),
                               "content_type": {k.lower(): v for k, v in headers.items()}.get("content-type", ""),
                               "body": body.decode("utf-8", "replace")}))
"""


def run_client(sock: str, method: str = "GET", target: str = "/v1/status", *, uid: int | None = NOBODY) -> dict:
    """The raw client above, as `uid` (None: as ourselves). The venv's interpreter may sit
    where that uid cannot reach (/root is 0700), so the system Python is the fallback."""
    kwargs = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    tried = []
    for exe in dict.fromkeys([sys.executable, "/usr/bin/python3", shutil.which("python3") or ""]):
        if not exe:
            continue
        try:
            p = subprocess.run([exe, "-c", CLIENT, sock, method, target], capture_output=True, text=True,
                               timeout=60, cwd="/", **kwargs)
        except PermissionError as e:
            tried.append(f"{exe}: {e}")
            continue
        for line in p.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        tried.append(f"{exe}: rc={p.returncode} {p.stderr[-500:]}")
    pytest.fail(f"no Python runs as uid {uid}: {tried}")


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="running a client as uid 65534 needs root")


def nobody_group() -> str:
    try:
        return grp.getgrgid(NOBODY).gr_name  # "nogroup" on Debian, "nobody" elsewhere
    except KeyError:
        return str(NOBODY)


@needs_root
def test_other_uid_cannot_even_connect_without_socket_group(daemon):
    # The directory lets everyone through, so it is the socket's 0660 root:root that refuses.
    assert stat.S_IMODE(os.stat(daemon.run_dir).st_mode) == 0o755
    assert os.stat(daemon.sock).st_gid != NOBODY
    assert run_client(daemon.sock, uid=None)["status"] == 200  # the client itself works
    res = run_client(daemon.sock)
    assert res.get("errno") == errno.EACCES, res


@pytest.fixture(scope="module")
def group_daemons(tmp_path_factory):
    """Two daemons whose sockets belong to nobody's group: one refuses uid 65534 by SO_PEERCRED,
    one allows it in supervisor.allowed_uids."""
    base = tmp_path_factory.mktemp("peers")
    refusing = allowing = None
    try:
        refusing = start_daemon(base / "refusing", runtime_dir(), socket_group=nobody_group())
        allowing = start_daemon(base / "allowing", runtime_dir(), socket_group=str(NOBODY), allowed_uids=[NOBODY])
        yield refusing, allowing
    finally:
        for d in (refusing, allowing):
            if d is not None:
                stop_daemon(d)


@needs_root
def test_peer_uid_refused_with_403_and_logged(group_daemons):
    d, _ = group_daemons
    st_ = os.stat(d.sock)
    assert st_.st_gid == NOBODY and stat.S_IMODE(st_.st_mode) == 0o660
    mark = d.mark()

    res = run_client(d.sock, "GET", "/v1/status")
    assert "errno" not in res, res  # it got through the file permissions...
    assert res["status"] == 403, res  # ...and was refused by uid
    assert res["content_type"].startswith("application/json"), res
    err = json.loads(res["body"])["error"]
    assert err["code"] == "forbidden"
    assert "allowed_uids" in err["message"] and str(NOBODY) in err["message"]
    ev = d.wait_for(lambda e: e.get("event") == "control.refused", 10, after=mark)
    assert ev["uid"] == NOBODY and ev["path"] == "/v1/status"

    # A refused mutation changes nothing, and the refusal comes before any parsing.
    epoch = status(d.sock)["epoch"]  # its engines never serve: it stays the daemon's first
    for method, target in [("POST", "/v1/rounds/1/start"), ("POST", "/v1/weights"), ("GET", "/v1/nope")]:
        res = run_client(d.sock, method, target)
        assert res["status"] == 403, (target, res)
        assert "allowed_uids" in json.loads(res["body"])["error"]["message"]
    # (its engines may still be on their way to EXITED: compare the fleet's own fields only)
    after = status(d.sock)
    assert (after["round"], after["round_open"], after["weight_version"], after["epoch"]) == (None, False, None, epoch)
    # The daemon's log is read by another thread: wait for the last refusal to arrive.
    d.wait_for(lambda e: e.get("event") == "control.refused" and e.get("path") == "/v1/nope", 10, after=mark)
    refused = [e for e in d.events[mark:] if e.get("event") == "control.refused"]
    assert len(refused) == 4 and {e["uid"] for e in refused} == {NOBODY}


@needs_root
def test_allowed_uid_gets_in(group_daemons):
    _, d = group_daemons
    assert os.stat(d.sock).st_gid == NOBODY
    listening = [e for e in d.events if e.get("event") == "control.listening"]
    assert NOBODY in listening[0]["allowed_uids"]
    res = run_client(d.sock, "GET", "/v1/status")
    assert res.get("status") == 200, res
    body = json.loads(res["body"])
    assert [e["name"] for e in body["engines"]] == list(ENGINES)
    assert not [e for e in d.events if e.get("event") == "control.refused"]


# -- 3. bad input ---------------------------------------------------------------------------------

JSON = {"Content-Type": "application/json"}
NESTED = b"[" * 5000 + b"]" * 5000
HUGE_INT = b'{"version": 1' + b"0" * 5000 + b"}"

BAD = [
    # (id, method, path, body, headers, status, code, mentions)
    ("malformed-json", "POST", "/v1/weights", b'{"version": 11', JSON, 400, "bad_json", None),
    ("not-utf8", "POST", "/v1/weights", b"\xff\xfe{}", JSON, 400, "bad_json", None),
    ("nested-too-deep", "POST", "/v1/weights", NESTED, JSON, 400, "bad_json", None),
    ("huge-int-literal", "POST", "/v1/weights", HUGE_INT, JSON, 400, "bad_json", None),
    ("json-array", "POST", "/v1/weights", b'[{"version": 11}]', JSON, 400, "bad_request", "JSON object"),
    ("json-string", "POST", "/v1/weights", b'"11"', JSON, 400, "bad_request", "JSON object"),
    ("json-number", "POST", "/v1/rounds/6/start", b"6", JSON, 400, "bad_request", "JSON object"),
    ("version-str", "POST", "/v1/weights", b'{"version": "x"}', JSON, 400, "bad_request", "'version'"),
    ("version-digits-str", "POST", "/v1/weights", b'{"version": "11"}', JSON, 400, "bad_request", "'version'"),
    ("version-true", "POST", "/v1/weights", b'{"version": true}', JSON, 400, "bad_request", "'version'"),
    ("version-float", "POST", "/v1/weights", b'{"version": 11.5}', JSON, 400, "bad_request", "'version'"),
    ("version-null", "POST", "/v1/weights", b'{"version": null}', JSON, 400, "bad_request", "'version'"),
    ("version-list", "POST", "/v1/weights", b'{"version": [11]}', JSON, 400, "bad_request", "'version'"),
    ("version-negative", "POST", "/v1/weights", b'{"version": -1}', JSON, 400, "bad_request", "-1"),
    ("checkpoint-int", "POST", "/v1/weights", b'{"version": 11, "checkpoint": 5}', JSON, 400, "bad_request",
     "'checkpoint'"),
    ("checkpoint-missing-dir", "POST", "/v1/weights", b'{"version": 11, "checkpoint": "/nonexistent/ckpt"}', JSON,
     400, "bad_request", "/nonexistent/ckpt"),
    ("checkpoint-relative", "POST", "/v1/weights", b'{"version": 11, "checkpoint": "ckpt"}', JSON, 400,
     "bad_request", "absolute"),
    ("unknown-field", "POST", "/v1/weights", b'{"version": 11, "force": true}', JSON, 400, "bad_request", "'force'"),
    ("unknown-field-round", "POST", "/v1/rounds/6/start", b'{"n": 6}', JSON, 400, "bad_request", "'n'"),
    ("missing-version", "POST", "/v1/weights", b"{}", JSON, 400, "bad_request", "'version'"),
    ("missing-version-empty-body", "POST", "/v1/weights", None, {}, 400, "bad_request", "'version'"),
    ("missing-version-checkpoint-only", "POST", "/v1/weights", b'{"checkpoint": null}', JSON, 400, "bad_request",
     "'version'"),
    ("stale-version", "POST", "/v1/weights", b'{"version": 9}', JSON, 409, "conflict", "stale"),
    ("bad-content-encoding", "POST", "/v1/weights", b'{"version": 11}', {**JSON, "Content-Encoding": "gzip"}, 400,
     None, None),
    ("failures-detail-int", "POST", "/v1/engines/e0/failures", b'{"detail": 5}', JSON, 400, "bad_request",
     "'detail'"),
    ("unknown-engine-action", "POST", "/v1/engines/nope/restart", None, {}, 404, "unknown_engine", "e0, e1"),
    ("unknown-engine-retire", "POST", "/v1/engines/nope/retire", None, {}, 404, "unknown_engine", "'nope'"),
    ("unknown-engine-log", "GET", "/v1/engines/nope/log", None, {}, 404, "unknown_engine", "'nope'"),
    ("unknown-action", "POST", "/v1/engines/e0/explode", None, {}, 404, "unknown_action", "'explode'"),
    ("attached-restart", "POST", "/v1/engines/e0/restart", None, {}, 409, "conflict", "attached"),
    ("attached-stop", "POST", "/v1/engines/e1/stop", None, {}, 409, "conflict", "attached"),
    ("retire-with-body", "POST", "/v1/engines/e0/retire", b'{"now": true}', JSON, 400, "bad_request", "'now'"),
    ("log-bytes-not-int", "GET", "/v1/engines/e0/log?bytes=lots", None, {}, 400, "bad_request", "bytes"),
    ("log-bytes-negative", "GET", "/v1/engines/e0/log?bytes=-5", None, {}, 400, "bad_request", ">= 0"),
    ("events-two-roles", "GET", "/v1/events?role=agent&role=observer", None, {}, 400, "bad_request", "'agent' and 'observer'"),
    ("events-bad-role", "GET", "/v1/events?role=bogus", None, {}, 400, "bad_request", "'bogus'"),
    ("unknown-route", "GET", "/v1/nothing", None, {}, 404, "not_found", "/v1/nothing"),
    ("unknown-version", "GET", "/v2/status", None, {}, 404, "not_found", None),
    ("root", "GET", "/", None, {}, 404, "not_found", None),
    ("trailing-slash", "GET", "/v1/status/", None, {}, 404, "not_found", None),
    ("empty-round", "POST", "/v1/rounds//start", None, {}, 404, "not_found", None),
    ("round-bad-verb", "POST", "/v1/rounds/6/finish", None, {}, 404, "not_found", None),
    ("delete-status", "DELETE", "/v1/status", None, {}, 405, "method_not_allowed", "DELETE"),
    ("post-status", "POST", "/v1/status", b"{}", JSON, 405, "method_not_allowed", None),
    ("put-weights", "PUT", "/v1/weights", b'{"version": 11}', JSON, 405, "method_not_allowed", "PUT"),
    ("get-weights", "GET", "/v1/weights", None, {}, 405, "method_not_allowed", None),
    ("patch-round", "PATCH", "/v1/rounds/6/start", None, {}, 405, "method_not_allowed", None),
    ("get-round-start", "GET", "/v1/rounds/6/start", None, {}, 405, "method_not_allowed", None),
    ("oversized-weights", "POST", "/v1/weights", b'{"version": 11, "checkpoint": "' + b"a" * 70000 + b'"}', JSON,
     413, None, "65536"),
    ("oversized-round", "POST", "/v1/rounds/6/start", b" " * (64 * 1024 + 1), JSON, 413, None, None),
    ("round-word", "POST", "/v1/rounds/six/start", None, {}, 400, "bad_request", "'six'"),
    ("round-negative", "POST", "/v1/rounds/-6/start", None, {}, 400, "bad_request", "'-6'"),
    ("round-float", "POST", "/v1/rounds/6.0/start", None, {}, 400, "bad_request", None),
    ("round-hex", "POST", "/v1/rounds/0x6/end", None, {}, 400, "bad_request", None),
    ("round-space", "POST", "/v1/rounds/%206/start", None, {}, 400, "bad_request", None),
    ("round-plus", "POST", "/v1/rounds/+6/start", None, {}, 400, "bad_request", None),
    # str.isdigit() is true for these, int() refuses the first and reads the second as 3.
    ("round-superscript", "POST", "/v1/rounds/%C2%B2/start", None, {}, 400, "bad_request", None),
    ("round-arabic-digit", "POST", "/v1/rounds/%D9%A3/end", None, {}, 400, "bad_request", None),
    ("round-fullwidth", "POST", "/v1/rounds/%EF%BC%97/start", None, {}, 400, "bad_request", None),
    ("round-19-digits", "POST", "/v1/rounds/1000000000000000000/start", None, {}, 400, "bad_request", None),
    ("round-huge", "POST", "/v1/rounds/" + "9" * 400 + "/start", None, {}, 400, "bad_request", None),
    ("round-huge-end", "POST", "/v1/rounds/99999999999999999999/end", None, {}, 400, "bad_request", None),
    ("stale-round", "POST", "/v1/rounds/3/start", None, {}, 409, "conflict", "stale"),
    ("rerun-round", "POST", "/v1/rounds/5/start", None, {}, 409, "conflict", "stale"),
    ("stale-round-padded", "POST", "/v1/rounds/0004/start", None, {}, 409, "conflict", None),
    ("end-not-open", "POST", "/v1/rounds/4/end", None, {}, 409, "conflict", "not open"),
    ("end-future", "POST", "/v1/rounds/7/end", None, {}, 409, "conflict", "not open"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_request_is_refused_and_changes_nothing(known_state, case):
    d = known_state
    _, method, path, body, headers, want_status, want_code, mentions = case
    if headers.get("Content-Encoding") == "gzip":
        body = b"not gzip: " + (body or b"")
    before = stable(status(d.sock))
    code, hdrs, data = call(d.sock, method, path, body, headers)
    assert_json_error(code, hdrs, data, want_status=want_status, want_code=want_code, mentions=mentions)
    assert stable(status(d.sock)) == before
    assert d.proc.poll() is None


def test_gzip_body_is_read(known_state):
    """The control for bad-content-encoding: a well-formed gzip body gets past the reader and is
    judged on its content (here a wrong type, so nothing changes)."""
    d = known_state
    before = stable(status(d.sock))
    code, hdrs, data = call(d.sock, "POST", "/v1/weights", gzip.compress(b'{"version": "11"}'),
                            {**JSON, "Content-Encoding": "gzip"})
    assert_json_error(code, hdrs, data, want_status=400, mentions="'version'")
    assert stable(status(d.sock)) == before


def test_round_conflicts_while_a_round_is_open(known_state):
    d = known_state
    r = status(d.sock)["round"]
    assert r is not None and r >= 5
    nxt = r + 1
    code, _, data = call(d.sock, "POST", f"/v1/rounds/{nxt}/start")
    assert code == 200 and json.loads(data)["changed"] is True, data
    opened = stable(status(d.sock))
    assert (opened["round"], opened["round_open"]) == (nxt, True)

    for path, mentions in [(f"/v1/rounds/{nxt + 1}/end", f"round {nxt} is open"),  # out of order
                           (f"/v1/rounds/{r}/end", f"round {nxt} is open"),
                           (f"/v1/rounds/{nxt + 1}/start", "still open"),
                           (f"/v1/rounds/{r}/start", "still open")]:
        code, hdrs, data = call(d.sock, "POST", path)
        assert_json_error(code, hdrs, data, want_status=409, want_code="conflict", mentions=mentions)
        assert stable(status(d.sock)) == opened, path

    # Repeating the open round's start is idempotent: 200, nothing changes.
    code, _, data = call(d.sock, "POST", f"/v1/rounds/{nxt}/start")
    assert code == 200 and json.loads(data)["changed"] is False
    assert stable(status(d.sock)) == opened

    code, _, data = call(d.sock, "POST", f"/v1/rounds/{nxt}/end")
    assert code == 200 and json.loads(data)["changed"] is True
    closed = stable(status(d.sock))
    assert (closed["round"], closed["round_open"]) == (nxt, False)
    code, hdrs, data = call(d.sock, "POST", f"/v1/rounds/{nxt}/start")  # a round never runs twice
    assert_json_error(code, hdrs, data, want_status=409, mentions="stale")
    assert stable(status(d.sock)) == closed


def test_client_gone_mid_request(known_state):
    """Headers promise 1000 bytes, 10 arrive, the client closes: nothing changes, no traceback
    in the log, the next request is answered."""
    d = known_state
    before = stable(status(d.sock))
    r = before["round"]
    raw_mark, ev_mark = len(d.raw), d.mark()
    for method, path, partial in [("POST", "/v1/weights", b'{"version"'),
                                  ("POST", f"/v1/rounds/{r + 1}/start", b'{         '),
                                  ("POST", "/v1/engines/e0/retire", b'{         '),
                                  ("GET", "/v1/status", b"0123456789")]:
        assert len(partial) == 10
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(d.sock)
            s.sendall(f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      f"Content-Length: 1000\r\n\r\n".encode() + partial)
            time.sleep(0.2)  # let the handler start waiting for the rest
    time.sleep(0.5)
    assert d.proc.poll() is None
    assert stable(status(d.sock)) == before
    code, _, _ = call(d.sock, "GET", "/v1/routable")
    assert code == 200
    assert not [e for e in d.events[ev_mark:] if e.get("event") == "control.handler_failed"]
    assert non_json_lines(d, raw_mark) == []


@pytest.mark.parametrize("data", [
    b"GET nope HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /v1/status HTTP/1.1\r\nHost: x\r\nContent-Length: lots\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)),  # a TLS hello
    b"GET /v1/\xc3\xa9 HTTP/1.1\r\nHost: x\r\n\r\n",
], ids=["relative-target", "bad-content-length", "tls-hello", "raw-utf8-target"])
def test_not_http_at_all(known_state, data):
    """Bytes that are not HTTP never reach the routes: aiohttp's parser answers 400 itself (its
    body is plain text, not our JSON; the app has no hook there). The daemon lives on."""
    d = known_state
    before = stable(status(d.sock))
    out = raw_exchange(d.sock, data)
    assert out.split(b"\r\n", 1)[0].split()[1] == b"400", out[:200]
    assert d.proc.poll() is None
    assert stable(status(d.sock)) == before


@pytest.mark.parametrize("method,path,encoding,body", [
    ("GET", "/v1/rounds/6/start", "deflate", b"\x00"),
    ("GET", "/v1/status", "deflate", b"\x00\x01\x02"),
    ("POST", "/v1/weights", "deflate", b"\x00"),
    ("POST", "/v1/weights", "deflate", b"xyz"),
    ("POST", "/v1/weights", "gzip", b"\x1f\x8b\x00garbage"),
    ("POST", "/v1/weights", "gzip", b'not gzip: {"version": 11}'),
])
def test_undecodable_body(known_state, method, path, encoding, body):
    """A body that does not decode per its Content-Encoding is a 400: from our handler (JSON) when
    it reads the body, or from aiohttp's parser (plain text) when the parser trips first. Never a
    500, nothing changes. Headers and body go in one write: see the report on split writes."""
    d = known_state
    before = stable(status(d.sock))
    out = raw_exchange(d.sock, f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                               f"Content-Type: application/json\r\nContent-Encoding: {encoding}\r\n"
                               f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    head, _, data = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].split()[1] == "400", out[:300]
    hdrs = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if ": " in line)}
    if hdrs.get("content-type", "").startswith("application/json"):
        assert_json_error(400, hdrs, data)
    assert d.proc.poll() is None
    assert stable(status(d.sock)) == before


# -- 4. fuzz ------------------------------------------------------------------------------------

WORDS = ["v1", "v2", "status", "routable", "rounds", "start", "end", "weights", "engines", "log", "events",
         "metrics", "e0", "e1", "nope", "restart", "stop", "retire", "failures", "sync", "begin", "0", "5", "10"]
FIELDS = ["version", "checkpoint", "detail", "ok", "error", "n", "round"]
MUTATING_ENGINE_ACTIONS = {"retire", "sync"}

segment = st.one_of(
    st.sampled_from(WORDS),
    st.integers(-10, 10**25).map(str),
    st.text(min_size=0, max_size=12).filter(lambda s: "/" not in s and s not in (".", "..")),
)
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 10), st.floats(allow_nan=True),
                      st.text(max_size=20))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
body_strategy = st.one_of(
    st.none(),
    st.binary(max_size=300),
    json_value.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(FIELDS), json_value, max_size=3).map(lambda v: json.dumps(v).encode()),
    st.text(max_size=100).map(str.encode),
    st.sampled_from([NESTED, b" " * (64 * 1024 + 10), b'{"version": 1e400}', b"NaN", b'{"version": 10}',
                     b'{"version": 10, "checkpoint": "/tmp"}', b'{"detail": "x"}']),
)
headers_strategy = st.sampled_from([{}, JSON, {"Content-Type": "text/plain"}, {**JSON, "Content-Encoding": "gzip"},
                                    {"Content-Encoding": "deflate"}])
# The fuzz encodes a body it sends with Content-Encoding properly: a body that does not decode
# is refused by aiohttp's parser before any route runs (test_undecodable_body).
ENCODE = {"gzip": gzip.compress, "deflate": zlib.compress}


def mostly(values: list[str]) -> st.SearchStrategy[str]:
    """One of `values` two times in three, else any segment."""
    return st.one_of(st.sampled_from(values), st.sampled_from(values), segment)


@st.composite
def requests(draw):
    """(method, decoded path segments, request target, body, headers). Mostly aimed at real
    routes, so that the body and path validation is what gets exercised, not only the router."""
    method = draw(st.sampled_from(["POST"] * 5 + ["GET", "PUT", "DELETE", "PATCH"]))
    kind = draw(st.sampled_from(["weights", "weights", "round", "round", "engine", "engine", "sync", "top",
                                 "random"]))
    if kind == "weights":
        segs = ["v1", "weights"]
    elif kind == "round":
        segs = ["v1", "rounds", draw(st.one_of(st.integers(0, 6).map(str), segment)), draw(mostly(["start", "end"]))]
    elif kind == "engine":
        segs = ["v1", "engines", draw(mostly(["e0", "e1", "nope"])),
                draw(mostly(["restart", "stop", "start", "retire", "failures", "log"]))]
    elif kind == "sync":
        segs = ["v1", "engines", draw(mostly(["e0", "nope"])), "sync", draw(mostly(["begin", "end"]))]
    elif kind == "top":
        segs = ["v1", draw(mostly(["status", "routable", "weights", "events", "metrics"]))]
    else:
        segs = draw(st.lists(segment, max_size=6))
    path = "/" + "/".join(quote(s, safe="") for s in segs)
    if draw(st.booleans()):
        path += "?" + quote(draw(st.sampled_from(["bytes=", "role=", ""])) + draw(st.text(max_size=10)), safe="=&")
    if kind in ("round", "engine", "sync"):  # routes that take no body or a small one: mostly none
        body = draw(st.one_of(st.none(), st.just(b"{}"), body_strategy))
    else:
        body = draw(body_strategy)
    headers = draw(headers_strategy)
    if body is not None and "Content-Encoding" in headers:
        body = ENCODE[headers["Content-Encoding"]](body)
    return method, segs, path, body, headers


def would_mutate(method: str, segs: list[str], body: bytes | None, round_: int, version: int) -> bool:
    """A request the daemon should accept and act on: kept out of the fuzz, which checks that
    nothing it sends changes the daemon."""
    if method != "POST":
        return False
    if len(segs) == 4 and segs[:2] == ["v1", "rounds"] and segs[3] == "start":
        n = segs[2]
        return n.isascii() and n.isdigit() and len(n) <= 18 and int(n) > round_
    if segs == ["v1", "weights"]:
        try:
            doc = json.loads(body or b"{}")  # (an encoded body never parses: it is kept)
        except (ValueError, RecursionError):
            return False
        v = doc.get("version") if isinstance(doc, dict) else None
        return isinstance(v, int) and not isinstance(v, bool) and v > version
    if len(segs) >= 4 and segs[:2] == ["v1", "engines"] and segs[2] in ENGINES:
        return segs[3] in MUTATING_ENGINE_ACTIONS
    return False


def send_generated(d, req, snap: dict) -> tuple[int, dict[str, str], bytes] | None:
    """One generated request, unless it would change the daemon (None): its answer is < 500,
    and a refusal is our JSON error."""
    method, segs, path, body, headers = req
    if would_mutate(method, segs, body, snap["round"], snap["weight_version"]):
        return None
    is_events = method == "GET" and segs == ["v1", "events"]  # a stream: read its head only
    code, hdrs, data = call(d.sock, method, path, body, headers, stream=is_events)
    assert code < 500, (code, data[:500])
    if code >= 400 and is_events:  # only the head was read
        assert hdrs.get("content-type", "").startswith("application/json"), (code, hdrs)
    elif code >= 400:
        assert_json_error(code, hdrs, data)
    return code, hdrs, data


def test_fuzz_never_500_never_changes_state(known_state):
    """A few hundred generated requests: every answer is < 500, every refusal is our JSON error,
    the daemon stays up, and (no request here should succeed in changing anything) status stays
    what it was, after each request and at the end."""
    d = known_state
    snap = stable(status(d.sock))
    assert snap["round"] >= 5 and snap["round_open"] is False and snap["weight_version"] == 10
    assert {e["state"] for e in snap["engines"]} == {"EXITED"}
    raw_mark, ev_mark = len(d.raw), d.mark()
    seen: dict[int, int] = {}

    @settings(max_examples=300, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(req=requests())
    def one(req):
        if (answer := send_generated(d, req, snap)) is None:
            return
        code, hdrs, data = answer
        seen[code] = seen.get(code, 0) + 1
        if code < 400 and hdrs.get("content-type", "").startswith("application/json"):
            json.loads(data)
        assert d.proc.poll() is None, "\n".join(d.raw[-30:])
        assert stable(status(d.sock)) == snap

    one()

    assert sum(seen.values()) >= 200, seen  # the fuzz reached the daemon, not only the filter
    assert len([c for c in seen if c >= 400]) >= 4, seen  # several kinds of refusal
    assert d.proc.poll() is None
    assert stable(status(d.sock)) == snap
    assert not [e for e in d.events[ev_mark:] if e.get("event") == "control.handler_failed"]
    assert non_json_lines(d, raw_mark) == []
