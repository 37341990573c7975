"""The asyncio transport: aiohttp over a Unix socket. The same verbs as SupervisorClient, awaited.

    sup = AsyncSupervisorClient()
    async with sup.round(412):
        view = await sup.routable_engines()
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator, Literal, TypeVar

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception

from vime.supervisor.protocol import DaemonEvent, Role, RoundResult

from ._transport import (
    ClientSettings,
    Dropped,
    NotConnected,
    Stream,
    check_server,
    connect_failure,
    event_lines,
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
from .errors import ClientCode, Forbidden, SupervisorError, error_from_response, timeout_error

__all__ = ["AsyncSupervisorClient"]

T = TypeVar("T")


class _CheckedUnixConnector(aiohttp.UnixConnector):
    """aiohttp's UnixConnector, checking the server's uid on each new connection."""

    async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> Any:
        proto = await super()._create_connection(req, traces, timeout)
        assert proto.transport is not None  # set by connection_made, before the return
        try:
            check_server(proto.transport.get_extra_info("socket"), self.path)
        except Forbidden:
            proto.close()
            raise
        return proto


class AsyncSupervisorClient(ClientSettings, Verbs):
    """asyncio client (aiohttp). Its verbs are calls.Verbs, awaited; `async with
    client.round(n):`; `async for ev in client.events():`.

    Each call uses its own connection (and session), so one client object works across event
    loops and across daemon restarts; there is nothing to close (aclose() ends event streams).
    """

    _asynchronous: Literal[True] = True

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

    def _session(self, read_timeout: float | None) -> aiohttp.ClientSession:
        connector = _CheckedUnixConnector(path=self.socket_path, force_close=True)
        timeout = aiohttp.ClientTimeout(total=self.timeout if read_timeout is None else None,
                                        sock_connect=min(5.0, self.timeout), sock_read=read_timeout)
        return aiohttp.ClientSession(connector=connector, timeout=timeout)

    def _map_client_error(self, e: Exception) -> Exception:
        if isinstance(e, aiohttp.ClientConnectorError):
            return connect_failure(self.socket_path, e.os_error, path_mode(self.socket_path))
        if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError)):
            return Dropped(why(e))
        return SupervisorError(f"{type(e).__name__}: {e}", code=ClientCode.CLIENT_ERROR)

    async def _once(self, call: Call[Any]) -> tuple[int, bytes, dict[str, str]]:
        try:
            async with self._session(None) as session:
                async with session.request(call.method, f"http://localhost{call.path}", json=call.body) as resp:
                    return resp.status, await resp.read(), {k.lower(): v for k, v in resp.headers.items()}
        except asyncio.TimeoutError:
            raise timeout_error(self.socket_path, call.method, call.path, self.timeout) from None
        except aiohttp.ClientError as e:
            raise self._map_client_error(e) from None

    def _retrying(self, idempotent: bool) -> AsyncRetrying:
        return AsyncRetrying(retry=retry_if_exception(retry_predicate(idempotent)),
                             stop=stop_within(self.connect_timeout), wait=wait(), reraise=True)

    async def _perform(self, call: Call[T]) -> T:
        """Send the call (retrying while not connected, and after a drop when idempotent) and
        decode its answer; a 4xx/5xx raises the typed SupervisorError."""
        t0 = time.monotonic()
        try:
            async for attempt in self._retrying(call.idempotent):
                with attempt:
                    status, payload, headers = await self._once(call)
        except (NotConnected, Dropped) as e:
            raise give_up(self.socket_path, e, call.idempotent, time.monotonic() - t0) from None
        if status >= 400:
            raise error_from_response(status, payload)
        return call.decode(payload, headers)

    # -- what a table cannot say: a block, a stream ------------------------------------------

    @contextlib.asynccontextmanager
    async def round(self, n: int) -> AsyncIterator[RoundResult]:
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

    async def events(self, *, keepalives: bool = False, reconnect: bool = True, role: Role | str = Role.OBSERVER
                     ) -> AsyncIterator[DaemonEvent]:
        """The event stream (see SupervisorClient.events): reconnects after a drop and yields
        {"event": "reconnected", ...} first. aclose() on the client ends it; wrap it in
        contextlib.aclosing() to close it promptly when you stop reading early."""
        call = event_stream(role)
        stream = Stream()
        self._streams.add(stream)
        first, reason = True, ""
        try:
            while not stream.closed:
                t0 = time.monotonic()
                try:
                    async for attempt in self._retrying(call.idempotent):
                        with attempt:
                            session, resp = await self._open_stream(call)
                except (NotConnected, Dropped) as e:
                    raise give_up(self.socket_path, e, call.idempotent, time.monotonic() - t0) from None
                try:
                    stream.handle = resp
                    if stream.closed:  # aclose() came while we were connecting
                        return
                    if not first:
                        yield reconnected(self.socket_path, reason)
                    first, reason = False, "the daemon closed the stream"
                    buf = bytearray()
                    while True:
                        try:
                            chunk = await resp.content.readany()
                        except asyncio.TimeoutError:
                            reason = f"no data for {self.read_timeout:g}s"
                            break
                        except (aiohttp.ClientError, OSError) as e:
                            reason = why(e)
                            break
                        if not chunk:
                            break
                        for ev in event_lines(buf, chunk):
                            if wanted(ev, keepalives):
                                yield ev  # type: ignore[misc]
                finally:
                    stream.handle = None
                    resp.release()
                    await session.close()
                if not reconnect:
                    return
        finally:
            self._streams.discard(stream)

    async def _open_stream(self, call: Call[Any]) -> tuple[aiohttp.ClientSession, aiohttp.ClientResponse]:
        session = self._session(self.read_timeout)
        try:
            resp = await session.request(call.method, f"http://localhost{call.path}")
        except asyncio.TimeoutError:
            await session.close()
            raise Dropped(f"no answer to {call.method} {call.path}") from None
        except aiohttp.ClientError as e:
            await session.close()
            raise self._map_client_error(e) from None
        if resp.status >= 400:
            payload = await resp.read()
            resp.release()
            await session.close()
            raise error_from_response(resp.status, payload)
        return session, resp
