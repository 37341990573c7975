"""The control socket: HTTP/JSON over a Unix socket, for the trainer and for supervisorctl.

Every route is under /v1. Errors are JSON `{"error": {"code", "message"}}` with a 4xx that
says what to do; a rejected request changes nothing. Each connection's peer uid is checked
with SO_PEERCRED against our own uid and the configured allow-list.
"""

from __future__ import annotations

import asyncio
import grp
import json
import os
import re
import socket
import stat
import struct
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol

import structlog
from aiohttp import web

from .fleet import BadRequest, Conflict, Fleet, check_version
from .tasks import within
from .protocol import (
    API,
    DAEMON_LOG_PATH,
    ENGINE_ACTION_PATTERN,
    ENGINE_LOG_PATTERN,
    ENGINE_SIGNAL_PATTERN,
    ENGINE_SYNC_PATTERN,
    EVENTS_PATH,
    FAILURES,
    INCIDENTS_PATH,
    LOG_BYTES_PARAM,
    LOG_PATH_HEADER,
    METRICS_PATH,
    NDJSON,
    PUSH_END_PATTERN,
    PUSHES_PATH,
    ROLE_PARAM,
    ROUTABLE_PATH,
    ROUTES,
    SIGNAL_FIELD,
    STATUS_PATH,
    WEIGHTS_PATH,
    Action,
    ErrorCode,
    Event,
    Role,
    RoundPhase,
    SyncPhase,
    parse_signal,
)
from .engine import fingerprint as fingerprint_limits
from .engine.fingerprint import FingerprintError
from .engine.fingerprint import parse as parse_fingerprint
from .engine.process import read_tail
from .engine.runner import EngineRunner
from .router.link import RouterLink
from .status import fleet_status, routable_view

log = structlog.get_logger("vime.control")

MAX_BODY = 64 * 1024


def _too_large(request: web.Request, got: str = "") -> str:
    """The 413's message: the cap, and for a publish, what in it may be that large."""
    msg = f"request body over {MAX_BODY} bytes{got}"
    if request.path == WEIGHTS_PATH:
        msg += (f"; a fingerprint may hold at most {fingerprint_limits.MAX_PROMPTS} prompts of "
                f"{fingerprint_limits.MAX_PROMPT_TOKENS} token ids (about 40 KB as JSON at most): send fewer or "
                "shorter prompts (vime.trainer.fingerprint.make_fingerprint's default, 4 x 48, is about 5 KB)")
    return msg
# Event-stream readers: each holds a queue and socket buffers (a stalled one about 1.3 MB), so
# they are capped, with room kept for trainer agents; a write a reader does not take within
# STREAM_WRITE_TIMEOUT ends its stream.
MAX_STREAMS = 64
MAX_AGENT_STREAMS = 8
STREAM_QUEUE = 2000
STREAM_WRITE_TIMEOUT = 10.0
_CLOSE = object()  # ends an event stream
# Calls made while a reload execs wait in the listen backlog (one connection per caller).
BACKLOG = 1024
# How long a reload's stop waits for a connection it accepted to send its request.
ACCEPTED_GRACE = 0.5


class _StalledReader(Exception):
    pass


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _unread(conn: Any) -> bool:
    """An open connection none of whose requests aiohttp has read yet (its own counter; if a
    later aiohttp drops it, nothing is waited for)."""
    return conn.transport is not None and getattr(conn, "_request_count", 1) == 0


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


def peer_credentials(request: web.Request) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of the peer process, from SO_PEERCRED (as of its connect)."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


# Requests that change what the daemon does leave one line each, `control.<action>`, with
# who asked (SO_PEERCRED's uid and pid), what was asked, and how it was answered.
_AUDIT = "vime.audit"  # request key: the fields a handler adds to its audit line
_AUDIT_FROM_PATH = {"name": "engine", "n": "round", "id": "push"}  # route placeholder -> audit field


def _note(request: web.Request, **fields: Any) -> None:
    """What a handler adds to its request's audit line (nothing if the route is not audited)."""
    if _AUDIT in request:
        request[_AUDIT].update(fields)


