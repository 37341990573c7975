"""The heartbeat's lean HTTP/1.1 client (supervisor/engine/http1.py) and the deep probe over it.

Against real local servers, no mocks: an aiohttp web server (what the stand-ins and, for
HTTP purposes, uvicorn look like) and raw asyncio servers that misbehave on purpose.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from vime.supervisor.engine.http1 import Http1Client, HttpProtocolError
from vime.supervisor.engine.probes import Prober, _lean_target


COMPLETION = json.dumps({"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- an aiohttp server that behaves ------------------------------------------------------------

class Engine:
    """An aiohttp app on a free port; records the client port of every request, so a test
    sees whether a connection was reused."""

    def __init__(self, keepalive_timeout: float = 75.0):
        self.peers: list[int] = []
        self.bodies: list[bytes] = []
        self.status, self.answer = 200, COMPLETION
        self.delay = 0.0
        self.metric_reads, self.tokens_per_read = 0, 0.0
        self.keepalive_timeout = keepalive_timeout

    async def completions(self, request: web.Request) -> web.Response:
        self.peers.append(request.transport.get_extra_info("peername")[1])
        self.bodies.append(await request.read())
        if self.delay:
            await asyncio.sleep(self.delay)
        return web.Response(status=self.status, body=self.answer, content_type="application/json")

    async def metrics(self, _request: web.Request) -> web.Response:
        tokens = 5.0 + self.tokens_per_read * self.metric_reads  # rises per read when set: stepping
        self.metric_reads += 1
        return web.Response(text=f'vllm:generation_tokens_total{{engine="0"}} {tokens}\n'
                                 'vllm:num_requests_running{engine="0"} 0.0\n')

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def start(self, port: int | None = None) -> "Engine":
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, access_log=None, keepalive_timeout=self.keepalive_timeout,
                                    shutdown_timeout=0.1)
        await self.runner.setup()
        self.port = port or free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()


@pytest_asyncio.fixture(loop_scope="function")  # on the test's own loop
async def engine():
    e = await Engine().start()
    yield e
    await e.stop()


# -- raw servers that misbehave ------------------------------------------------------------------

class Raw:
    """A raw asyncio server: `handler(n, reader, writer)` is called for each request read
    (n counts requests over all connections); it answers (or not) as it likes."""

    def __init__(self, handler):
        self.handler = handler
        self.connections = 0
        self.requests = 0
        self.eofs = 0  # connections the client closed (EOF seen while waiting for a request)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.eofs += 1
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                self.requests += 1
                if await self.handler(self.requests, reader, writer) == "close":
                    return
        finally:
            writer.close()

    async def start(self) -> "Raw":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self.server.close()


def ok_answer(body: bytes = b'{"ok":1}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def raw(handler) -> Raw:
    return await Raw(handler).start()


# -- the client against aiohttp -------------------------------------------------------------------

async def test_post_json_keeps_one_connection_alive(engine):
    c = Http1Client("127.0.0.1", engine.port)
    for i in range(3):
        status, body = await c.post_json("/v1/completions", b'{"i": %d}' % i, 1.0)
        assert (status, body) == (200, COMPLETION)
    assert engine.bodies == [b'{"i": 0}', b'{"i": 1}', b'{"i": 2}']
    assert len(set(engine.peers)) == 1  # one connection, reused
    c.close()


async def test_status_and_body_of_an_error_answer(engine):
    engine.status, engine.answer = 503, b'{"error": "engine_paused"}'
    c = Http1Client("127.0.0.1", engine.port)
    assert await c.post_json("/v1/completions", b"{}", 1.0) == (503, b'{"error": "engine_paused"}')
    c.close()


async def test_idle_connection_closed_by_the_server_is_replaced():
    e = await Engine(keepalive_timeout=0.1).start()
    try:
        c = Http1Client("127.0.0.1", e.port)
        assert (await c.post_json("/v1/completions", b"{}", 1.0))[0] == 200
        await asyncio.sleep(0.4)  # the server drops the idle connection
        assert (await c.post_json("/v1/completions", b"{}", 1.0))[0] == 200
        assert len(set(e.peers)) == 2
        c.close()
    finally:
        await e.stop()


async def test_concurrent_requests_both_answered(engine):
    engine.delay = 0.1
    c = Http1Client("127.0.0.1", engine.port)
    results = await asyncio.gather(*(c.post_json("/v1/completions", b"{}", 2.0) for _ in range(3)))
    assert results == [(200, COMPLETION)] * 3
    assert (await c.post_json("/v1/completions", b"{}", 1.0))[0] == 200  # the kept one still works
    c.close()


async def test_connection_refused_is_an_oserror():
    c = Http1Client("127.0.0.1", free_port())
    with pytest.raises(ConnectionRefusedError):
        await c.post_json("/v1/completions", b"{}", 1.0)


# -- the client against servers that misbehave ----------------------------------------------------

def reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST instead of a FIN (SO_LINGER 0)."""
    writer.transport.get_extra_info("socket").setsockopt(
        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.mark.parametrize("how", ["fin", "rst"])
async def test_stale_keepalive_connection_is_retried_once_on_a_fresh_one(how):
    async def handler(n, reader, writer):
        if n == 2:  # the second request, on the first connection: closed unanswered
            if how == "rst":
                reset(writer)
            return "close"
        writer.write(ok_answer(b'{"n":%d}' % n))

    srv = await raw(handler)
    c = Http1Client("127.0.0.1", srv.port)
    assert await c.post_json("/x", b"{}", 1.0) == (200, b'{"n":1}')
    assert await c.post_json("/x", b"{}", 1.0) == (200, b'{"n":3}')  # retried on connection 2
    assert (srv.connections, srv.requests) == (2, 3)
    c.close()
    await srv.stop()


async def test_stale_connection_retried_only_once():
    async def handler(n, reader, writer):
        if n == 1:
            writer.write(ok_answer())
            return None
        return "close"  # every later request, on whatever connection

    srv = await raw(handler)
    c = Http1Client("127.0.0.1", srv.port)
    assert (await c.post_json("/x", b"{}", 1.0))[0] == 200
    with pytest.raises(HttpProtocolError, match="without answering"):
        await c.post_json("/x", b"{}", 1.0)
    assert (srv.connections, srv.requests) == (2, 3)
    await srv.stop()


async def refused(answer: bytes, match: str | None = None, *, linger: float = 0.5, timeout: float = 2.0,
                  **client: int) -> None:
    """A server that writes `answer`, waits `linger` s and closes: the request fails with
    HttpProtocolError (its message matching `match`)."""
    async def handler(n, reader, writer):
        writer.write(answer)
        await writer.drain()
        await asyncio.sleep(linger)
        return "close"

    srv = await raw(handler)
    c = Http1Client("127.0.0.1", srv.port, **client)
    with pytest.raises(HttpProtocolError, match=match):
        await c.post_json("/x", b"{}", timeout)
    await srv.stop()


@pytest.mark.parametrize("head, linger, match, timeout", [
    (b"HTTP/1.1 200 OK\r\nX-Big: " + b"h" * 100000 + b"\r\n\r\n", 0.5, "header larger", 2.0),  # oversized
    (b"HTTP/1.1 200 OK\r\nContent-Le", 0.0, "mid-header", 1.0),  # closed mid-header
], ids=["oversized", "closed-mid-header"])
async def test_a_broken_header_is_a_protocol_error(head, linger, match, timeout):
    await refused(head, match, linger=linger, timeout=timeout)


async def test_fresh_connection_closed_without_answer_is_not_retried():
    async def handler(n, reader, writer):
        return "close"

    srv = await raw(handler)
    c = Http1Client("127.0.0.1", srv.port)
    with pytest.raises(HttpProtocolError, match="without answering"):
        await c.post_json("/x", b"{}", 1.0)
    assert srv.requests == 1
    await srv.stop()


async def answered_on_a_fresh_connection(c: Http1Client, srv) -> None:
    """After a broken first answer, the next request is answered, on a second connection."""
    assert await c.post_json("/x", b"{}", 1.0) == (200, b'{"ok":1}')
    assert srv.connections == 2
    c.close()
    await srv.stop()


async def test_close_mid_answer_is_a_protocol_error_and_the_next_request_reconnects():
    async def handler(n, reader, writer):
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"trunc")
            await writer.drain()
            return "close"
        writer.write(ok_answer())

    srv = await raw(handler)
    c = Http1Client("127.0.0.1", srv.port)
    with pytest.raises(HttpProtocolError, match="mid-body"):
        await c.post_json("/x", b"{}", 1.0)
    await answered_on_a_fresh_connection(c, srv)


