"""The blocking transport: http.client over an AF_UNIX socket, no event loop needed.

    sup = SupervisorClient()              # $VIME_SUPERVISOR_SOCKET or the default
    with sup.round(412):
        urls = [e["url"] for e in sup.routable_engines()["engines"]]
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time
from typing import Any, Iterator, Literal, TypeVar

from tenacity import Retrying, retry_if_exception

from vime.supervisor.protocol import DaemonEvent, Role, RoundResult

from ._transport import (
    ClientSettings,
    Dropped,
    NotConnected,
    Stream,
    check_server,
    connect_failure,
    give_up,
    path_mode,
    reconnected,
    retry_predicate,
    stop_within,
    wait,
    wanted,
    why,
)
from .calls import Call, Verbs, event_stream
from .errors import SupervisorError, error_from_response, timeout_error

__all__ = ["SupervisorClient"]

T = TypeVar("T")

_DROPS = (http.client.RemoteDisconnected, http.client.IncompleteRead, http.client.BadStatusLine,
          ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None):
        super().__init__("localhost", timeout=timeout)
        self._socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._socket_path)
            check_server(sock, self._socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class SupervisorClient(ClientSettings, Verbs):
    """Blocking client (http.client on an AF_UNIX socket). Its verbs are calls.Verbs.

    socket_path: default $VIME_SUPERVISOR_SOCKET, then /run/vime-supervisor/supervisor.sock.
    connect_timeout: how long a call keeps retrying while the daemon cannot be reached.
    timeout: how long one call waits for the daemon's answer (a restart waits for the stop).
    read_timeout: the event stream gets a keepalive every 10 s; silence this long means the
    connection is dead and events() reconnects.
    """

    _asynchronous: Literal[False] = False

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
            if isinstance(sock, socket.socket):
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
            raise connect_failure(self.socket_path, e, path_mode(self.socket_path)) from None
        return conn

    def _once(self, call: Call[Any]) -> tuple[int, bytes, dict[str, str]]:
        conn = self._connect(self.timeout)
        try:
            data = None if call.body is None else json.dumps(call.body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            try:
                conn.request(call.method, call.path, body=data, headers=headers)
                resp = conn.getresponse()
                payload = resp.read()
            except TimeoutError:
                raise timeout_error(self.socket_path, call.method, call.path, self.timeout) from None
            except _DROPS as e:
                raise Dropped(why(e)) from None
            return resp.status, payload, {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()

    def _retrying(self, idempotent: bool) -> Retrying:
        return Retrying(retry=retry_if_exception(retry_predicate(idempotent)),
                        stop=stop_within(self.connect_timeout), wait=wait(), reraise=True)

    def _perform(self, call: Call[T]) -> T:
        """Send the call (retrying while not connected, and after a drop when idempotent) and
        decode its answer; a 4xx/5xx raises the typed SupervisorError."""
        t0 = time.monotonic()
        try:
            for attempt in self._retrying(call.idempotent):
                with attempt:
                    status, payload, headers = self._once(call)
        except (NotConnected, Dropped) as e:
            raise give_up(self.socket_path, e, call.idempotent, time.monotonic() - t0) from None
        if status >= 400:
            raise error_from_response(status, payload)
        return call.decode(payload, headers)

    # -- what a table cannot say: a block, a stream ------------------------------------------

    @contextlib.contextmanager
    def round(self, n: int) -> Iterator[RoundResult]:
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

    def events(self, *, keepalives: bool = False, reconnect: bool = True, role: Role | str = Role.OBSERVER
               ) -> Iterator[DaemonEvent]:
        """The daemon's event stream, one dict per event: first {"event": "hello", ...} with the
        routable set, round and epoch, then transitions, rounds, membership, ...

        If the stream drops (the daemon restarted, or we fell behind), it reconnects (retrying
        for connect_timeout) and yields {"event": "reconnected", ...} before the new hello: events
        in between may have been missed. DaemonUnreachable if it cannot reconnect. close() ends
        it. role="agent" registers a sync agent, which answers `sync_request` events.
        """
        call = event_stream(role)
        stream = Stream()
        self._streams.add(stream)
        first, reason = True, ""
        try:
            while not stream.closed:
                t0 = time.monotonic()
                try:
                    for attempt in self._retrying(call.idempotent):
                        with attempt:
                            conn, resp = self._open_stream(call)
                except (NotConnected, Dropped) as e:
                    raise give_up(self.socket_path, e, call.idempotent, time.monotonic() - t0) from None
                try:
                    stream.handle = conn.sock
                    if stream.closed:  # close() came while we were connecting
                        return
                    if not first:
                        yield reconnected(self.socket_path, reason)
                    first, reason = False, "the daemon closed the stream"
                    while True:
                        try:
                            line = resp.readline()
                        except TimeoutError:
                            reason = f"no data for {self.read_timeout:g}s"
                            break
                        except (*_DROPS, ValueError, OSError) as e:
                            reason = why(e)
                            break
                        if not line:
                            break
                        try:
                            ev = json.loads(line)
                        except ValueError:
                            continue  # a line cut by a drop: the next readline sees the end
                        if wanted(ev, keepalives):
                            yield ev
                finally:
                    stream.handle = None
                    conn.close()
                if not reconnect:
                    return
        finally:
            self._streams.discard(stream)

    def _open_stream(self, call: Call[Any]) -> tuple[_UnixHTTPConnection, http.client.HTTPResponse]:
        conn = self._connect(self.read_timeout)
        try:
            conn.request(call.method, call.path)
            resp = conn.getresponse()
        except (*_DROPS, TimeoutError) as e:
            conn.close()
            raise Dropped(why(e)) from None
        if resp.status >= 400:
            payload = resp.read()
            conn.close()
            raise error_from_response(resp.status, payload)
        return conn, resp
