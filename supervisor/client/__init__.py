"""The trainer's client for the supervisor's control socket (HTTP/JSON over a Unix socket).

Two clients with the same verbs:

    from vime.supervisor.client import SupervisorClient           # plain code, no event loop
    sup = SupervisorClient()                              # $VIME_SUPERVISOR_SOCKET or the default
    with sup.round(412):                                  # starts round 412, ends it (also on error)
        urls = [e["url"] for e in sup.routable_engines()["engines"]]
        ...
    sup.publish_weights(413, "/ckpt/step-413")

    from vime.supervisor.client import AsyncSupervisorClient      # asyncio trainers (aiohttp)
    sup = AsyncSupervisorClient()
    async with sup.round(412):
        ...

Every call opens a fresh connection, so a client object outlives daemon restarts. A call that
cannot connect (socket missing, connection refused: the daemon is restarting) is retried with
jittered exponential backoff for up to `connect_timeout` seconds, then raises DaemonUnreachable.
A call whose connection drops after the request was sent is retried too when repeating it is
harmless: reads, and the round, weight and stop/start/retire verbs, which the daemon makes
idempotent (a repeat is a no-op that answers `changed: false`). `restart` and
`report_failure` (and the sync agent's `sync_begin`/`sync_end`) are not repeated after such a
drop (a repeat would restart twice, or count the failure twice); they raise ConnectionLost.

Errors are typed: ConflictError (409: a stale round or version, a refused action),
UnknownEngine (404), BadRequest (400), Forbidden (403), DaemonUnreachable; all are
SupervisorError and carry `status`, `code` and the daemon's `message`, which says what to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http.client
import json
import os
import socket
import struct
import time
from typing import Any, AsyncIterator, Callable, Iterator
from urllib.parse import quote, urlencode

from tenacity import (
    AsyncRetrying,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

try:  # tenacity >= 8.3: do not start a wait that would end past the deadline
    from tenacity import stop_before_delay as _stop_within
except ImportError:  # pragma: no cover - older tenacity overshoots by at most one wait
    _stop_within = stop_after_delay

__all__ = [
    "DEFAULT_SOCKET", "ENV_SOCKET", "default_socket_path",
    "SupervisorClient", "AsyncSupervisorClient", "LogTail",
    "SupervisorError", "DaemonUnreachable", "ConnectionLost", "ConflictError", "UnknownEngine",
    "BadRequest", "Forbidden",
]

DEFAULT_SOCKET = "/run/vime-supervisor/supervisor.sock"
ENV_SOCKET = "VIME_SUPERVISOR_SOCKET"
# A daemon running as a dedicated user (neither root nor ours) is trusted only when named here.
ENV_SERVER_UID = "VIME_SUPERVISOR_UID"
API = "/v1"
ENGINE_ACTIONS = ("restart", "stop", "start", "retire")


def default_socket_path() -> str:
    """$VIME_SUPERVISOR_SOCKET, else /run/vime-supervisor/supervisor.sock."""
    return os.environ.get(ENV_SOCKET) or DEFAULT_SOCKET


# -- errors ---------------------------------------------------------------------------------


class SupervisorError(Exception):
    """Any failure of a control-socket call. `status` is the HTTP status (None when no answer
    came), `code` the daemon's error code, `message` the daemon's message (it says what to do)."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status={self.status!r}, code={self.code!r}, message={self.message!r})"


class DaemonUnreachable(SupervisorError):
    """No connection to the daemon (socket missing, connection refused) within connect_timeout,
    or no answer within the request timeout."""


class ConnectionLost(DaemonUnreachable):
    """The connection dropped after a non-idempotent request was sent: it may or may not have
    taken effect. Check `status()` before repeating it."""


class ConflictError(SupervisorError):
    """409: the request contradicts the daemon's state (a stale or out-of-order round, a stale
    weight version, an action the engine cannot take). Nothing was changed."""


class UnknownEngine(SupervisorError):
    """404 unknown_engine: no engine of that name in the daemon's config."""


class BadRequest(SupervisorError):
    """400: the request is wrong in itself (a bad checkpoint, a negative version)."""


class Forbidden(SupervisorError):
    """403 (the daemon refused our uid), or the socket's file permissions refused us."""


