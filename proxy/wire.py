"""A small HTTP/1.1 keep-alive client for the upstream: asyncio.Protocol + httptools (+ ssl).

It carries every request to an upstream reached directly (no egress proxy: those go to
httpx, `proxy.transport` picks), http or https, its header bytes written exactly as given:
a body of known length in one write, a streamed one (an async iterable) as it arrives, and
HEAD (whose reply has no body whatever its Content-Length says). Why not aiohttp, which
carried these before: a small chat request through it builds a ClientRequest, a writer
task, a StreamReader and a ClientResponse; here it is one write, one parser feed and one
future, about a fifth fewer instructions for the whole proxied request (`python -m
bench.memory instructions`); and its import alone held ~9 MB of RSS.

https: TLS by the event loop's own ssl transport with httpx's default context (certifi's
bundle, or SSL_CERT_FILE / SSL_CERT_DIR; certificate and host name verified), the host
(or the request's `sni_hostname`) as SNI, ALPN offering http/1.1 only; the handshake counts
in the connect timeout, and a refused certificate is a ConnectError saying why.

What it keeps of the aiohttp path: errors are httpx's (refused or unresolvable ->
ConnectError; connect over `connect` -> ConnectTimeout; no byte for `read` seconds while
waiting for the headers or a body chunk -> ReadTimeout; a reply cut short, unparsable or
over `MAX_HEAD_BYTES` of headers -> RemoteProtocolError), a request is sent once (no resend
on a dropped keep-alive connection), the body is handed on as it arrives (reading pauses
above `HIGH_WATER` buffered bytes), and closing a reply before its end closes the
connection, which the upstream sees. Idle connections are reused newest first, kept at
most `keepalive_expiry` seconds and at most `max_idle` of them per host.

A streamed request body is written by a task of its own (as aiohttp did), so a reply that
comes before the body has all gone up (a 413, a 401) is read at once. Each piece is written
as it comes, chunk-framed unless a Content-Length was given (then exactly that many bytes
must come); while the socket's write buffer is over its high-water mark the next piece
waits (up to `read` seconds for the upstream to take bytes: WriteTimeout). The read timeout
starts once the body has gone. A body that fails (the client left mid-upload) or comes out
longer or shorter than its Content-Length closes the connection without the body's end, so
the upstream sees an incomplete request, and the reply's wait raises WriteError. A
connection is kept only when both the body and the reply ended cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import cast

import httptools
import httpx

from proxy.clearance import Clearance

HIGH_WATER = 256 * 1024  # buffered body bytes above which the socket is not read
MAX_HEAD_BYTES = 1 << 20  # a reply's status line and headers
_HTTP_11 = {"http_version": b"HTTP/1.1"}
_LENGTH_HEADERS = (b"content-length", b"transfer-encoding")
_JOIN_BELOW = 64 * 1024  # a body up to this is copied behind the head: one write

Key = tuple[str, int, str | None]  # host, port, TLS server name (None: plain http)


class Connection(asyncio.Protocol):
    """One upstream connection, one exchange at a time; the parser's callbacks land here."""

    def __init__(self, pool: WirePool, key: Key) -> None:
        self.pool = pool
        self.key = key
        self.idle_since = 0.0
        self.closed = False
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._active = False  # an exchange is in progress
        self._head = False  # the request is a HEAD: its reply ends with its headers
        self._uploading: asyncio.Task[None] | None = None  # a streamed body being written
        self._read_timeout: float | None = None
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._reusable = False
        self._timeout: float | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._informational = False
        self._sized = False  # the reply has a Content-Length or Transfer-Encoding
        self._paused = False
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.error: httpx.TransportError | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # (uvloop's is no subclass)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if not self._active:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        if not self.headers_done:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._fail(httpx.RemoteProtocolError("the upstream's reply headers are too long"))
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            self._fail(httpx.RemoteProtocolError("unexpected data from the upstream"))
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(httpx.RemoteProtocolError(f"invalid HTTP reply from the upstream: {exc}"))
        else:
            waiter = self._waiter
            if self._timer is not None and waiter is not None and not waiter.done():
                self._timer.cancel()  # still waiting: the read timeout counts from this byte
                self._timer = self._loop.call_later(self._timeout or 0, self._timed_out)

    def eof_received(self) -> bool | None:
        return None  # close; connection_lost decides whether the reply was complete

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        self._wake_writer()
        if not self._active or self.complete or self.error is not None:
            return
        if self.headers_done and not self._sized:  # a body delimited by the close
            self.complete = True
            self._wake()
            return
        if self.headers_done:
            error = "the upstream closed the connection before the end of its reply"
        else:
            error = "the upstream closed the connection without a reply"
        if exc is not None:
            error = f"{error}: {exc}"
        self._fail(httpx.RemoteProtocolError(error), close=False)

    def pause_writing(self) -> None:  # (a body of known length is written whole regardless)
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writer()

    # -- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:  # a second reply to one request: the connection cannot be trusted
            raise ValueError("a second reply")

    def on_status(self, reason: bytes) -> None:
        self.reason = reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        if name.lower() in _LENGTH_HEADERS:
            self._sized = True

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # 1xx: another head follows
            self._informational = True
            self.headers = []
            self._sized = False
            return
        self.status = status
        self.headers_done = True
        if self._head:  # no body follows, whatever the headers say
            self.complete = True
            self._reusable = self._parser.should_keep_alive()
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self._head:  # bytes after a HEAD reply: the connection cannot be trusted
            self._reusable = False
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        if self._head:
            return
        self.complete = True
        self._reusable = self._parser.should_keep_alive()
        self._wake()

    # -- the exchange -----------------------------------------------------------------------

    def send(
        self,
        data: list[bytes],
        read_timeout: float | None,
        *,
        head: bool = False,
        body: AsyncIterable[bytes] | None = None,
        length: int | None = None,
    ) -> None:
        """Write the request (see request_bytes) and start a new reply; with `body`, start
        writing it after `data` (`length`: its Content-Length; None: chunk-framed)."""
        assert self._transport is not None
        self._active = True
        self._head = head
        self._read_timeout = read_timeout
        if len(data) == 1:
            self._transport.write(data[0])
        else:
            self._transport.writelines(data)
        if body is None:
            self._timeout = read_timeout
            return
        self._timeout = None  # the read timeout starts once the body has gone
        self._uploading = self._loop.create_task(self._upload(body, length))

    async def _upload(self, body: AsyncIterable[bytes], length: int | None) -> None:
        transport = self._transport
        assert transport is not None
        sent = 0
        try:
            async for chunk in body:
                if not chunk:
                    continue
                if self.closed:
                    raise httpx.WriteError("the upstream closed the connection during the upload")
                sent += len(chunk)
                if length is None:
                    transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
                elif sent > length:
                    raise httpx.LocalProtocolError(
                        f"the request body is longer than its Content-Length ({length})"
                    )
                else:
                    transport.write(chunk)
                if self._write_paused:
                    await self._drain()
            if self.closed:
                raise httpx.WriteError("the upstream closed the connection during the upload")
            if length is None:
                transport.write(b"0\r\n\r\n")
            elif sent != length:
                raise httpx.LocalProtocolError(
                    f"the request body ended after {sent} of its {length} bytes (Content-Length)"
                )
        except httpx.TransportError as exc:
            self._fail(exc)
            return
        except Exception as exc:  # the body's own source failed (its client left, mostly)
            error = httpx.WriteError(f"the request body broke off: {type(exc).__name__}")
            error.__cause__ = exc
            self._fail(error)
            return
        self._uploading = None
        self._timeout = self._read_timeout
        waiter = self._waiter
        if self._timeout is not None and waiter is not None and not waiter.done():
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_later(self._timeout, self._timed_out)

    async def _drain(self) -> None:
        """Until the socket's write buffer is below its low-water mark (or the connection is
        gone); WriteTimeout after the read timeout without the upstream taking bytes."""
        while self._write_paused and not self.closed:
            drained = self._drained = self._loop.create_future()
            try:
                async with asyncio.timeout(self._read_timeout):
                    await drained
            except TimeoutError:
                raise httpx.WriteTimeout("the upstream took no body bytes in time") from None
            finally:
                self._drained = None

    async def wait(self) -> None:
        """Until the parser or the connection says something new (or the read timeout)."""
        waiter = self._waiter = self._loop.create_future()
        if self._timeout is not None:
            self._timer = self._loop.call_later(self._timeout, self._timed_out)
        try:
            await waiter
        finally:
            self._waiter = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    async def next_chunk(self) -> bytes:
        """All of the body that has arrived and not been read (the pieces of one socket read,
        HTTP chunks or SSE events, go on together: one write to the client); b"" at its end."""
        while True:
            chunks = self.chunks
            if chunks:
                chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self.buffered = 0
                if self._paused:
                    self._paused = False
                    if self._transport is not None and not self.closed:
                        self._transport.resume_reading()
                return chunk
            if self.complete:  # (a later error, bytes past the reply, spoils only the connection)
                return b""
            if self.error is not None:
                raise self.error
            await self.wait()

    def finish(self) -> None:
        """The reply is done with: back to the pool if it (and the request's body) ended
        cleanly, else closed."""
        if (
            self.complete
            and self._reusable
            and not self.chunks
            and not self.closed
            and self._uploading is None
        ):
            self._reset()
            self.pool.put(self)
        else:
            self.close()

    def close(self) -> None:
        self._reusable = False
        uploading, self._uploading = self._uploading, None
        if uploading is not None and uploading is not asyncio.current_task():
            uploading.cancel()
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
            if self._transport is not None:
                self._transport.close()
            self._wake_writer()

    def _reset(self) -> None:
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        if self._head:  # the parser still expects the body the headers announced
            self._parser = httptools.HttpResponseParser(self)
            self._head = False
        self._active = False
        self._timeout = None
        self._read_timeout = None
        self._head_bytes = 0
        self._sized = False
        self.status = 0
        self.reason = b""
        self.headers = []
        self.headers_done = False
        self.complete = False

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_writer(self) -> None:
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    def _fail(self, error: httpx.TransportError, *, close: bool = True) -> None:
        if self.error is None:
            self.error = error
        self._wake()
        if close:
            self.close()

    def _timed_out(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is not None and waiter.done():
            # Bytes came in this same loop turn (asyncio runs a socket's callback before
            # the timers due in that turn): they arrived in time, and the wait is over.
            return
        self._fail(httpx.ReadTimeout("read timeout"))


class DirectStream(httpx.AsyncByteStream):
    """A reply's body read straight from the upstream's socket by one of the app's own wires
    (this one): `read()` takes the rest whole, and closing never suspends."""

    async def read(self) -> bytes:
        raise NotImplementedError


class WireStream(DirectStream):
    """A reply's body from a `Connection`; closing it frees the pool slot and either keeps
    the connection (the reply ended cleanly) or closes it. Closing never suspends."""

    def __init__(self, connection: Connection, release: Callable[[], None]) -> None:
        self._connection = connection
        self._release: Callable[[], None] | None = release

    @property
    def buffered(self) -> int:
        """Body bytes received and not yet read (bounded: see HIGH_WATER)."""
        return self._connection.buffered

    @property
    def arrived(self) -> bool:
        """Reading on does not wait: body bytes are here, or the body has ended."""
        connection = self._connection
        return bool(connection.chunks) or (connection.complete and connection.error is None)

    @property
    def ended(self) -> bool:
        """All of the body has been read (the next read ends the body at once)."""
        connection = self._connection
        return connection.complete and not connection.chunks and connection.error is None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        connection = self._connection
        while True:
            chunk = await connection.next_chunk()
            if not chunk:
                return
            yield chunk

    async def read(self) -> bytes:
        """The whole body (what iterating it would give, in one piece)."""
        next_chunk = self._connection.next_chunk
        parts = []
        while chunk := await next_chunk():
            parts.append(chunk)
        return b"".join(parts)

    async def aclose(self) -> None:
        release = self._release
        if release is None:
            return
        self._release = None
        try:
            self._connection.finish()
        finally:
            release()


class WirePool:
    """Idle connections per (host, port, TLS name), newest last; every connection it opened,
    to close. The TLS context is httpx's default one (certifi's bundle, or SSL_CERT_FILE /
    SSL_CERT_DIR; certificates and host names verified), offering only http/1.1 by ALPN,
    built on the first https connection (or by `tls_context`, at start-up)."""

    def __init__(
        self,
        keepalive_expiry: float | None,
        max_idle: int | None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._expiry = keepalive_expiry
        self._max_idle = max_idle
        self._idle: dict[Key, list[Connection]] = {}
        self._open: set[Connection] = set()
        self.tls = tls

    def tls_context(self) -> ssl.SSLContext:
        if self.tls is None:
            context = httpx.create_ssl_context()
            context.set_alpn_protocols(["http/1.1"])
            self.tls = context
        return self.tls

    def take(self, key: Key) -> Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if connection.closed:
                continue
            if self._expiry is not None and now - connection.idle_since > self._expiry:
                connection.close()
                continue
            return connection
        return None

    def put(self, connection: Connection) -> None:
        idle = self._idle.setdefault(connection.key, [])
        now = time.monotonic()
        connection.idle_since = now
        idle.append(connection)
        expiry, limit = self._expiry, self._max_idle
        while idle and (
            (limit is not None and len(idle) > limit)
            or (expiry is not None and now - idle[0].idle_since > expiry)
        ):
            idle[0].close()  # the oldest (close() takes it off the list)

    def forget(self, connection: Connection) -> None:
        self._open.discard(connection)
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)

    async def connect(self, key: Key, wait_s: float | None) -> Connection:
        """A new connection (TCP, then TLS when `key` names a server), all under `wait_s`."""
        loop = asyncio.get_running_loop()
        host, port, server_name = key
        context = None if server_name is None else self.tls_context()
        handshake = wait_s if context is not None else None  # (only meaningful with TLS)
        try:
            async with asyncio.timeout(wait_s):
                _, connection = await loop.create_connection(
                    lambda: Connection(self, key),
                    host,
                    port,
                    ssl=context,
                    server_hostname=server_name,
                    ssl_handshake_timeout=handshake,
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"timed out connecting to {host}:{port}") from None
        except ssl.SSLCertVerificationError as exc:
            raise httpx.ConnectError(
                f"the TLS certificate of {host}:{port} was refused: {exc.verify_message}"
            ) from None
        except ssl.SSLError as exc:
            reason = exc.reason or exc
            raise httpx.ConnectError(f"TLS handshake with {host}:{port} failed: {reason}") from None
        except OSError as exc:  # refused, unreachable, DNS
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from None
        self._open.add(connection)
        return connection

    def close(self) -> None:
        """Close every connection (idle or in use); safe when their loop is gone."""
        for connection in list(self._open):
            with contextlib.suppress(RuntimeError):  # a closed loop cannot schedule anything
                connection.close()
        self._open.clear()
        self._idle.clear()


def key_of(url: httpx.URL, server_name: str | None = None) -> Key:
    """The pool key of `url` (http or https; `server_name`: the TLS name, else the host)."""
    if url.scheme == "https":
        return (url.host, url.port or 443, server_name or url.host)
    return (url.host, url.port or 80, None)


def request_bytes(
    method: str, url: httpx.URL, headers: list[tuple[bytes, bytes]], content: bytes | None
) -> list[bytes] | None:
    """The request as it goes on the wire, in pieces to write (`headers` complete: Host and
    Content-Length included); None if a header would break the framing (a CR or LF in a
    name or value)."""
    lines = [b"%s %s HTTP/1.1" % (method.encode("ascii"), url.raw_path)]
    lines += [b"%s: %s" % pair for pair in headers]
    lines.append(b"\r\n")
    head = b"\r\n".join(lines)
    breaks = len(lines)  # one CRLF between lines, plus the blank line's
    if head.count(b"\n") != breaks or head.count(b"\r") != breaks:
        return None
    if not content:
        return [head]
    if len(content) < _JOIN_BELOW:
        return [head + content]
    return [head, content]


async def send(
    pool: WirePool,
    url: httpx.URL,
    data: list[bytes],
    timeouts: dict[str, float | None],
    release: Callable[[], None],
    clearance: Clearance | None = None,
    *,
    head: bool = False,
    body: AsyncIterable[bytes] | None = None,
    length: int | None = None,
    server_name: str | None = None,
) -> httpx.Response:
    """`data` (see request_bytes) to `url`'s host; returns once the reply's headers are in.
    `release` is called when the reply is closed (on a failure here, the caller keeps it).
    With `clearance`, the connection is taken (or opened) first and nothing is written
    until it clears; refused, the connection goes back to the pool unused. `head`: the
    request is a HEAD. `body`: a streamed body, written after `data` (its head) as it comes,
    with `length` its Content-Length (None: `data` says Transfer-Encoding: chunked)."""
    key = key_of(url, server_name)
    connection = pool.take(key)
    if connection is None:
        connection = await pool.connect(key, timeouts.get("connect"))
    if clearance is not None:
        try:
            waiting = clearance.cleared()
            if waiting is not None:
                await waiting
        except BaseException:
            pool.put(connection)
            raise
        if connection.closed:  # the upstream closed it meanwhile, before a byte was written
            connection = pool.take(key) or await pool.connect(key, timeouts.get("connect"))
    try:
        connection.send(data, timeouts.get("read"), head=head, body=body, length=length)
        while not connection.headers_done:
            if connection.error is not None:
                raise connection.error
            await connection.wait()
    except BaseException:
        connection.close()
        raise
    extensions = _HTTP_11
    if connection.reason:
        extensions = {**_HTTP_11, "reason_phrase": connection.reason}
    return httpx.Response(
        connection.status,
        headers=connection.headers,
        stream=WireStream(connection, release),
        extensions=extensions,
    )