async def test_no_answer_times_out_and_drops_the_connection():
    async def handler(n, reader, writer):
        if n == 1:
            await asyncio.sleep(5)  # never answers in time
        writer.write(ok_answer())

    srv = await raw(handler)
    c = Http1Client("127.0.0.1", srv.port)
    t0 = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        await c.post_json("/x", b"{}", 0.2)
    assert time.monotonic() - t0 < 1.0
    # The late answer must never be read as the next request's: a fresh connection answers.
    await answered_on_a_fresh_connection(c, srv)


async def test_chunked_answer_is_joined():
    async def handler(n, reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5;ext=1\r\n{\"a\":\r\n" b"3\r\n 1}\r\n" b"0\r\nX-Trailer: t\r\n\r\n")
        await writer.drain()
        if n == 1:  # and part of the next answer in a later packet, to read across writes
            return None

    srv = await raw(handler)
    c = Http1Client("127.0.0.1", srv.port)
    assert await c.post_json("/x", b"{}", 1.0) == (200, b'{"a": 1}')
    assert await c.post_json("/x", b"{}", 1.0) == (200, b'{"a": 1}')
    assert srv.connections == 1  # the connection survives a chunked answer read to its end
    c.close()
    await srv.stop()


async def test_connection_close_is_honoured():
    async def handler(n, reader, writer):
        writer.write(ok_answer(extra=b"Connection: close\r\n"))
        await writer.drain()
        # Keep our side open: the client must not wait for our close, nor reuse the connection.

    srv = await raw(handler)
    c = Http1Client("127.0.0.1", srv.port)
    assert (await c.post_json("/x", b"{}", 1.0))[0] == 200
    assert (await c.post_json("/x", b"{}", 1.0))[0] == 200
    assert srv.connections == 2
    c.close()
    await srv.stop()


async def test_body_ended_by_close_without_length():
    async def handler(n, reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\n\r\n" + b"y" * 70000)
        await writer.drain()
        return "close"

    srv = await raw(handler)
    c = Http1Client("127.0.0.1", srv.port)
    assert await c.post_json("/x", b"{}", 1.0) == (200, b"y" * 70000)
    await srv.stop()


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 2000000\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + (b"8000\r\n" + b"z" * 0x8000 + b"\r\n") * 3,
    b"HTTP/1.1 200 OK\r\n\r\n" + b"z" * 70000,
], ids=["content-length", "chunked", "until-close"])
async def test_oversized_body_is_refused(answer):
    await refused(answer, "cap", max_body=65536)