def _unreachable_message(path: str, why: str) -> str:
    return (f"cannot reach the vime-supervisor daemon at {path}: {why}. Check that the daemon is "
            f"running (`systemctl status vime-supervisor`) and that this is its socket "
            f"(<runtime_dir>/supervisor.sock; ${ENV_SOCKET} chooses another)")


def _forbidden_socket_message(path: str, err: OSError) -> str:
    return (f"permission denied connecting to {path} ({err.strerror}): the socket is mode 0660; "
            f"run as the daemon's user or a member of its supervisor.socket_group, and have the uid "
            f"in supervisor.allowed_uids")


def error_from_response(status: int, body: bytes) -> SupervisorError:
    """The typed exception for a daemon's 4xx/5xx answer `{"error": {"code", "message"}}`."""
    code, message = f"http_{status}", ""
    try:
        err = json.loads(body)["error"]
        code, message = str(err.get("code") or code), str(err.get("message") or "")
    except (ValueError, KeyError, TypeError, AttributeError):
        message = body.decode("utf-8", "replace").strip()[:500]
    message = message or f"HTTP {status} from the daemon"
    if status == 409:
        cls: type[SupervisorError] = ConflictError
    elif status == 404 and code == "unknown_engine":
        cls = UnknownEngine
    elif status in (400, 413):
        cls = BadRequest
    elif status == 403:
        cls = Forbidden
    else:  # 404 route / 405: a client newer than the daemon; 5xx: a bug in the daemon
        cls = SupervisorError
    return cls(message, status=status, code=code)


# Internal signals for the retry loop.
class _NotConnected(Exception):
    """The connection could not be made: nothing was sent, so a retry is always safe."""


class _Dropped(Exception):
    """The connection broke after the request was (perhaps) sent."""


def _connect_failure(path: str, err: OSError) -> Exception:
    if isinstance(err, FileNotFoundError) or err.errno == errno.ENOENT:
        return _NotConnected("no such socket (the daemon is not running, or uses another runtime_dir)")
    if isinstance(err, PermissionError) or err.errno in (errno.EACCES, errno.EPERM):
        return Forbidden(_forbidden_socket_message(path, err), code="socket_permission")
    if isinstance(err, ConnectionRefusedError) or err.errno == errno.ECONNREFUSED:
        return _NotConnected("connection refused (a stale socket: the daemon is not listening)")
    if err.errno == errno.ENOTSOCK:
        return _NotConnected("the path exists but is not a socket")
    if isinstance(err, TimeoutError):
        return _NotConnected("connect timed out")
    return _NotConnected(f"{type(err).__name__}: {err}")


def _retry_predicate(idempotent: bool) -> Callable[[BaseException], bool]:
    return lambda e: isinstance(e, _NotConnected) or (idempotent and isinstance(e, _Dropped))


def _wait():
    # 0.05 s doubling to 1 s, plus up to 0.1 s of jitter so clients do not reconnect in lockstep.
    return wait_exponential(multiplier=0.05, max=1.0) + wait_random(0, 0.1)


def _give_up(path: str, err: BaseException, idempotent: bool, elapsed: float) -> SupervisorError:
    if isinstance(err, _Dropped) and not idempotent:
        return ConnectionLost(
            f"the connection to the vime-supervisor daemon at {path} dropped after the request was "
            f"sent ({err}); it may or may not have taken effect: check `status()` before repeating it",
            code="connection_lost")
    return DaemonUnreachable(_unreachable_message(path, f"{err} (tried for {elapsed:.1f}s)"),
                             code="unreachable")


def _decode_json(status: int, body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        raise SupervisorError(f"the daemon answered {status} with a body that is not JSON: {body[:200]!r}",
                              status=status, code="bad_answer") from None


def _event_lines(buf: bytearray, chunk: bytes) -> list[dict]:
    """Append chunk to buf; return the complete NDJSON lines, parsed (bad lines skipped)."""
    buf += chunk
    out: list[dict] = []
    while True:
        i = buf.find(b"\n")
        if i < 0:
            return out
        line = bytes(buf[:i]).strip()
        del buf[:i + 1]
        if line:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict):
                out.append(ev)


