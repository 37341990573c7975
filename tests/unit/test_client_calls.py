"""The client's table of calls (vime.supervisor.client.calls) against the daemon's routes and the
two transports, without a daemon: every verb is in both clients, each Call resolves to a route
that control.py registers, each verb is written once, and both transports send what the table
says (checked against a stand-in HTTP server on a Unix socket)."""

from __future__ import annotations

import ast
import asyncio
import http.server
import inspect
import json
import socketserver
import threading
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request

from vime.supervisor import protocol
from vime.supervisor.client import (
    AsyncSupervisorClient,
    BadRequest,
    ConflictError,
    Forbidden,
    LogTail,
    SupervisorClient,
    SupervisorError,
    UnknownEngine,
    error_from_response,
)
from vime.supervisor.client.calls import VERBS, Call, Verb, Verbs, event_stream
from vime.supervisor.control import ControlServer

ROOT = Path(__file__).resolve().parents[2]
CLIENT_DIR = ROOT / "supervisor" / "client"

# Arguments for building each verb's Call; a verb missing here fails test_every_verb_has_sample_args.
SAMPLE_ARGS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "status": ((), {}),
    "routable_engines": ((), {}),
    "start_round": ((7,), {}),
    "end_round": ((7,), {}),
    "publish_weights": ((8, "ckpt/step-8"), {}),
    "restart": (("engine/0 x",), {}),
    "stop": (("engine-0",), {}),
    "start": (("engine-0",), {}),
    "retire": (("engine-0",), {}),
    "signal": (("engine-0", "HUP"), {}),
    "report_failure": (("engine-0", "timed out"), {"poisoned": True, "incarnation": 3}),
    "sync_begin": (("engine-0", 8), {}),
    "sync_end": (("engine-0", 8, False, "push failed"), {}),
    "push_begin": ((8, ["engine-0", "engine/1"], 1024, 30.0), {}),
    "push_end": (("a1b2c3-1", False, {"engine-0": "timed out"}), {}),
    "pushes": ((), {}),
    "engine_log": (("engine-0", 512), {}),
    "daemon_log": ((512,), {}),
    "metrics": ((), {}),
    "incidents": ((), {}),
}
# Verbs a dropped connection must not repeat (a repeat restarts twice or counts twice).
NOT_IDEMPOTENT = {"restart", "signal", "report_failure", "sync_begin", "sync_end", "push_begin", "push_end"}
# What each transport has beyond the table: a block, a stream, and ending the streams.
BLOCKING_EXTRA = {"round", "events", "close"}
ASYNC_EXTRA = {"round", "events", "aclose"}


def build(verb: str) -> Call[Any]:
    args, kwargs = SAMPLE_ARGS[verb]
    return VERBS[verb](*args, **kwargs)


def public(client: Any) -> set[str]:
    return {n for n in dir(client) if not n.startswith("_") and callable(getattr(client, n))}


# -- the table and the transports ----------------------------------------------------------


def test_the_table_has_the_verbs_users_call():
    assert set(VERBS) == set(SAMPLE_ARGS)


def test_every_verb_has_sample_args():
    for name in VERBS:
        assert name in SAMPLE_ARGS, f"add {name} to SAMPLE_ARGS"


def test_both_clients_have_every_verb_and_the_same_names():
    for cls in (SupervisorClient, AsyncSupervisorClient):
        assert issubclass(cls, Verbs)
        for name in VERBS:
            assert isinstance(inspect.getattr_static(cls, name), Verb), f"{cls.__name__}.{name} is not the table's"
    assert public(SupervisorClient("/nonexistent")) == set(VERBS) | BLOCKING_EXTRA
    assert public(AsyncSupervisorClient("/nonexistent")) == set(VERBS) | ASYNC_EXTRA


def test_verbs_keep_their_signatures_and_docs():
    sync, aio = SupervisorClient("/nonexistent"), AsyncSupervisorClient("/nonexistent")
    for name, builder in VERBS.items():
        expected = list(inspect.signature(builder).parameters)
        for client in (sync, aio):
            method = getattr(client, name)
            assert list(inspect.signature(method).parameters) == expected, name
            assert method.__doc__ and method.__doc__ == builder.__doc__, name
            assert "Call[" not in str(inspect.signature(method).return_annotation), name
        assert not inspect.iscoroutinefunction(getattr(sync, name)), name
        assert inspect.iscoroutinefunction(getattr(aio, name)), name


def test_idempotent_flags():
    for name in VERBS:
        assert build(name).idempotent is (name not in NOT_IDEMPOTENT), name
    assert event_stream().idempotent