def _error_code(resp: web.StreamResponse | None) -> str | None:
    body = getattr(resp, "body", None)
    if resp is None or resp.status < 400 or not isinstance(body, bytes):
        return None
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _own_unit() -> str | None:
    """The systemd unit this process runs in ("vime-supervisor.service"), from its cgroup."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                m = re.search(r"/([^/]+\.service)$", line.strip())
                if m:
                    return m.group(1)
    except OSError:
        pass
    return None


def daemon_log_file() -> tuple[str | None, str]:
    """(the file our stderr, where the JSON log goes, is, or None; why not, when None)."""
    try:
        st = os.fstat(2)
    except OSError:
        return None, "the daemon has no stderr"
    if stat.S_ISREG(st.st_mode):
        try:
            return os.readlink("/proc/self/fd/2"), ""
        except OSError:
            return "/proc/self/fd/2", ""
    # systemd sets JOURNAL_STREAM=<dev>:<inode> when it connects stderr to the journal.
    if os.environ.get("JOURNAL_STREAM") == f"{st.st_dev}:{st.st_ino}":
        unit = _own_unit() or "vime-supervisor"
        return None, f"the daemon logs to the systemd journal, not to a file; read it with: journalctl -u {unit}"
    if stat.S_ISFIFO(st.st_mode):
        kind = "a pipe"
    elif os.isatty(2):
        kind = "a terminal"
    elif stat.S_ISSOCK(st.st_mode):
        kind = "a socket"
    else:
        kind = "not a regular file"
    return None, (f"the daemon writes its log to stderr, which is {kind}, not a file; read it where that goes "
                  f"(under systemd: journalctl -u vime-supervisor), or start the daemon with 2>>FILE")


class ResyncVerbs(Protocol):
    """What the control socket asks of the sync coordinator (sync.SyncCoordinator)."""

    def agent_connected(self) -> None: ...

    def agent_disconnected(self) -> None: ...

    def begin(self, runner: EngineRunner, version: int) -> dict[str, Any]: ...

    async def end(self, runner: EngineRunner, version: int, ok: bool, error: str | None) -> dict[str, Any]: ...


class PushVerbs(Protocol):
    """What the control socket asks of the announced pushes (sync.PushCoordinator)."""

    def begin(self, version: int, engines: list[str], nbytes: int, deadline_s: float) -> dict[str, Any]: ...

    async def end(self, push_id: str, ok: bool, failed: dict[str, str]) -> dict[str, Any] | None: ...

    def in_flight(self) -> list[dict[str, Any]]: ...


class ControlServer:
    def __init__(self, fleet: Fleet, sync: ResyncVerbs, path: str, *, allowed_uids: tuple[int, ...] = (), socket_group: str | None = None,
                 listener: socket.socket | None = None, pushes: PushVerbs | None = None,
                 router: RouterLink | None = None):
        """listener: the listening socket a reload handed over (checked by reexec.take_listener),
        served on instead of binding a new one."""
        self.fleet = fleet
        self.sync = sync  # the weight-push verbs (begin, end, the agent's stream)
        self.pushes = pushes  # the trainer's announced pushes into many engines
        self.router = router  # with [router]: shown in status and the metrics
        self.path = path
        self.allowed = {os.getuid(), *allowed_uids}
        self.socket_group = socket_group
        self.app = web.Application(middlewares=[self._guard], client_max_size=MAX_BODY)
        self._runner: web.AppRunner | None = None
        self._streams: set = set()  # open event streams, ended at stop
        self._closing = False
        self._inherited = listener
        self.listener: socket.socket | None = None  # listening, from start() until close_listener()
        self.listener_file: tuple[int, int] | None = None  # (st_dev, st_ino) of the file it is bound to
        self._routes()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._check_runtime_dir(os.path.dirname(self.path))
        gid = self._socket_gid()  # before the socket exists: a bad group leaves nothing behind
        listener, self._inherited = self._inherited, None
        if listener is not None and listener.getsockname() != self.path:
            log.warning("control.handover_refused", socket=self.path, why=f"the socket handed over is bound to "
                        f"{listener.getsockname()!r}", action="binding a fresh socket")
            listener.close()
            listener = None
        inherited = listener is not None
        if listener is None:
            listener = self._bind()
        try:
            self._keep_as_configured(gid, inherited)
            # A short shutdown_timeout: nothing a handler does is worth delaying the daemon's exit.
            self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
            await self._runner.setup()
            # aiohttp closes the socket it serves on when it stops: it gets a duplicate, and
            # self.listener goes on listening (a reload hands it to the next image).
            await web.SockSite(self._runner, listener.dup(), backlog=BACKLOG).start()
        except BaseException:
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None
            listener.close()
            self._unlink_socket()
            raise
        self.listener = listener
        log.info("control.listening", socket=self.path, mode="0660", allowed_uids=sorted(self.allowed),
                 inherited=inherited)

    def _bind(self) -> socket.socket:
        if os.path.lexists(self.path):
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise RuntimeError(f"{self.path} exists and is not a socket; remove it or choose another runtime_dir")
            os.unlink(self.path)  # a stale socket from a previous daemon
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o117)  # the socket is created 0660, never wider, not even for a moment
        try:
            sock.bind(self.path)
            sock.listen(BACKLOG)
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old)
        return sock

    def _keep_as_configured(self, gid: int | None, inherited: bool) -> None:
        """Mode 0660 and the configured group. bind() made a fresh socket 0660 under the umask;
        an inherited one gets both again (a reload may have changed socket_group)."""
        # lstat: never chmod or chown what a symlink points to.
        st = os.lstat(self.path)
        if not stat.S_ISSOCK(st.st_mode):
            raise RuntimeError(f"{self.path} was replaced after bind; runtime_dir must be ours alone")
        self.listener_file = (st.st_dev, st.st_ino)
        if inherited:
            if stat.S_IMODE(st.st_mode) != 0o660:
                os.chmod(self.path, 0o660)
            if gid is None:  # the group a fresh bind gets: the directory's if set-group-ID, else ours
                parent = os.stat(os.path.dirname(self.path))
                gid = parent.st_gid if parent.st_mode & stat.S_ISGID else os.getegid()
        if gid is not None and st.st_gid != gid:
            os.chown(self.path, -1, gid, follow_symlinks=False)

    @staticmethod
    def _check_runtime_dir(path: str) -> None:
        """Whoever can write to the socket's directory can replace the socket: it must be ours
        (or root's) and writable by nobody else. One we just made under a lax umask is fixed."""
        st = os.stat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise RuntimeError(f"runtime_dir {path} is not a directory")
        if st.st_uid not in (0, os.geteuid()):
            raise RuntimeError(f"runtime_dir {path} is owned by uid {st.st_uid}, not by us or root; use a directory of our own")
        if st.st_mode & 0o022:
            if st.st_uid != os.geteuid():
                raise RuntimeError(f"runtime_dir {path} is writable by group or others; chmod go-w {path}")
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022)

    def _socket_gid(self) -> int | None:
        if not self.socket_group:
            return None
        if self.socket_group.isdigit():
            return int(self.socket_group)
        try:
            return grp.getgrnam(self.socket_group).gr_gid
        except KeyError:
            raise RuntimeError(f"socket_group: no group named {self.socket_group!r}") from None

    def _unlink_socket(self) -> None:
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    async def stop(self, *, keep_listening: bool = False) -> None:
        """Stop serving. keep_listening (a reload): the listening socket stays open, and calls
        made from now on wait in its backlog for the next image; a call already accepted is
        answered first (or closed unanswered, never half-handled)."""
        self._closing = True
        for sub in list(self._streams):  # long-lived streams end now, not at their next event
            try:
                sub.queue.put_nowait(_CLOSE)
            except asyncio.QueueFull:
                pass
        if self._runner is not None:
            if keep_listening:
                await self._stop_accepting()
            await self._runner.cleanup()
        if not keep_listening:
            self.close_listener()

    async def _stop_accepting(self) -> None:
        """Accept no more; wait (ACCEPTED_GRACE at most) until every connection accepted has
        had its request read: the runner's shutdown closes one not yet read unanswered, which
        a client would see as a dropped call."""
        assert self._runner is not None and self._runner.server is not None
        for site in list(self._runner.sites):
            await site.stop()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ACCEPTED_GRACE
        while any(_unread(c) for c in self._runner.server.connections) and loop.time() < deadline:
            await asyncio.sleep(0.005)

    def close_listener(self) -> None:
        """Close the listening socket and remove its file (a stop; or a reload's stop that came
        after the server had stopped)."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # -- middleware: peer check and JSON errors -------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        creds = peer_credentials(request)
        if creds is None:  # no credentials (the connection is already gone): fail closed
            log.warning("control.refused", uid=None, path=request.path)
            return _error(403, ErrorCode.FORBIDDEN, "the peer's credentials could not be read; connect over the Unix socket")
        uid = creds[1]
        if uid not in self.allowed:
            log.warning("control.refused", uid=uid, caller_pid=creds[0], path=request.path)
            return _error(403, ErrorCode.FORBIDDEN, f"uid {uid} may not use this socket; add it to supervisor.allowed_uids")
        action = self._audited(request)
        if action is None:
            return await self._answer(request, handler)
        request[_AUDIT] = {}
        resp = None
        try:
            resp = await self._answer(request, handler)
            return resp
        finally:  # answered, refused or cancelled: one line
            fields: dict[str, Any] = {field: request.match_info[key] for key, field in _AUDIT_FROM_PATH.items()
                                      if key in request.match_info}
            fields.update(request[_AUDIT], status=None if resp is None else resp.status)
            if (code := _error_code(resp)) is not None:
                fields["error"] = code
            log.info(f"control.{action}", caller_uid=uid, caller_pid=creds[0], **fields)

    def _audited(self, request: web.Request) -> str | None:
        """The action a request asks for, if it is one that is audited (its route matched)."""
        route = request.match_info.route
        if request.method != "POST" or route.resource is None:
            return None
        pattern = route.resource.canonical
        if pattern == ENGINE_ACTION_PATTERN:
            action = request.match_info.get("action")
            return action if action in set(Action) or action == FAILURES else None
        return self._audit_names.get(pattern)

    async def _answer(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.content_length is not None and request.content_length > MAX_BODY:
            # Refused before reading: a client that declares 100 MB and sends a little would
            # otherwise hold the connection until it sends the rest.
            resp = _error(413, ErrorCode.REQUEST_ENTITY_TOO_LARGE,
                          _too_large(request, f" (Content-Length {request.content_length})"))
            resp.force_close()  # the unread body must not be parsed as the next request
            return resp
        try:
            return await handler(request)
        except ApiError as e:
            return _error(e.status, e.code, e.message)
        except Conflict as e:
            return _error(409, ErrorCode.CONFLICT, str(e))
        except BadRequest as e:
            return _error(400, ErrorCode.BAD_REQUEST, str(e))
        except web.HTTPException as e:  # aiohttp's own: 404 route, 405 method, 413 body
            if e.status < 400:
                raise
            messages = {
                404: f"no such route: {request.method} {request.path} (routes are under {API}/)",
                405: f"method {request.method} not allowed on {request.path}",
                413: _too_large(request),
            }
            codes = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED, 413: ErrorCode.REQUEST_ENTITY_TOO_LARGE}
            code = codes.get(e.status) or e.reason.lower().replace(" ", "_")
            return _error(e.status, code, messages.get(e.status, e.reason))
        except asyncio.CancelledError:
            raise
        except ConnectionResetError:
            # The client went away mid-request: nothing to answer. Raising would make aiohttp
            # print a non-JSON traceback to our log; this response is dropped unsent.
            log.debug("control.client_gone", path=request.path)
            return _error(400, ErrorCode.CLIENT_GONE, "connection lost before the request was read")
        except Exception as e:  # a bug of ours: answer 500, keep serving
            log.exception("control.handler_failed", path=request.path)
            return _error(500, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")

    # -- helpers ---------------------------------------------------------------------------

    async def _body(self, request: web.Request, schema: dict[str, tuple[type, ...]], required: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
        try:
            raw = await request.read()
        except web.RequestPayloadError as e:  # a body that cannot be decoded (Content-Encoding)
            raise ApiError(400, ErrorCode.BAD_BODY, f"request body could not be read: {e}".replace("\n", " ")) from None
        if not raw:
            data: Any = {}
        else:
            try:
                data = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise ApiError(400, ErrorCode.BAD_JSON, f"body is not valid JSON: {e}") from None
            except RecursionError:
                raise ApiError(400, ErrorCode.BAD_JSON, "body is not valid JSON: nested too deeply") from None
        if not isinstance(data, dict):
            raise ApiError(400, ErrorCode.BAD_REQUEST, "body must be a JSON object")
        for key in data:
            if key not in schema:
                raise ApiError(400, ErrorCode.BAD_REQUEST, f"unknown field {key!r}; known: {', '.join(sorted(schema)) or 'none'}")
        for key in required:
            if key not in data:
                raise ApiError(400, ErrorCode.BAD_REQUEST, f"missing field {key!r}")
        for key, value in data.items():
            types = schema[key]
            if isinstance(value, bool) and bool not in types or not isinstance(value, types):
                names = " or ".join(t.__name__ for t in types)
                raise ApiError(400, ErrorCode.BAD_REQUEST, f"field {key!r} must be {names}, got {type(value).__name__}")
        return data

    def _engine(self, request: web.Request):
        name = request.match_info["name"]
        runner = self.fleet.runners.get(name)
        if runner is None:
            known = ", ".join(self.fleet.runners)
            raise ApiError(404, ErrorCode.UNKNOWN_ENGINE, f"no engine named {name!r}; known: {known}")
        return runner

    @staticmethod
    def _number(request: web.Request, key: str) -> int:
        text = request.match_info[key]
        if not (text.isascii() and text.isdigit()) or len(text) > 18:  # "²".isdigit(), int() refuses it
            raise ApiError(400, ErrorCode.BAD_REQUEST, f"{key} must be a non-negative integer, got {text!r}")
        return int(text)

    # -- routes ----------------------------------------------------------------------------

    def _routes(self) -> None:
        handlers = {
            ("GET", STATUS_PATH): self.status,
            ("GET", ROUTABLE_PATH): self.routable,
            ("POST", API + "/rounds/{n}/" + RoundPhase.START): self.round_start,
            ("POST", API + "/rounds/{n}/" + RoundPhase.END): self.round_end,
            ("POST", WEIGHTS_PATH): self.publish_weights,
            ("POST", ENGINE_SYNC_PATTERN): self.engine_sync,
            ("POST", ENGINE_SIGNAL_PATTERN): self.engine_signal,
            ("POST", ENGINE_ACTION_PATTERN): self.engine_action,
            ("GET", ENGINE_LOG_PATTERN): self.engine_log,
            ("GET", DAEMON_LOG_PATH): self.daemon_log,
            ("GET", EVENTS_PATH): self.events,
            ("GET", METRICS_PATH): self.metrics,
            ("GET", INCIDENTS_PATH): self.incidents,
            ("POST", PUSHES_PATH): self.push_begin,
            ("GET", PUSHES_PATH): self.push_list,
            ("POST", PUSH_END_PATTERN): self.push_end,
        }
        assert set(handlers) == set(ROUTES), "protocol.ROUTES and the handlers differ"
        # Audited POST routes besides the engine actions (audited by their action's name).
        self._audit_names = {
            API + "/rounds/{n}/" + RoundPhase.START: "round_start",
            API + "/rounds/{n}/" + RoundPhase.END: "round_end",
            WEIGHTS_PATH: "weights",
            ENGINE_SIGNAL_PATTERN: "signal",
            PUSHES_PATH: "push_begin",
            PUSH_END_PATTERN: "push_end",
        }
        for method, path in ROUTES:  # in the protocol's order: the sync route before {action}
            self.app.router.add_route(method, path, handlers[method, path])

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(fleet_status(self.fleet, self.router))

    async def routable(self, request: web.Request) -> web.Response:
        return web.json_response(routable_view(self.fleet))

    async def round_start(self, request: web.Request) -> web.Response:
        await self._body(request, {})
        n = self._number(request, "n")
        changed, message = self.fleet.start_round(n)
        _note(request, round=n, changed=changed)
        return web.json_response({"round": n, "open": True, "changed": changed, "message": message})

    async def round_end(self, request: web.Request) -> web.Response:
        await self._body(request, {})
        n = self._number(request, "n")
        changed, message = self.fleet.end_round(n)
        _note(request, round=n, changed=changed)
        return web.json_response({"round": n, "open": False, "changed": changed, "message": message})

    async def publish_weights(self, request: web.Request) -> web.Response:
        body = await self._body(request, {"version": (int,), "checkpoint": (str, type(None)),
                                          "fingerprint": (dict, type(None))}, {"version"})
        fp = None
        if body.get("fingerprint") is not None:  # optional: without one, the label check alone
            try:
                fp = parse_fingerprint(body["fingerprint"])
            except FingerprintError as e:
                raise BadRequest(str(e)) from None
        _note(request, version=body["version"], checkpoint=body.get("checkpoint"), fingerprint=fp is not None)
        changed, message = await self.fleet.publish_weights(body["version"], body.get("checkpoint"), fp)
        _note(request, changed=changed)
        return web.json_response({"weight_version": self.fleet.current_version, "changed": changed,
                                  "message": message, "epoch": self.fleet.epoch})

    async def engine_action(self, request: web.Request) -> web.Response:
        runner = self._engine(request)
        action = request.match_info["action"]
        if action == FAILURES:
            body = await self._body(request, {"detail": (str,), "poisoned": (bool,), "incarnation": (int,)})
            if "incarnation" in body:
                check_version("incarnation", body["incarnation"])
            _note(request, poisoned=body.get("poisoned", False), incarnation=body.get("incarnation"))
            result = self.fleet.report_failure(runner, body.get("detail") or "request failed",
                                               poisoned=body.get("poisoned", False),
                                               incarnation=body.get("incarnation"))
            _note(request, counted=result["counted"], state=result["state"])
            return web.json_response({"engine": runner.name, **result})
        if action not in set(Action):
            raise ApiError(404, ErrorCode.UNKNOWN_ACTION,
                           f"no action {action!r}; use {', '.join(Action)} or {FAILURES}")
        await self._body(request, {})
        message = await self.fleet.engine_action(runner, action)
        _note(request, message=message, state=runner.fsm.state.value, incarnation=runner.fsm.incarnation)
        return web.json_response({"engine": runner.name, "action": action, "state": runner.fsm.state.value,
                                  "message": message, "incarnation": runner.fsm.incarnation})

    async def engine_signal(self, request: web.Request) -> web.Response:
        """A signal to a spawned engine's server process (its pid, as supervisord's signal
        does; not the group). What follows is the supervision's: a TERM ends it, and it is
        restarted as after any exit. Who sent it is logged."""
        runner = self._engine(request)
        body = await self._body(request, {SIGNAL_FIELD: (str, int)}, {SIGNAL_FIELD})
        try:
            sig = parse_signal(body[SIGNAL_FIELD])
        except ValueError as e:
            raise ApiError(400, ErrorCode.BAD_SIGNAL, str(e)) from None
        if not runner.spec.spawned:
            raise Conflict(f"{runner.name} is attached ({runner.spec.base_url}): the daemon did not start it and "
                           f"cannot signal it; signal it on the host that runs it")
        pid, state = runner.pid, runner.fsm.state.value
        _note(request, signal=sig.name, pid=pid, state=state, incarnation=runner.fsm.incarnation)
        if pid is None:
            raise ApiError(409, ErrorCode.NOT_RUNNING, f"{runner.name} is not running ({state}): no process to signal")
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # it exited a moment ago: its exit is being handled
            raise ApiError(409, ErrorCode.NOT_RUNNING, f"{runner.name} is not running (pid {pid} exited just now)") from None
        return web.json_response({"engine": runner.name, "signal": sig.name, "pid": pid, "state": state,
                                  "message": "signalled"})

    async def engine_sync(self, request: web.Request) -> web.Response:
        """The trainer agent's push into one STALE engine: begin, push, end (ok or not)."""
        runner = self._engine(request)
        phase = request.match_info["phase"]
        if phase == SyncPhase.BEGIN:
            body = await self._body(request, {"version": (int,)}, {"version"})
            check_version("version", body["version"])
            return web.json_response(self.sync.begin(runner, body["version"]))
        if phase == SyncPhase.END:
            body = await self._body(request, {"version": (int,), "ok": (bool,), "error": (str, type(None))},
                                    {"version", "ok"})
            check_version("version", body["version"])
            return web.json_response(await self.sync.end(runner, body["version"], body["ok"], body.get("error")))
        raise ApiError(404, ErrorCode.UNKNOWN_ACTION, f"no sync phase {phase!r}; use {' or '.join(SyncPhase)}")

    def _push_verbs(self) -> PushVerbs:
        if self.pushes is None:  # a server built without them (tests of the routes alone)
            raise ApiError(404, ErrorCode.NOT_FOUND, "this daemon takes no push announcements")
        return self.pushes

    async def push_begin(self, request: web.Request) -> web.Response:
        """The trainer announces a push into many engines: each receiver, paused, is excused
        until the push's deadline (not sync_timeout) while it is in flight."""
        pushes = self._push_verbs()
        body = await self._body(request, {"version": (int,), "engines": (list,), "bytes": (int,),
                                          "deadline_s": (int, float)}, {"version", "engines", "bytes", "deadline_s"})
        check_version("version", body["version"])
        engines = body["engines"]
        if not all(isinstance(e, str) for e in engines):
            raise ApiError(400, ErrorCode.BAD_REQUEST, "engines must be a list of engine names (strings)")
        unknown = [e for e in engines if e not in self.fleet.runners]
        if unknown:
            raise ApiError(404, ErrorCode.UNKNOWN_ENGINE, f"no engine named {', '.join(map(repr, unknown[:5]))}; "
                           f"known: {', '.join(self.fleet.runners)}")
        _note(request, version=body["version"], engines=engines, bytes=body["bytes"], deadline_s=body["deadline_s"])
        try:
            deadline_s = float(body["deadline_s"])
        except OverflowError:  # an integer past a float's range
            raise ApiError(400, ErrorCode.BAD_REQUEST, f"deadline_s must be a number of seconds > 0 and "
                                                       f"<= 86400, got {body['deadline_s']}") from None
        result = pushes.begin(body["version"], engines, body["bytes"], deadline_s)
        _note(request, push=result["push"])
        return web.json_response(result)

    async def push_end(self, request: web.Request) -> web.Response:
        pushes = self._push_verbs()
        push_id = request.match_info["id"]
        body = await self._body(request, {"ok": (bool,), "failed": (dict,)}, {"ok"})
        failed = body.get("failed") or {}
        if not all(isinstance(v, str) for v in failed.values()):
            raise ApiError(400, ErrorCode.BAD_REQUEST, 'failed must map engine names to why (strings): {"name": "why"}')
        _note(request, ok=body["ok"], failed=sorted(failed))
        result = await pushes.end(push_id, body["ok"], failed)
        if result is None:
            raise ApiError(404, ErrorCode.UNKNOWN_PUSH, f"no push {push_id[:80]!r} in flight (ended already, or expired "
                           f"past its deadline); GET {PUSHES_PATH} lists those in flight")
        _note(request, outcome=result["outcome"])
        return web.json_response(result)

    async def push_list(self, request: web.Request) -> web.Response:
        return web.json_response({"pushes": self._push_verbs().in_flight()})

    @staticmethod
    def _log_bytes(request: web.Request) -> int:
        try:
            nbytes = min(int(request.query.get(LOG_BYTES_PARAM, "16384")), 1 << 20)
        except ValueError:
            raise ApiError(400, ErrorCode.BAD_REQUEST, f"{LOG_BYTES_PARAM} must be an integer") from None
        if nbytes < 0:
            raise ApiError(400, ErrorCode.BAD_REQUEST, f"{LOG_BYTES_PARAM} must be >= 0, got {nbytes}")
        return nbytes

    async def engine_log(self, request: web.Request) -> web.Response:
        runner = self._engine(request)
        nbytes = self._log_bytes(request)
        if runner.log_path is None:
            raise ApiError(409, ErrorCode.NO_LOG, f"{runner.name} has no log yet (attached engines have none)")
        return web.Response(text=read_tail(runner.log_path, nbytes),
                            headers={LOG_PATH_HEADER: str(runner.log_path)})

    async def daemon_log(self, request: web.Request) -> web.Response:
        """The end of the daemon's own log, when its stderr is a file (409 no_log says where
        it goes otherwise: the journal's command, or what stderr is)."""
        nbytes = self._log_bytes(request)
        path, why = daemon_log_file()
        if path is None:
            raise ApiError(409, ErrorCode.NO_LOG, why)
        # /proc/self/fd/2 opens the very file stderr writes to, even if it was renamed or removed.
        return web.Response(text=read_tail(Path("/proc/self/fd/2"), nbytes), headers={LOG_PATH_HEADER: path})

    async def events(self, request: web.Request) -> web.StreamResponse:
        """One JSON object per line, until the client goes away or the daemon stops. A
        keepalive line every 10 s lets a reader tell a quiet daemon from a dead connection;
        a client that went away is noticed within a second (an agent must not be asked to
        sync after it is gone)."""
        roles = request.query.getall(ROLE_PARAM, [Role.OBSERVER])
        role = roles[0]
        if len(roles) > 1 or role not in set(Role):
            raise ApiError(400, ErrorCode.BAD_REQUEST, f"role must be one of {' or '.join(Role)}, got {' and '.join(map(repr, roles))}")
        cap = MAX_STREAMS + (MAX_AGENT_STREAMS if role == Role.AGENT else 0)
        if len(self._streams) >= cap:
            raise ApiError(429, ErrorCode.TOO_MANY_STREAMS,
                           f"{len(self._streams)} event streams are open (at most {MAX_STREAMS} observers, "
                           f"{MAX_AGENT_STREAMS} more for agents); close unused ones and retry")
        resp = web.StreamResponse(headers={"Content-Type": NDJSON})
        await resp.prepare(request)
        sub = self.fleet.subscribe(STREAM_QUEUE)
        self._streams.add(sub)
        if role == Role.AGENT:  # it answers sync_request events: the daemon may ask it now
            self.sync.agent_connected()
        try:
            hello = {"event": Event.HELLO, "ts": time.time(), **routable_view(self.fleet),
                     "round": self.fleet.round, "round_open": self.fleet.round_open}
            await self._write(request, resp, json.dumps(hello).encode() + b"\n")
            quiet = 0.0
            while not self._closing:
                if request.transport is None or request.transport.is_closing():
                    break
                try:
                    ev = await within(sub.queue.get(), 1.0)
                except asyncio.TimeoutError:
                    quiet += 1.0
                    if quiet < 10.0:
                        continue
                    ev = {"event": Event.KEEPALIVE, "ts": time.time()}
                quiet = 0.0
                if ev is _CLOSE:
                    break
                await self._write(request, resp, json.dumps(ev).encode() + b"\n")
                if sub.lost:
                    overflow = {"event": Event.OVERFLOW, "message": "reader too slow; reconnect"}
                    await self._write(request, resp, json.dumps(overflow).encode() + b"\n")
                    break
        except (ConnectionResetError, _StalledReader):
            pass
        finally:
            self._streams.discard(sub)
            self.fleet.unsubscribe(sub)
            if role == Role.AGENT:
                self.sync.agent_disconnected()
        return resp

    @staticmethod
    async def _write(request: web.Request, resp: web.StreamResponse, data: bytes) -> None:
        """A reader that takes nothing for STREAM_WRITE_TIMEOUT loses its stream: its connection
        is dropped, which frees its buffers (a blocked write would hold them for ever)."""
        try:
            await within(resp.write(data), STREAM_WRITE_TIMEOUT)
        except asyncio.TimeoutError:
            log.warning("control.stream_stalled", timeout=STREAM_WRITE_TIMEOUT)
            if request.transport is not None:
                request.transport.abort()
            raise _StalledReader() from None

    async def incidents(self, request: web.Request) -> web.Response:
        from .engine.postmortem import list_incidents

        return web.json_response({"incidents": list_incidents(self.fleet.cfg.log_dir)})

    async def metrics(self, request: web.Request) -> web.Response:
        from .metrics import render

        return web.Response(body=render(self.fleet, self.router), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