class LogTail(str):
    """An engine's log tail (a str); `.path` is the log file on the daemon's host (one file
    per incarnation, so a new path means the engine was restarted)."""

    path: str | None

    def __new__(cls, text: str, path: str | None = None) -> "LogTail":
        obj = super().__new__(cls, text)
        obj.path = path
        return obj


def _engine_path(name: str, what: str) -> str:
    return f"{API}/engines/{quote(name, safe='')}/{what}"


def _weights_body(version: int, checkpoint: str | os.PathLike[str] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"version": version}
    if checkpoint is not None:
        # A relative checkpoint means the trainer's working directory, not the daemon's.
        body["checkpoint"] = os.path.abspath(os.fspath(checkpoint))
    return body


def _events_path(role: str) -> str:
    if role not in ("observer", "agent"):
        raise ValueError(f"role must be 'observer' or 'agent', got {role!r}")
    return f"{API}/events" + ("?role=agent" if role == "agent" else "")


def _sync_end_body(version: int, ok: bool, error: str | None) -> dict[str, Any]:
    return {"version": version, "ok": bool(ok), "error": error}


def _failure_body(detail: str, poisoned: bool, incarnation: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"detail": detail, "poisoned": True} if poisoned else {"detail": detail}
    if incarnation is not None:
        body["incarnation"] = int(incarnation)
    return body


def _trusted_server_uids() -> set[int]:
    uids = {0, os.geteuid()}
    extra = os.environ.get(ENV_SERVER_UID, "").strip()
    if extra.isdigit():
        uids.add(int(extra))
    return uids


def _check_server(sock: Any, path: str) -> None:
    """SO_PEERCRED on our side: whoever could replace the socket file could otherwise answer
    for the daemon. The daemon must be root, our own uid, or $VIME_SUPERVISOR_UID."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return  # not a Unix socket with credentials (never the daemon's): nothing to check
    _pid, uid, _gid = struct.unpack("3i", creds)
    if uid not in _trusted_server_uids():
        raise Forbidden(f"the process behind {path} runs as uid {uid}, not root nor uid {os.geteuid()}: "
                        f"not trusted as the vime-supervisor daemon. Check who owns its runtime_dir; if the "
                        f"daemon runs as a dedicated user, set ${ENV_SERVER_UID}={uid}", code="untrusted_server")


class _Stream:
    """One events() generator's connection, so close() can end it from another thread."""

    def __init__(self) -> None:
        self.closed = False
        self.handle: Any = None  # the socket (sync) or the aiohttp response (async)


def _reconnected(path: str, why: str) -> dict[str, Any]:
    return {"event": "reconnected", "ts": time.time(), "socket": path,
            "message": f"event stream reconnected after: {why}; events in between may have been missed "
                       "(the hello that follows has the current state)"}