def test_reads_are_gets_without_body_and_changes_are_posts():
    for name in VERBS:
        call = build(name)
        assert call.method in ("GET", "POST"), name
        if call.method == "GET":
            assert call.body is None, name


def test_bodies():
    assert build("start_round").body is None
    body = build("publish_weights").body
    assert body["version"] == 8 and Path(body["checkpoint"]).is_absolute()
    assert body["checkpoint"].endswith("/ckpt/step-8")
    assert VERBS["publish_weights"](8).body == {"version": 8}
    assert build("report_failure").body == {"detail": "timed out", "poisoned": True, "incarnation": 3}
    assert VERBS["report_failure"]("e", "x").body == {"detail": "x"}
    assert build("sync_begin").body == {"version": 8}
    assert build("sync_end").body == {"version": 8, "ok": False, "error": "push failed"}
    assert build("signal").body == {"signal": "HUP"} and VERBS["signal"]("e", 15).body == {"signal": 15}


def test_event_stream_roles():
    assert event_stream().path == protocol.EVENTS_PATH
    assert event_stream("agent").path == f"{protocol.EVENTS_PATH}?role=agent"
    with pytest.raises(ValueError, match="role must be"):
        event_stream("boss")


# -- every Call is a route the daemon registers -----------------------------------------------


@pytest.fixture(scope="module")
def app():
    # ControlServer builds its aiohttp app and routes in __init__; nothing is started.
    return ControlServer(None, None, "/nonexistent/supervisor.sock").app  # type: ignore[arg-type]


def resolve(app, method: str, path: str):
    match = asyncio.run(app.router.resolve(make_mocked_request(method, path, app=app)))
    assert match.http_exception is None, f"{method} {path}: {match.http_exception!r}"
    return match


def test_the_daemon_registers_exactly_the_protocols_routes(app):
    registered = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    assert registered == set(protocol.ROUTES)


@pytest.mark.parametrize("verb", sorted(SAMPLE_ARGS))
def test_each_call_resolves_to_a_daemon_route(app, verb):
    call = build(verb)
    match = resolve(app, call.method, call.path)
    assert match.route.method == call.method
    assert (call.method, match.route.resource.canonical) in protocol.ROUTES
    args = SAMPLE_ARGS[verb][0]
    if "name" in match:  # per-engine routes: the name arrives whole, however it is spelled
        assert match["name"] == args[0]
    if "action" in match:
        assert match["action"] in {*protocol.ENGINE_ACTIONS, protocol.FAILURES}
        assert match["action"] == (protocol.FAILURES if verb == "report_failure" else verb)
    if "n" in match:
        assert match["n"] == str(args[0])


def test_each_route_is_called_by_some_verb(app):
    used = {(build(v).method, resolve(app, build(v).method, build(v).path).route.resource.canonical)
            for v in VERBS}
    call = event_stream("agent")
    used.add((call.method, resolve(app, call.method, call.path).route.resource.canonical))
    assert used == set(protocol.ROUTES)


def test_a_wrong_path_does_not_resolve(app):
    # The check above can fail: a path the daemon does not serve is refused by the router.
    match = asyncio.run(app.router.resolve(make_mocked_request("GET", "/v1/nothing", app=app)))
    assert match.http_exception is not None


# -- each verb is written once ------------------------------------------------------------------


