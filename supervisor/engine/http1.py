"""A minimal HTTP/1.1 client for the heartbeat: one kept-alive connection to one engine.

Every healthy heartbeat is one POST /v1/completions, and aiohttp's client spends about 0.3 ms
of CPU on each (a third of a core at 1024 engines a second; docs/concepts.md). This sends one
small JSON body and reads one small answer on asyncio streams: Content-Length, chunked and
close-delimited bodies, a kept connection closed while idle (retried once), an answer capped at
a probe's size; no TLS, redirects, proxies, compression or pipelining. Errors are three kinds
for the prober: the connect's OSError, asyncio.TimeoutError, and HttpProtocolError for anything
wrong after connecting.
"""

from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import aiohttp

MAX_BODY = 1 << 20  # a probe's answer is a few hundred bytes; more is not an engine talking
MAX_HEAD = 1 << 16  # status line + headers (also asyncio's default stream buffer limit)


_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")

class HttpProtocolError(Exception):
    """The server's answer could not be read: cut short, malformed, or too large."""


class _NoAnswer(Exception):
    """The connection failed before any byte of the answer: a reused keep-alive connection
    that the server had closed. Internal: turned into a retry or an HttpProtocolError."""


class Http1Client:
    """One engine's (host, port): POST a body, get (status, body). Not thread-safe; safe to
    call concurrently from one event loop (a request made while another is in flight gets a
    connection of its own, closed after it)."""

    def __init__(self, host: str, port: int, *, max_body: int = MAX_BODY, headers: dict[str, str] | None = None):
        self.host = host
        self.port = port
        self.max_body = max_body
        netloc = f"[{host}]" if ":" in host else host  # an IPv6 literal needs brackets
        # Host plus fixed extra headers (Authorization for an engine behind --api-key).
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._host_header = f"Host: {netloc}:{port}\r\n{extra}".encode("latin-1")
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._busy = False  # the kept connection carries a request right now

    async def post_json(self, path: str, body: bytes, timeout: float) -> tuple[int, bytes]:
        """POST `body` (already JSON) to `path`; the whole exchange, connecting included,
        within `timeout` seconds. Returns the status and the (de-chunked) body."""
        request = b"".join((
            b"POST ", path.encode("ascii"), b" HTTP/1.1\r\n", self._host_header,
            b"Content-Type: application/json\r\nAccept: application/json\r\n"
            b"Content-Length: ", str(len(body)).encode("ascii"), b"\r\n\r\n", body))
        async with asyncio.timeout(timeout):
            if self._busy:
                return await self._one_off(request)
            self._busy = True
            try:
                return await self._on_kept(request)
            finally:
                self._busy = False

    def close(self) -> None:
        """Drop the kept connection (the next request opens a new one). Synchronous, so it
        is safe in `finally` blocks of cancelled tasks; the transport closes in the loop."""
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()

    # -- internals ---------------------------------------------------------------------------

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self.host, self.port, limit=MAX_HEAD)

    async def _on_kept(self, request: bytes) -> tuple[int, bytes]:
        reader, writer = self._reader, self._writer
        reused = writer is not None
        # Bytes or EOF waiting on an idle connection: the server closed it (or said
        # something unasked). Either way it cannot carry this request. (StreamReader has no
        # public "bytes buffered" test; _buffer has been its bytearray since Python 3.4.)
        if reader is not None and writer is not None and (
                reader.at_eof()
                or reader._buffer  # type: ignore[attr-defined]  # private: typeshed omits it
                or writer.is_closing()):
            self.close()
            reused = False
        try:
            if not reused or reader is None or writer is None:
                reader, writer = self._reader, self._writer = await self._connect()
            try:
                status, data, keep = await self._exchange(reader, writer, request)
            except _NoAnswer as e:
                self.close()
                if not reused:
                    raise HttpProtocolError(f"server closed the connection without answering ({e})") from None
                # The server closed the idle connection as we sent (keep-alive timeout, or a
                # restart behind the same port). Once more, on a fresh one. The server may have
                # read the request before it went, but sent no answer: a 1-token probe is
                # harmless to repeat.
                self._reader, self._writer = await self._connect()
                try:
                    status, data, keep = await self._exchange(self._reader, self._writer, request)
                except _NoAnswer as e2:
                    raise HttpProtocolError(f"server closed the connection without answering ({e2})") from None
        except BaseException:
            # Timeout (a cancellation in here), error, or our caller cancelled: the answer
            # was not fully read, so nothing on this connection can be trusted any more.
            self.close()
            raise
        if not keep:
            self.close()
        return status, data

    async def _one_off(self, request: bytes) -> tuple[int, bytes]:
        reader, writer = await self._connect()
        try:
            status, data, _keep = await self._exchange(reader, writer, request)
        except _NoAnswer as e:
            raise HttpProtocolError(f"server closed the connection without answering ({e})") from None
        finally:
            writer.close()
        return status, data

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        request: bytes) -> tuple[int, bytes, bool]:
        """Send one request, read its whole answer: (status, body, connection reusable)."""
        try:
            writer.write(request)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                raise _NoAnswer("EOF") from None
            raise HttpProtocolError(f"connection closed mid-header after {len(e.partial)} bytes") from None
        except asyncio.LimitOverrunError:
            raise HttpProtocolError(f"answer header larger than {MAX_HEAD} bytes") from None
        except (ConnectionResetError, BrokenPipeError) as e:
            # A reset while sending or waiting for the head: in practice the server had closed
            # (or dropped) the connection before reading our request, so no answer was begun.
            raise _NoAnswer(type(e).__name__) from None
        except OSError as e:
            raise HttpProtocolError(f"connection lost: {type(e).__name__}: {e}") from None
        status, version, headers = _parse_head(head)
        while 100 <= status < 200:  # an interim answer (we never ask for one): skip it
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError) as e:
                raise HttpProtocolError(f"bad answer after {status}: {type(e).__name__}") from None
            status, version, headers = _parse_head(head)

        conn = headers.get(b"connection", b"").lower()
        keep = b"close" not in conn if version == b"HTTP/1.1" else b"keep-alive" in conn
        try:
            if status in (204, 304):
                data = b""
            elif b"transfer-encoding" in headers:
                if headers[b"transfer-encoding"].lower() != b"chunked":  # we never ask for gzip
                    raise HttpProtocolError(f"unsupported transfer-encoding {headers[b'transfer-encoding']!r}")
                data = await self._read_chunked(reader)
            elif b"content-length" in headers:
                raw = headers[b"content-length"]
                if not raw.isdigit():
                    raise HttpProtocolError(f"bad content-length {raw!r}")
                n = int(raw)
                if n > self.max_body:
                    raise HttpProtocolError(f"answer body of {n} bytes exceeds the {self.max_body} byte cap")
                data = await reader.readexactly(n)
            else:  # no length given: the body ends when the server closes
                data = await self._read_to_eof(reader)
                keep = False
        except asyncio.IncompleteReadError as e:
            raise HttpProtocolError(f"connection closed mid-body after {len(e.partial)} bytes") from None
        except asyncio.LimitOverrunError:
            raise HttpProtocolError("chunk-size line too long") from None
        except OSError as e:
            raise HttpProtocolError(f"connection lost mid-body: {type(e).__name__}: {e}") from None
        return status, data, keep

    async def _read_chunked(self, reader: asyncio.StreamReader) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            line = await reader.readuntil(b"\r\n")
            digits = line.split(b";", 1)[0].strip()  # chunk extensions ignored
            if not _HEX.fullmatch(digits):  # int(x, 16) would take "0x1f", "+1", "1_0"
                raise HttpProtocolError(f"bad chunk-size line {line[:40]!r}")
            size = int(digits, 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, discarded
                    pass
                return b"".join(parts)
            total += size
            if total > self.max_body:
                raise HttpProtocolError(f"chunked answer body exceeds the {self.max_body} byte cap")
            chunk = await reader.readexactly(size + 2)
            if chunk[-2:] != b"\r\n":
                raise HttpProtocolError("chunk not followed by CRLF")
            parts.append(chunk[:-2])

    async def _read_to_eof(self, reader: asyncio.StreamReader) -> bytes:
        parts, total = [], 0
        while chunk := await reader.read(65536):
            total += len(chunk)
            if total > self.max_body:
                raise HttpProtocolError(f"answer body exceeds the {self.max_body} byte cap")
            parts.append(chunk)
        return b"".join(parts)


def _parse_head(head: bytes) -> tuple[int, bytes, dict[bytes, bytes]]:
    """Status line and headers (names lower-cased; a repeated header keeps its last value,
    except Content-Length, where differing values are an error)."""
    lines = head[:-4].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or len(parts[1]) != 3 or not parts[1].isdigit():
        raise HttpProtocolError(f"not an HTTP/1.x status line: {lines[0][:60]!r}")
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise HttpProtocolError(f"malformed header line {line[:60]!r}")
        name, value = name.strip().lower(), value.strip()
        if name == b"content-length" and headers.get(name, value) != value:
            raise HttpProtocolError("conflicting content-length headers")
        headers[name] = value
    return int(parts[1]), parts[0], headers


async def read_bounded(response: "aiohttp.ClientResponse", limit: int) -> bytes | None:
    """The body of an answer read over aiohttp (the rare reads, the warm-up), or None past
    `limit` bytes: an engine's answer is untrusted input, never buffered whole whatever its
    size (this client's own answers are bounded by max_body)."""
    chunks, size = [], 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