# -- the sync client ------------------------------------------------------------------------


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None):
        super().__init__("localhost", timeout=timeout)
        self._socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._socket_path)
            _check_server(sock, self._socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


_DROPS = (http.client.RemoteDisconnected, http.client.IncompleteRead, http.client.BadStatusLine,
          ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class SupervisorClient:
    """Sync client over the stdlib (http.client on an AF_UNIX socket): no event loop needed.

    socket_path: default $VIME_SUPERVISOR_SOCKET, then /run/vime-supervisor/supervisor.sock.
    connect_timeout: how long a call keeps retrying while the daemon cannot be reached.
    timeout: how long one call waits for the daemon's answer (a restart waits for the stop).
    read_timeout: the event stream gets a keepalive every 10 s; silence this long means the
    connection is dead and events() reconnects.
    """

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *, connect_timeout: float = 10.0,
                 timeout: float = 60.0, read_timeout: float = 30.0):
        self.socket_path = os.fspath(socket_path) if socket_path is not None else default_socket_path()
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self.read_timeout = read_timeout
        self._streams: set[_Stream] = set()

    def __repr__(self) -> str:
        return f"SupervisorClient({self.socket_path!r})"

    def __enter__(self) -> "SupervisorClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """End the event streams this client has open now (their events() generators return,
        without reconnecting), also from another thread. Other calls need no closing: each has
        its own connection, and the client stays usable."""
        for stream in list(self._streams):
            stream.closed = True
            sock = stream.handle
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a reader blocked in recv
                except OSError:
                    pass

    # -- transport -------------------------------------------------------------------------

    def _connect(self, timeout: float | None) -> _UnixHTTPConnection:
        conn = _UnixHTTPConnection(self.socket_path, timeout)
        try:
            conn.connect()
        except OSError as e:
            raise _connect_failure(self.socket_path, e) from None
        return conn

    def _once(self, method: str, path: str, body: Any) -> tuple[int, bytes, dict[str, str]]:
        conn = self._connect(self.timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                payload = resp.read()
            except TimeoutError:
                raise DaemonUnreachable(
                    f"the vime-supervisor daemon at {self.socket_path} did not answer {method} {path} within "
                    f"{self.timeout:g}s; check `systemctl status vime-supervisor` and its log",
                    code="timeout") from None
            except _DROPS as e:
                raise _Dropped(f"{type(e).__name__}: {e}".rstrip(": ")) from None
            return resp.status, payload, {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()

    def _retrying(self, idempotent: bool) -> Retrying:
        return Retrying(retry=retry_if_exception(_retry_predicate(idempotent)),
                        stop=_stop_within(self.connect_timeout), wait=_wait(), reraise=True)

    def _call(self, method: str, path: str, body: Any = None, *, idempotent: bool = True
              ) -> tuple[bytes, dict[str, str]]:
        t0 = time.monotonic()
        try:
            for attempt in self._retrying(idempotent):
                with attempt:
                    status, payload, headers = self._once(method, path, body)
        except (_NotConnected, _Dropped) as e:
            raise _give_up(self.socket_path, e, idempotent, time.monotonic() - t0) from None
        if status >= 400:
            raise error_from_response(status, payload)
        return payload, headers

    def _json(self, method: str, path: str, body: Any = None, *, idempotent: bool = True) -> Any:
        payload, _ = self._call(method, path, body, idempotent=idempotent)
        return _decode_json(200, payload)

    # -- verbs -----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The whole fleet: engines (name, state, reason, pid, weight_version, restarts,
        routable, ...), round, round_open, weight_version, epoch, ..."""
        return self._json("GET", f"{API}/status")

    def routable_engines(self) -> dict[str, Any]:
        """{"epoch", "weight_version", "engines": [{"name", "url", "model", "weight_version"}]}:
        the engines that may take traffic now. `epoch` changes whenever that set changes."""
        return self._json("GET", f"{API}/routable")

    def start_round(self, n: int) -> dict[str, Any]:
        """Open round n. Idempotent: starting the open round again is a no-op (changed: false),
        so a retry after a reconnect is safe. ConflictError if another round is open or n is not
        greater than the last round."""
        return self._json("POST", f"{API}/rounds/{int(n)}/start")

    def end_round(self, n: int) -> dict[str, Any]:
        """End round n. Idempotent: ending it again is a no-op (changed: false), so a retry after
        a reconnect is safe. ConflictError if n is not the open round."""
        return self._json("POST", f"{API}/rounds/{int(n)}/end")

    @contextlib.contextmanager
    def round(self, n: int) -> Iterator[dict[str, Any]]:
        """`with client.round(n):` starts round n and ends it when the block exits, also when
        the block raises (the block's exception is the one that propagates). Both calls are
        idempotent on the daemon, so their retries after a reconnect are safe."""
        started = self.start_round(n)
        try:
            yield started
        except BaseException as exc:
            try:
                self.end_round(n)
            except SupervisorError as end_err:
                exc.add_note(f"also failed to end round {n}: {end_err}")
            raise
        self.end_round(n)

    def publish_weights(self, version: int, checkpoint: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """Make `version` current (engines not reporting it go STALE, out of routing, until
        synced). Idempotent: publishing the current version again (same checkpoint) is a no-op,
        so a retry after a reconnect is safe. ConflictError for a version lower than the
        current one; BadRequest for a checkpoint that is not a directory with *.safetensors and
        config.json. A relative checkpoint is made absolute against our working directory."""
        return self._json("POST", f"{API}/weights", _weights_body(version, checkpoint))

    def _action(self, name: str, action: str) -> dict[str, Any]:
        # stop/start/retire repeat harmlessly ("already STOPPED"); restart would restart twice.
        return self._json("POST", _engine_path(name, action), idempotent=action != "restart")

    def restart(self, name: str) -> dict[str, Any]:
        """Stop and start a spawned engine now. Not repeated after a dropped connection."""
        return self._action(name, "restart")

    def stop(self, name: str) -> dict[str, Any]:
        """Stop a spawned engine and keep it STOPPED. Idempotent."""
        return self._action(name, "stop")

    def start(self, name: str) -> dict[str, Any]:
        """Start a STOPPED/EXITED/BACKOFF/FATAL spawned engine with a fresh start budget. Idempotent."""
        return self._action(name, "start")

    def retire(self, name: str) -> dict[str, Any]:
        """Take an engine out of routing for good (spawned ones are stopped). Idempotent."""
        return self._action(name, "retire")

    def report_failure(self, name: str, detail: str, *, poisoned: bool = False,
                       incarnation: int | None = None) -> dict[str, Any]:
        """A request to this engine failed: counts like a failed probe. poisoned=True: a weight
        push into it failed midway (weight_sync.PoisonedEngine), so it is stopped and restarted
        at once. incarnation: the one the request went to (status's "incarnation"); a report
        about an earlier one is ignored (counted False). Not repeated after a dropped connection
        (it would count twice)."""
        return self._json("POST", _engine_path(name, "failures"), _failure_body(detail, poisoned, incarnation),
                          idempotent=False)

    def sync_begin(self, name: str, version: int) -> dict[str, Any]:
        """The sync agent takes a STALE engine to push `version` into it ({"engine", "url",
        "version"}); the engine is SYNCING, never probed, until sync_end. ConflictError if the
        version is not current, the engine is not STALE, or a round is open. Not repeated after
        a dropped connection (the repeat would answer 409: check status())."""
        return self._json("POST", _engine_path(name, "sync/begin"), {"version": int(version)}, idempotent=False)

    def sync_end(self, name: str, version: int, ok: bool, error: str | None = None) -> dict[str, Any]:
        """The push finished: ok=True has the daemon verify the engine (/weight_info and a deep
        probe) before it is RUNNING; ok=False (with `error`) has it restarted as poisoned.
        Returns {"engine", "state", "reason"}. Not repeated after a dropped connection."""
        return self._json("POST", _engine_path(name, "sync/end"), _sync_end_body(version, ok, error),
                          idempotent=False)

    def engine_log(self, name: str, nbytes: int = 16384) -> LogTail:
        """The last `nbytes` of the engine's current log (ConflictError for attached engines,
        which have none)."""
        payload, headers = self._call("GET", f"{_engine_path(name, 'log')}?{urlencode({'bytes': int(nbytes)})}")
        return LogTail(payload.decode("utf-8", "replace"), headers.get("x-log-path"))

    def metrics(self) -> str:
        """Prometheus text exposition of the fleet."""
        payload, _ = self._call("GET", f"{API}/metrics")
        return payload.decode("utf-8", "replace")

    def incidents(self) -> list[dict[str, Any]]:
        """Post-mortem folders saved before unhealthy engines were stopped, oldest first."""
        return self._json("GET", f"{API}/incidents")["incidents"]

    def events(self, *, keepalives: bool = False, reconnect: bool = True, role: str = "observer"
               ) -> Iterator[dict[str, Any]]:
        """The daemon's event stream, one dict per event: first {"event": "hello", ...} with the
        routable set, round and epoch, then transitions, rounds, membership, ...

        If the stream drops (the daemon restarted, or we fell behind), it reconnects (retrying
        for connect_timeout) and yields {"event": "reconnected", ...} before the new hello: events
        in between may have been missed. DaemonUnreachable if it cannot reconnect. close() ends
        it. role="agent" registers a sync agent, which answers `sync_request` events.
        """
        path = _events_path(role)
        stream = _Stream()
        self._streams.add(stream)
        first, why = True, ""
        try:
            while not stream.closed:
                t0 = time.monotonic()
                try:
                    for attempt in self._retrying(True):
                        with attempt:
                            conn, resp = self._open_stream(path)
                except (_NotConnected, _Dropped) as e:
                    raise _give_up(self.socket_path, e, True, time.monotonic() - t0) from None
                try:
                    stream.handle = conn.sock
                    if stream.closed:  # close() came while we were connecting
                        return
                    if not first:
                        yield _reconnected(self.socket_path, why)
                    first, why = False, "the daemon closed the stream"
                    while True:
                        try:
                            line = resp.readline()
                        except TimeoutError:
                            why = f"no data for {self.read_timeout:g}s"
                            break
                        except (*_DROPS, ValueError, OSError) as e:
                            why = f"{type(e).__name__}: {e}".rstrip(": ")
                            break
                        if not line:
                            break
                        try:
                            ev = json.loads(line)
                        except ValueError:
                            continue  # a line cut by a drop: the next readline sees the end
                        if isinstance(ev, dict) and (keepalives or ev.get("event") != "keepalive"):
                            yield ev
                finally:
                    stream.handle = None
                    conn.close()
                if not reconnect:
                    return
        finally:
            self._streams.discard(stream)

    def _open_stream(self, path: str) -> tuple[_UnixHTTPConnection, http.client.HTTPResponse]:
        conn = self._connect(self.read_timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
        except (*_DROPS, TimeoutError) as e:
            conn.close()
            raise _Dropped(f"{type(e).__name__}: {e}".rstrip(": ")) from None
        if resp.status >= 400:
            payload = resp.read()
            conn.close()
            raise error_from_response(resp.status, payload)
        return conn, resp


# -- the async client -----------------------------------------------------------------------


_CHECKED_CONNECTOR: Any = None


def _checked_unix_connector() -> Any:
    """aiohttp's UnixConnector, checking the server's uid on each new connection (_check_server)."""
    global _CHECKED_CONNECTOR
    if _CHECKED_CONNECTOR is None:
        import aiohttp

        class CheckedUnixConnector(aiohttp.UnixConnector):
            async def _create_connection(self, req, traces, timeout):
                proto = await super()._create_connection(req, traces, timeout)
                try:
                    _check_server(proto.transport.get_extra_info("socket"), self.path)
                except Forbidden:
                    proto.close()
                    raise
                return proto

        _CHECKED_CONNECTOR = CheckedUnixConnector
    return _CHECKED_CONNECTOR


class AsyncSupervisorClient:
    """asyncio client (aiohttp over aiohttp.UnixConnector). Same verbs as SupervisorClient,
    awaited; `async with client.round(n):`; `async for ev in client.events():`.

    Each call uses its own connection (and session), so one client object works across event
    loops and across daemon restarts; there is nothing to close (aclose() exists for symmetry).
    """

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *, connect_timeout: float = 10.0,
                 timeout: float = 60.0, read_timeout: float = 30.0):
        self.socket_path = os.fspath(socket_path) if socket_path is not None else default_socket_path()
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self.read_timeout = read_timeout

        self._streams: set[_Stream] = set()

    def __repr__(self) -> str:
        return f"AsyncSupervisorClient({self.socket_path!r})"

    async def __aenter__(self) -> "AsyncSupervisorClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """End the event streams this client has open now (their events() iterators stop,
        without reconnecting). Other calls need no closing: each has its own connection."""
        for stream in list(self._streams):
            stream.closed = True
            if stream.handle is not None:
                stream.handle.close()  # the reader's readany() returns or raises now

    # -- transport -------------------------------------------------------------------------

    def _session(self, read_timeout: float | None):
        import aiohttp

        connector = _checked_unix_connector()(path=self.socket_path, force_close=True)
        timeout = aiohttp.ClientTimeout(total=self.timeout if read_timeout is None else None,
                                        sock_connect=min(5.0, self.timeout), sock_read=read_timeout)
        return aiohttp.ClientSession(connector=connector, timeout=timeout)

    def _map_client_error(self, e: Exception) -> Exception:
        import aiohttp

        if isinstance(e, aiohttp.ClientConnectorError):
            return _connect_failure(self.socket_path, e.os_error)
        if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError)):
            return _Dropped(f"{type(e).__name__}: {e}".rstrip(": "))
        return SupervisorError(f"{type(e).__name__}: {e}", code="client_error")

    async def _once(self, method: str, path: str, body: Any) -> tuple[int, bytes, dict[str, str]]:
        import aiohttp

        try:
            async with self._session(None) as session:
                async with session.request(method, f"http://localhost{path}", json=body) as resp:
                    return resp.status, await resp.read(), {k.lower(): v for k, v in resp.headers.items()}
        except asyncio.TimeoutError:
            raise DaemonUnreachable(
                f"the vime-supervisor daemon at {self.socket_path} did not answer {method} {path} within "
                f"{self.timeout:g}s; check `systemctl status vime-supervisor` and its log", code="timeout") from None
        except aiohttp.ClientError as e:
            raise self._map_client_error(e) from None

    def _retrying(self, idempotent: bool) -> AsyncRetrying:
        return AsyncRetrying(retry=retry_if_exception(_retry_predicate(idempotent)),
                             stop=_stop_within(self.connect_timeout), wait=_wait(), reraise=True)

    async def _call(self, method: str, path: str, body: Any = None, *, idempotent: bool = True
                    ) -> tuple[bytes, dict[str, str]]:
        t0 = time.monotonic()
        try:
            async for attempt in self._retrying(idempotent):
                with attempt:
                    status, payload, headers = await self._once(method, path, body)
        except (_NotConnected, _Dropped) as e:
            raise _give_up(self.socket_path, e, idempotent, time.monotonic() - t0) from None
        if status >= 400:
            raise error_from_response(status, payload)
        return payload, headers

    async def _json(self, method: str, path: str, body: Any = None, *, idempotent: bool = True) -> Any:
        payload, _ = await self._call(method, path, body, idempotent=idempotent)
        return _decode_json(200, payload)

    # -- verbs (see SupervisorClient for their meaning) --------------------------------------

    async def status(self) -> dict[str, Any]:
        """The whole fleet (see SupervisorClient.status)."""
        return await self._json("GET", f"{API}/status")

    async def routable_engines(self) -> dict[str, Any]:
        """{"epoch", "weight_version", "engines": [...]}: the engines that may take traffic now."""
        return await self._json("GET", f"{API}/routable")

    async def start_round(self, n: int) -> dict[str, Any]:
        """Open round n. Idempotent on the daemon (a repeat is a no-op): retrying it after a
        reconnect is safe. ConflictError for a stale or out-of-order round."""
        return await self._json("POST", f"{API}/rounds/{int(n)}/start")

    async def end_round(self, n: int) -> dict[str, Any]:
        """End round n. Idempotent on the daemon (a repeat is a no-op): retrying it after a
        reconnect is safe. ConflictError if n is not the open round."""
        return await self._json("POST", f"{API}/rounds/{int(n)}/end")

    @contextlib.asynccontextmanager
    async def round(self, n: int) -> AsyncIterator[dict[str, Any]]:
        """`async with client.round(n):` starts round n and ends it when the block exits, also
        when it raises. Both calls are idempotent on the daemon, so retries are safe."""
        started = await self.start_round(n)
        try:
            yield started
        except BaseException as exc:
            try:
                await asyncio.shield(self.end_round(n))
            except SupervisorError as end_err:
                exc.add_note(f"also failed to end round {n}: {end_err}")
            raise
        await self.end_round(n)

    async def publish_weights(self, version: int, checkpoint: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """Make `version` current. Idempotent on the daemon (the current version again is a
        no-op), so a retry after a reconnect is safe. ConflictError for a stale version,
        BadRequest for a bad checkpoint."""
        return await self._json("POST", f"{API}/weights", _weights_body(version, checkpoint))

    async def _action(self, name: str, action: str) -> dict[str, Any]:
        return await self._json("POST", _engine_path(name, action), idempotent=action != "restart")

    async def restart(self, name: str) -> dict[str, Any]:
        """Stop and start a spawned engine now. Not repeated after a dropped connection."""
        return await self._action(name, "restart")

    async def stop(self, name: str) -> dict[str, Any]:
        """Stop a spawned engine and keep it STOPPED. Idempotent."""
        return await self._action(name, "stop")

    async def start(self, name: str) -> dict[str, Any]:
        """Start a stopped/failed spawned engine with a fresh start budget. Idempotent."""
        return await self._action(name, "start")

    async def retire(self, name: str) -> dict[str, Any]:
        """Take an engine out of routing for good. Idempotent."""
        return await self._action(name, "retire")

    async def report_failure(self, name: str, detail: str, *, poisoned: bool = False,
                             incarnation: int | None = None) -> dict[str, Any]:
        """A request to this engine failed (see SupervisorClient.report_failure). Not repeated
        after a dropped connection."""
        return await self._json("POST", _engine_path(name, "failures"), _failure_body(detail, poisoned, incarnation),
                                idempotent=False)

    async def sync_begin(self, name: str, version: int) -> dict[str, Any]:
        """The sync agent takes a STALE engine to push `version` (see SupervisorClient.sync_begin).
        Not repeated after a dropped connection."""
        return await self._json("POST", _engine_path(name, "sync/begin"), {"version": int(version)},
                                idempotent=False)

    async def sync_end(self, name: str, version: int, ok: bool, error: str | None = None) -> dict[str, Any]:
        """The push finished (see SupervisorClient.sync_end). Not repeated after a dropped connection."""
        return await self._json("POST", _engine_path(name, "sync/end"), _sync_end_body(version, ok, error),
                                idempotent=False)

    async def engine_log(self, name: str, nbytes: int = 16384) -> LogTail:
        """The last `nbytes` of the engine's current log."""
        payload, headers = await self._call(
            "GET", f"{_engine_path(name, 'log')}?{urlencode({'bytes': int(nbytes)})}")
        return LogTail(payload.decode("utf-8", "replace"), headers.get("x-log-path"))

    async def metrics(self) -> str:
        """Prometheus text exposition of the fleet."""
        payload, _ = await self._call("GET", f"{API}/metrics")
        return payload.decode("utf-8", "replace")

    async def events(self, *, keepalives: bool = False, reconnect: bool = True, role: str = "observer"
                     ) -> AsyncIterator[dict[str, Any]]:
        """The event stream (see SupervisorClient.events): reconnects after a drop and yields
        {"event": "reconnected", ...} first. aclose() on the client ends it; wrap it in
        contextlib.aclosing() to close it promptly when you stop reading early."""
        import aiohttp

        path = _events_path(role)
        stream = _Stream()
        self._streams.add(stream)
        first, why = True, ""
        try:
            while not stream.closed:
                t0 = time.monotonic()
                try:
                    async for attempt in self._retrying(True):
                        with attempt:
                            session, resp = await self._open_stream(path)
                except (_NotConnected, _Dropped) as e:
                    raise _give_up(self.socket_path, e, True, time.monotonic() - t0) from None
                try:
                    stream.handle = resp
                    if stream.closed:  # aclose() came while we were connecting
                        return
                    if not first:
                        yield _reconnected(self.socket_path, why)
                    first, why = False, "the daemon closed the stream"
                    buf = bytearray()
                    while True:
                        try:
                            chunk = await resp.content.readany()
                        except asyncio.TimeoutError:
                            why = f"no data for {self.read_timeout:g}s"
                            break
                        except (aiohttp.ClientError, OSError) as e:
                            why = f"{type(e).__name__}: {e}".rstrip(": ")
                            break
                        if not chunk:
                            break
                        for ev in _event_lines(buf, chunk):
                            if keepalives or ev.get("event") != "keepalive":
                                yield ev
                finally:
                    stream.handle = None
                    resp.release()
                    await session.close()
                if not reconnect:
                    return
        finally:
            self._streams.discard(stream)

    async def _open_stream(self, path: str):
        import aiohttp

        session = self._session(self.read_timeout)
        try:
            resp = await session.get(f"http://localhost{path}")
        except asyncio.TimeoutError:
            await session.close()
            raise _Dropped("no answer to GET /v1/events") from None
        except aiohttp.ClientError as e:
            await session.close()
            raise self._map_client_error(e) from None
        if resp.status >= 400:
            payload = await resp.read()
            resp.release()
            await session.close()
            raise error_from_response(resp.status, payload)
        return session, resp