def _defs(path: Path) -> list[str]:
    return [n.name for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_verb_is_defined_twice_in_the_client_package():
    files = sorted(CLIENT_DIR.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "calls.py", "errors.py", "blocking.py", "aio.py"}
    for verb in VERBS:
        where = [f.name for f in files for name in _defs(f) if name == verb]
        assert where == ["calls.py"], f"{verb} is defined in {where}"
    for extra in ("round", "events"):  # one per transport, nowhere else
        assert sorted(f.name for f in files for name in _defs(f) if name == extra) == ["aio.py", "blocking.py"]


# -- decoding and errors -----------------------------------------------------------------------


def test_decoders():
    log = build("engine_log").decode(b"line\n", {"x-log-path": "/var/log/e0.log"})
    assert isinstance(log, LogTail) and log == "line\n" and log.path == "/var/log/e0.log"
    assert build("metrics").decode(b"vime_up 1\n", {}) == "vime_up 1\n"
    assert build("incidents").decode(b'{"incidents": [{"engine": "e0"}]}', {}) == [{"engine": "e0"}]
    assert build("status").decode(b'{"engines": []}', {}) == {"engines": []}
    with pytest.raises(SupervisorError) as e:
        build("status").decode(b"<html>", {})
    assert e.value.code == "bad_answer"


@pytest.mark.parametrize("status, code, cls", [
    (409, protocol.ErrorCode.CONFLICT, ConflictError),
    (409, protocol.ErrorCode.NO_LOG, ConflictError),
    (404, protocol.ErrorCode.UNKNOWN_ENGINE, UnknownEngine),
    (400, protocol.ErrorCode.BAD_JSON, BadRequest),
    (413, protocol.ErrorCode.REQUEST_ENTITY_TOO_LARGE, BadRequest),
    (403, protocol.ErrorCode.FORBIDDEN, Forbidden),
    (404, protocol.ErrorCode.NOT_FOUND, SupervisorError),
    (500, protocol.ErrorCode.INTERNAL, SupervisorError),
])
def test_error_from_response(status, code, cls):
    err = error_from_response(status, json.dumps({"error": {"code": code, "message": "do this"}}).encode())
    assert type(err) is cls
    assert (err.status, err.code, err.message) == (status, str(code), "do this")


# -- both transports send what the table says ------------------------------------------------------


class _Recorder(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str, Any]] = []

    def _answer(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        self.seen.append((self.command, self.path, json.loads(raw) if raw else None))
        # One answer for every verb: each decoder finds its key (incidents, push, pushes).
        body = b'{"incidents": [], "ok": true, "push": "a1b2c3-1", "pushes": []}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Log-Path", "/var/log/e0.log")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def address_string(self) -> str:  # a Unix socket has no (host, port)
        return "unix"

    def log_message(self, *args: Any) -> None:
        pass


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@pytest.fixture
def recorder(tmp_path):
    path = str(tmp_path / "s.sock")
    server = _UnixHTTPServer(path, _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Recorder.seen = []
    yield path
    server.shutdown()
    server.server_close()


def _expected(verb: str) -> tuple[str, str, Any]:
    call = build(verb)
    return call.method, call.path, call.body


def test_the_blocking_client_sends_the_tables_calls(recorder):
    client = SupervisorClient(recorder, connect_timeout=2)
    for verb, (args, kwargs) in SAMPLE_ARGS.items():
        getattr(client, verb)(*args, **kwargs)
    assert _Recorder.seen == [_expected(v) for v in SAMPLE_ARGS]


def test_the_asyncio_client_sends_the_tables_calls(recorder):
    client = AsyncSupervisorClient(recorder, connect_timeout=2)

    async def run() -> list[Any]:
        return [await getattr(client, verb)(*args, **kwargs) for verb, (args, kwargs) in SAMPLE_ARGS.items()]

    results = asyncio.run(run())
    assert _Recorder.seen == [_expected(v) for v in SAMPLE_ARGS]
    answers = dict(zip(SAMPLE_ARGS, results))
    assert answers["incidents"] == [] and answers["engine_log"].path == "/var/log/e0.log"
    assert answers["status"] == {"incidents": [], "ok": True, "push": "a1b2c3-1", "pushes": []}
    assert answers["push_begin"] == "a1b2c3-1" and answers["pushes"] == []


# -- the daemon's names are the protocol's ---------------------------------------------------


def _calls_named(path: Path, names: set[str]) -> list[ast.Call]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in names:
                out.append(node)
    return out


def test_every_event_the_daemon_emits_is_a_protocol_event():
    events = set(protocol.Event)
    seen = 0
    for path in sorted((ROOT / "supervisor").glob("*.py")):
        for call in _calls_named(path, {"emit"}):
            if call.args and isinstance(call.args[0], ast.Constant):
                seen += 1
                assert call.args[0].value in events, f"{path.name}:{call.lineno} emits {call.args[0].value!r}"
            elif call.args and isinstance(call.args[0], ast.Attribute) and isinstance(call.args[0].value, ast.Name) \
                    and call.args[0].value.id == "Event":
                seen += 1
                assert call.args[0].attr in protocol.Event.__members__, f"{path.name}:{call.lineno}"
    assert seen >= 10  # the scan found the daemon's emit() calls


def test_every_error_code_the_daemon_answers_is_a_protocol_code():
    path = ROOT / "supervisor" / "control.py"
    calls = _calls_named(path, {"_error", "ApiError"})
    assert len(calls) >= 10
    for call in calls:
        code = call.args[1] if len(call.args) > 1 else None
        if isinstance(code, ast.Constant):
            assert code.value in set(protocol.ErrorCode), f"control.py:{call.lineno} answers {code.value!r}"
        elif isinstance(code, ast.Attribute) and isinstance(code.value, ast.Name) and code.value.id == "ErrorCode":
            assert code.attr in protocol.ErrorCode.__members__, f"control.py:{call.lineno}"