@pytest.mark.parametrize("answer", [b"SSH-2.0-OpenSSH\r\n\r\n", b"HTTP/1.1 2x0 OK\r\n\r\n",
                                    b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
                                    b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
                                    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
                                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
                                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"])
async def test_malformed_answers_are_protocol_errors(answer):
    await refused(answer)


async def test_interim_100_answer_is_skipped():
    async def handler(n, reader, writer):
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + ok_answer())

    srv = await raw(handler)
    c = Http1Client("127.0.0.1", srv.port)
    assert await c.post_json("/x", b"{}", 1.0) == (200, b'{"ok":1}')
    c.close()
    await srv.stop()


# -- the deep probe over it -------------------------------------------------------------------------

@pytest_asyncio.fixture(loop_scope="function")  # on the test's own loop
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


async def test_probe_ok_over_one_kept_connection(engine, session):
    p = Prober(session, f"http://127.0.0.1:{engine.port}", "tiny", 1.0)
    for _ in range(3):
        out = await p.generate()
        assert (out.ok, out.detail) == (True, "ok")
    assert len(set(engine.peers)) == 1
    assert json.loads(engine.bodies[0]) == {"model": "tiny", "prompt": "hi", "max_tokens": 1, "temperature": 0}
    p.close()


async def test_probe_outcomes_keep_their_words(engine, session):
    p = Prober(session, f"http://127.0.0.1:{engine.port}", "tiny", 1.0)
    engine.status, engine.answer = 503, b'{"error": {"type": "engine_paused", "message": "Engine is paused"}}'
    out = await p.generate()
    assert (out.ok, out.detail) == (True, "paused: generation held by /pause")
    engine.status, engine.answer = 500, b'{"error": "boom"}'
    out = await p.generate()
    assert (out.ok, out.detail) == (False, 'generate 500: {"error": "boom"}')
    engine.status, engine.answer = 200, b'{"choices": []}'
    out = await p.generate()
    assert (out.ok, out.detail) == (False, "generate: no choices in answer")
    engine.answer = b"not json"
    out = await p.generate()
    assert not out.ok and out.detail.startswith("generate: JSONDecodeError")
    p.close()


async def test_probe_refused_and_timed_out(engine, session):
    p = Prober(session, f"http://127.0.0.1:{free_port()}", "tiny", 1.0)
    assert (await p.generate()).detail == "generate: connection refused"
    engine.delay = 1.0
    p = Prober(session, f"http://127.0.0.1:{engine.port}", "tiny", 0.2)
    out = await p.generate()  # late, and the counters did not move between two readings: a failure
    assert (out.ok, out.detail) == (False, "timeout after 0.2s, no progress")
    assert engine.metric_reads == 2  # two readings of the counters, both taken now
    p.close()


async def test_probe_cut_short_answer_is_a_failed_probe(session):
    async def handler(n, reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{")
        await writer.drain()
        return "close"

    srv = await raw(handler)
    p = Prober(session, f"http://127.0.0.1:{srv.port}", "tiny", 1.0)
    out = await p.generate()
    assert not out.ok and out.detail.startswith("generate: HttpProtocolError: connection closed mid-body")
    await srv.stop()


async def test_probe_close_means_a_new_connection_for_a_new_process(session):
    e = await Engine().start()
    port = e.port
    p = Prober(session, f"http://127.0.0.1:{port}", "tiny", 1.0)
    assert (await p.generate()).ok
    p.close()  # what the runner does when an incarnation ends
    assert (await p.generate()).ok
    assert len(set(e.peers)) == 2
    await e.stop()
    # A new process on the same port: probed on its own connection.
    e2 = await Engine().start(port)
    try:
        p.close()
        assert (await p.generate()).ok
        assert len(e2.peers) == 1
    finally:
        p.close()
        await e2.stop()


def test_lean_client_only_for_plain_http():
    assert _lean_target("http://127.0.0.1:8000") == ("127.0.0.1", 8000, "/v1/completions")
    assert _lean_target("http://[::1]:9/prefix/") == ("::1", 9, "/prefix/v1/completions")
    assert _lean_target("https://engine:8000") is None  # no TLS here: stays on aiohttp
    assert _lean_target("http://engine:port") is None


async def test_probe_over_aiohttp_where_the_lean_client_cannot_go(engine, session):
    p = Prober(session, f"http://127.0.0.1:{engine.port}", "tiny", 1.0)
    p._lean_target = None  # as for an https engine
    assert (await p.generate()).detail == "ok"
    engine.status, engine.answer = 500, b'{"error": "boom"}'
    assert (await p.generate()).detail == 'generate 500: {"error": "boom"}'
    p = Prober(session, f"http://127.0.0.1:{free_port()}", "tiny", 1.0)
    p._lean_target = None
    assert (await p.generate()).detail == "generate: connection refused"


async def test_late_probe_of_a_stepping_engine_is_busy_not_failed(engine, session):
    """The counters rise between the two readings of a first late probe: progress, not a failure."""
    engine.delay, engine.tokens_per_read = 1.0, 4.0
    p = Prober(session, f"http://127.0.0.1:{engine.port}", "tiny", 0.2)
    out = await p.generate()
    assert out.ok and out.detail == "busy: probe late (>0.2s), 4 tokens processed meanwhile", out
    assert out.excuse is None  # progress needs no excuse
    assert engine.metric_reads == 2
    p.close()


async def test_an_engines_oversized_answers_are_not_buffered(session):
    """Review: a 256 MiB warm-up answer grew the daemon to 3.6 GB, a 128 MiB /metrics to 440 MB.
    /metrics past MAX_METRICS is no evidence, a warm-up answer past MAX_ANSWER a failed start."""
    from aiohttp import web

    from vime.supervisor.engine.probes import MAX_METRICS
    from vime.supervisor.engine.warmup import MAX_ANSWER, WarmupFailed, warm_up
    from vime.supervisor.config import WarmupPolicy

    big = b"x" * (max(MAX_METRICS, MAX_ANSWER) + 1)

    async def huge(request):
        return web.Response(body=big)

    app = web.Application()
    app.router.add_get("/metrics", huge)
    app.router.add_post("/v1/completions", huge)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        url = f"http://127.0.0.1:{port}"
        assert await Prober(session, url, "tiny", 1.0).progress() is None
        with pytest.raises(WarmupFailed, match=f"over {MAX_ANSWER} bytes"):
            await warm_up(url, "tiny", WarmupPolicy(requests=2))
    finally:
        await runner.cleanup()


def test_metrics_labels_end_on_their_line():
    """An unclosed '{' no longer scans the rest of the answer (quadratic on the event loop)."""
    from vime.supervisor.engine.probes import parse_progress

    text = "vllm:generation_tokens_total{\n" * 1000 + 'vllm:generation_tokens_total{engine="0"} 7.0\n'
    assert parse_progress(text).generation_tokens == 7.0
