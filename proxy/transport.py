"""The app's one HTTP client towards the upstream and the summarizer: httpx's API over aiohttp.

Callers hold an `httpx.AsyncClient`; its transport, `UpstreamTransport`, sends each request
with aiohttp (one session per event loop), or through an egress proxy with httpx's own
transport (`proxy.egress`). Why aiohttp: httpcore's pool walks all its connections on every
request, so a plain httpx relay loses about two thirds of its throughput from concurrency 1
to 64, and aiohttp's pool does not (`python -m bench.transports`, bench/README.md).

What this layer adds to aiohttp, through its public API only:

- httpx's errors: refused or unresolvable -> ConnectError (a refused TLS certificate says
  why); connect (TCP and TLS) over `connect` -> ConnectTimeout; no byte for `read` seconds
  while waiting for the reply's head or a body piece -> ReadTimeout; no free slot within
  `pool` -> PoolTimeout; `read` seconds without the upstream taking a piece of a streamed
  request body -> WriteTimeout; a reply cut short or unparsable -> RemoteProtocolError.
- Sent once: aiohttp sends an idempotent request again when its connection drops before the
  reply (meant for a stale keep-alive connection); the upstream may have acted on the first,
  so a client middleware turns that failure into one aiohttp does not retry.
- Header bytes: the request's as given, except that aiohttp writes header text as UTF-8, so
  a value that is not UTF-8 (obs-text in latin-1), a name that is not ASCII, or a line break
  cannot go out as sent: `UnsendableHeader`, nothing written. No header of aiohttp's own
  (User-Agent, Accept, Accept-Encoding, Content-Type); the body framed by its Content-Length
  when given, else chunked. The reply's header bytes as received (trailers are dropped), its
  body as received (no content decoding), no cookies kept (one caller's would go to the next).
- Replies never relayed: a status outside 200-599, a transfer coding other than chunked
  (its body would pass as plain), and a body delimited only by the connection's close (a
  reset, or a TLS close without close_notify, cannot be told from its end by asyncio's
  transports, so a cut body would pass as complete): `UnrelayableReply`, before the head.
- HEAD goes on a connection of its own, closed after the reply: an upstream that sends a
  body after a HEAD reply could otherwise have those bytes read as the next request's reply.
- Known limits of aiohttp, kept: when a connection breaks mid-body, the bytes that arrived
  just before the break and were not yet read are dropped (the relay is aborted either way);
  a complete reply the upstream sends unasked on an idle pooled connection would be read as
  the next request's reply on it (bytes that are not a reply retire the connection).
- Pool: `max_connections` slots counted here (`slots`), one held from send until the
  response closes. Idle connections are closed by aiohttp `keepalive_expiry` seconds after
  their last use (its clean-up runs every `keepalive_expiry`: an idle connection is closed
  between one and two expiries after its last use, with no request needed, and is never
  reused past its expiry). `max_keepalive_connections = 0` turns keep-alive off; aiohttp has
  no other bound on idle connections than `max_connections`.
- TLS: httpx's default context (certifi's bundle, or SSL_CERT_FILE / SSL_CERT_DIR;
  certificate and host name verified), ALPN http/1.1, the host (or the request's
  `sni_hostname` extension) as the server name.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
from yarl import URL

from proxy.egress import Egress, egress_for
from proxy.settings import UpstreamSettings


@dataclass(frozen=True)
class PoolSlots:
    """Connection slots of the upstream pool: one is held from send until the response closes."""

    in_use: int
    free: int


class UnsendableHeader(httpx.LocalProtocolError):
    """A request header that cannot go upstream as the client sent it (nothing was written)."""


class UnrelayableReply(httpx.RemoteProtocolError):
    """A reply the proxy does not relay (see the module docstring); its request was sent."""


class _Slots:
    """`max_connections` slots; waiting for one is bounded by the pool timeout."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self._semaphore = asyncio.Semaphore(limit)

    async def acquire(self, wait_s: float | None) -> None:
        if self._semaphore.locked():
            try:
                async with asyncio.timeout(wait_s):
                    await self._semaphore.acquire()
            except TimeoutError:
                raise httpx.PoolTimeout("no free connection to the upstream") from None
        else:
            await self._semaphore.acquire()
        self.in_use += 1

    def release(self) -> None:
        self.in_use -= 1
        self._semaphore.release()

    @property
    def counts(self) -> PoolSlots:
        return PoolSlots(in_use=self.in_use, free=self.limit - self.in_use)


class _Silenced(logging.Filter):
    """Drops httpx's per-request INFO line: it prints the full URL, query string included
    (`?api-key=...`), and the proxy logs each request itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO and str(record.msg).startswith("HTTP Request:"))


_HTTPX_LOG = logging.getLogger("httpx")
if not any(isinstance(f, _Silenced) for f in _HTTPX_LOG.filters):
    _HTTPX_LOG.addFilter(_Silenced())


class _NoCookies(httpx.Cookies):
    """Keeps no cookie: reading a reply's Set-Cookie into the shared client's jar would send one
    caller's cookies with the next caller's requests (and parsing them costs CPU per reply)."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None


_NO_COOKIES = _NoCookies()


class UpstreamClient(httpx.AsyncClient):
    """httpx's client with an empty cookie jar that keeps nothing (see _NoCookies)."""

    @property
    def cookies(self) -> httpx.Cookies:
        return _NO_COOKIES

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        raise TypeError("the upstream client keeps no cookies")


class _Dropped(Exception):
    """The connection failed once the request was handed to it (not an aiohttp error, so
    aiohttp does not send the request again)."""


async def _sent_once(
    request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
) -> aiohttp.ClientResponse:
    """aiohttp client middleware around each attempt: see "Sent once" above."""
    try:
        return await handler(request)
    except aiohttp.ClientConnectorError:
        raise  # never connected, so never sent (and aiohttp does not resend these)
    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
        raise _Dropped(str(exc) or type(exc).__name__) from exc


# The methods aiohttp resends (see _sent_once); a POST or PATCH goes without the middleware.
_RESENDABLE = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"})
_ONCE = (_sent_once,)
# aiohttp adds these unless told not to; what the caller sent is what goes.
_NOT_OURS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
# A reply header line (or one field) longer than this is refused (aiohttp's default: 8 KiB).
_HEAD_FIELD_BYTES = 64 * 1024
_EMPTY_STATUSES = frozenset({204, 304})
_HTTP_11 = {"http_version": b"HTTP/1.1"}


def _session(limits: httpx.Limits, *, reuse: bool) -> aiohttp.ClientSession:
    """A session in the running loop; `reuse` False: each connection carries one request."""
    if reuse and limits.max_keepalive_connections != 0:
        connector = aiohttp.TCPConnector(
            limit=0,  # the slots here are the limit (and bound the wait for one)
            keepalive_timeout=limits.keepalive_expiry,
        )
    else:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),
        auto_decompress=False,
        skip_auto_headers=_NOT_OURS,
        cookie_jar=aiohttp.DummyCookieJar(),
        trust_env=False,
        max_line_size=_HEAD_FIELD_BYTES,
        max_field_size=_HEAD_FIELD_BYTES,
    )


class _Pool:
    """One event loop's sessions (HEAD's without keep-alive, made on first use) and slots."""

    def __init__(self, limits: httpx.Limits) -> None:
        self.loop = asyncio.get_running_loop()
        self.limits = limits
        self.slots = _Slots(limits.max_connections or 1 << 30)
        self.session = _session(limits, reuse=True)
        self._single: aiohttp.ClientSession | None = None

    def for_method(self, method: str) -> aiohttp.ClientSession:
        if method != "HEAD":
            return self.session
        if self._single is None:
            self._single = _session(self.limits, reuse=False)
        return self._single

    async def close(self) -> None:
        """Close every connection (a loop already closed has nothing left to close)."""
        for session in (self.session, self._single):
            if session is not None:
                await session.close()


class UpstreamTransport(httpx.AsyncBaseTransport):
    """aiohttp under httpx's transport interface (see the module docstring); requests to a
    URL an egress proxy routes go through httpx's transport for that proxy, counted in the
    same slots."""

    def __init__(self, limits: httpx.Limits, egress: Egress | None = None) -> None:
        self._limits = limits
        self._egress = egress
        self._pool: _Pool | None = None
        self._tls: ssl.SSLContext | None = None
        self._timeouts: dict[tuple[float | None, float | None], aiohttp.ClientTimeout] = {}

    @classmethod
    def for_settings(cls, settings: UpstreamSettings) -> UpstreamTransport:
        """The transport for these settings, egress proxies included."""
        limits = upstream_limits(settings)
        return cls(limits, egress_for(settings, limits))

    def proxy_for(self, url: str) -> str | None:
        """The egress proxy requests to `url` go through, redacted (None: directly)."""
        return None if self._egress is None else self._egress.describe(url)

    @property
    def slots(self) -> PoolSlots:
        """In-use and free slots of the pool in the current event loop (all free before use)."""
        if self._pool is None:
            limit = self._limits.max_connections or 1 << 30
            return PoolSlots(in_use=0, free=limit)
        return self._pool.slots.counts

    def warm(self, urls: Iterable[str] = ()) -> None:
        """Bind the pool to the running loop now and, when one of `urls` is https and reached
        directly, build the TLS context (certifi's bundle loaded: ~20 ms), not on the first
        request."""
        self._bind(asyncio.get_running_loop())
        for text in urls:
            url = httpx.URL(text)
            direct = self._egress is None or self._egress.proxy_for(url) is None
            if url.scheme == "https" and direct:
                self._tls_context()
                return

    def _bind(self, loop: asyncio.AbstractEventLoop) -> _Pool | None:
        """The running loop's pool, made now if there is none; the pool of another loop (tests
        may run the client in more than one) is returned, to be closed."""
        pool = self._pool
        if pool is not None and pool.loop is loop:
            return None
        self._pool = _Pool(self._limits)
        return pool

    async def _current(self) -> _Pool:
        old = self._bind(asyncio.get_running_loop())
        if old is not None:
            await old.close()
        assert self._pool is not None
        return self._pool

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            context = httpx.create_ssl_context()
            context.set_alpn_protocols(["http/1.1"])
            self._tls = context
        return self._tls

    def _timeout(self, connect: float | None, read: float | None) -> aiohttp.ClientTimeout:
        timeout = self._timeouts.get((connect, read))
        if timeout is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect, sock_read=read)
            if len(self._timeouts) < 64:
                self._timeouts[(connect, read)] = timeout
        return timeout

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        pool = await self._current()
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        await pool.slots.acquire(timeouts.get("pool"))
        try:
            proxied = None if self._egress is None else self._egress.transport_for(request.url)
            if proxied is not None:
                response = await proxied.handle_async_request(request)
                stream = response.stream
                assert isinstance(stream, httpx.AsyncByteStream)
                response.stream = _Held(stream, pool.slots)
                return response
            return await self._send(pool, request, timeouts)
        except BaseException:
            pool.slots.release()
            raise

    async def _send(
        self, pool: _Pool, request: httpx.Request, timeouts: dict[str, float | None]
    ) -> httpx.Response:
        url = request.url
        if url.scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(f"the URL's scheme {url.scheme!r} is not http(s)")
        method = request.method
        headers, length = _headers(request.headers.raw)
        if method == "HEAD":  # on a connection of its own, which aiohttp then says closes
            headers = [(name, value) for name, value in headers if name.lower() != "connection"]
        upload: _Upload | None = None
        try:
            data: Any = request.content or None
        except httpx.RequestNotRead:  # a body streamed as it arrives
            stream = request.stream
            assert isinstance(stream, httpx.AsyncByteStream)
            upload = _Upload(stream, length, timeouts.get("read"))
            data = upload.pieces()
        session = pool.for_method(method)
        send = session.request(
            method,
            URL(str(url), encoded=True),
            middlewares=_ONCE if method in _RESENDABLE else (),
            headers=headers,
            data=data,
            allow_redirects=False,
            timeout=self._timeout(timeouts.get("connect"), timeouts.get("read")),
            ssl=self._tls_context() if url.scheme == "https" else True,
            server_hostname=request.extensions.get("sni_hostname"),
        )
        try:
            if upload is None:
                reply = await send
            else:
                reply = await upload.sending(send)
        except Exception as exc:
            raise _failure(exc, url, upload) from None
        try:
            _check_relayable(reply, method, url)
        except UnrelayableReply:
            reply.close()
            raise
        return httpx.Response(
            reply.status,
            headers=list(reply.raw_headers),
            stream=_Reply(reply, pool.slots),
            extensions=_HTTP_11,
        )

    async def aclose(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()
        if self._egress is not None:
            await self._egress.aclose()


def _headers(raw: list[tuple[bytes, bytes]]) -> tuple[list[tuple[str, str]], int | None]:
    """The request's headers as aiohttp writes them back to the same bytes (its header text
    goes out as UTF-8), without Transfer-Encoding (aiohttp frames the body), and the body's
    Content-Length when given. Raises UnsendableHeader for one that cannot go out as sent."""
    headers = []
    length = None
    for name, value in raw:
        lower = name.lower()
        if lower == b"transfer-encoding":
            continue
        if b"\r" in value or b"\n" in value or b"\0" in value:
            raise UnsendableHeader(f"the request header {_shown(name)} holds a line break")
        if not name.isascii():
            raise UnsendableHeader(f"the request header name {_shown(name)} is not ASCII")
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            raise UnsendableHeader(
                f"the value of the request header {_shown(name)} is neither ASCII nor UTF-8 "
                "(the upstream client sends header text as UTF-8)"
            ) from None
        if lower == b"content-length" and value.strip().isdigit():
            length = int(value)
        headers.append((name.decode("ascii"), text))
    return headers, length


def _shown(name: bytes) -> str:
    return repr(name.decode("latin-1"))


def _check_relayable(reply: aiohttp.ClientResponse, method: str, url: httpx.URL) -> None:
    """Raise UnrelayableReply for a reply the proxy must not relay (see the docstring)."""
    status = reply.status
    if not 200 <= status <= 599:
        raise UnrelayableReply(f"status {status} is not a final HTTP status")
    headers = reply.headers
    codings = [
        coding.strip().lower()
        for value in headers.getall("Transfer-Encoding", ())
        for coding in value.split(",")
    ]
    if codings and codings != ["chunked"]:
        raise UnrelayableReply(
            f"its transfer coding is {', '.join(codings)!r}, and only chunked is supported"
        )
    if (
        not codings
        and "Content-Length" not in headers
        and method != "HEAD"
        and status not in _EMPTY_STATUSES
    ):
        raise UnrelayableReply(
            "it has neither a Content-Length nor chunked framing: its body would end with "
            "the connection's close, and a cut body could not be told from a whole one"
        )


def _failure(exc: Exception, url: httpx.URL, upload: _Upload | None) -> Exception:
    """httpx's error for what aiohttp (or the request body) raised before the reply's head."""
    if upload is not None and upload.failure is not None:
        return upload.failure
    where = f"{url.host}:{url.port or (443 if url.scheme == 'https' else 80)}"
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        error = exc.certificate_error
        why = getattr(error, "verify_message", None) or error
        return httpx.ConnectError(f"the TLS certificate of {where} was refused: {why}")
    if isinstance(exc, aiohttp.ClientConnectorSSLError):
        return httpx.ConnectError(f"TLS handshake with {where} failed: {exc.os_error}")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(f"cannot connect to {where}: {exc.os_error}")
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(f"timed out connecting to {where}")
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return httpx.ReadTimeout("read timeout")
    if isinstance(exc, TimeoutError):  # the upload's deadline (see _Upload)
        return httpx.WriteTimeout("the upstream took no request body bytes in time")
    if isinstance(exc, _Dropped | aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
        return httpx.RemoteProtocolError(
            f"the upstream closed the connection without a reply: {exc}"
        )
    if isinstance(exc, aiohttp.ClientResponseError):  # a head aiohttp could not parse
        return httpx.RemoteProtocolError(f"invalid HTTP reply from the upstream: {exc.message}")
    if isinstance(exc, aiohttp.InvalidURL):
        return httpx.UnsupportedProtocol(f"cannot send to {url.host!r}: {exc}")
    if isinstance(exc, aiohttp.ClientError | OSError):
        return httpx.RemoteProtocolError(f"the upstream connection failed: {exc}")
    return exc


class _Upload:
    """A request body streamed as it arrives: each piece handed to aiohttp as it comes, held
    to its Content-Length when one was given; a source that fails (its client left) or a
    body unlike its length is remembered as httpx's error, and aiohttp, seeing the piece
    iterator raise, closes the connection without the body's end. While aiohttp writes a
    piece, `deadline` (the send's timeout) allows it the read timeout."""

    def __init__(
        self, stream: httpx.AsyncByteStream, length: int | None, wait_s: float | None
    ) -> None:
        self._stream = stream
        self._length = length
        self._wait_s = wait_s
        self.deadline: asyncio.Timeout | None = None
        self.failure: httpx.TransportError | None = None

    async def sending(self, send: Awaitable[aiohttp.ClientResponse]) -> aiohttp.ClientResponse:
        """`await send` (which writes this body), under the deadline of the piece in hand."""
        try:
            async with asyncio.timeout(None) as deadline:
                self.deadline = deadline
                return await send
        finally:
            self.deadline = None

    def _taking(self, piece: bool) -> None:
        deadline = self.deadline
        if deadline is not None and self._wait_s is not None:
            when = asyncio.get_running_loop().time() + self._wait_s if piece else None
            deadline.reschedule(when)

    async def pieces(self) -> AsyncIterator[bytes]:
        length, sent = self._length, 0
        try:
            async for piece in self._stream:
                if not piece:
                    continue
                sent += len(piece)
                if length is not None and sent > length:
                    raise httpx.LocalProtocolError(
                        f"the request body is longer than its Content-Length ({length})"
                    )
                self._taking(True)
                yield piece
                self._taking(False)
            if length is not None and sent != length:
                raise httpx.LocalProtocolError(
                    f"the request body ended after {sent} of its {length} bytes (Content-Length)"
                )
        except httpx.TransportError as exc:
            self.failure = exc
            raise
        except Exception as exc:  # the body's own source failed (its client left, mostly)
            error = httpx.WriteError(f"the request body broke off: {type(exc).__name__}")
            error.__cause__ = exc
            self.failure = error
            raise error from exc


class _Reply(httpx.AsyncByteStream):
    """A reply's body as aiohttp receives it, a piece per read; closing it frees the slot and
    keeps the connection if the body ended, else closes it (the upstream sees that)."""

    def __init__(self, reply: aiohttp.ClientResponse, slots: _Slots) -> None:
        self._reply = reply
        self._slots: _Slots | None = slots

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for piece in self._reply.content.iter_any():
                yield piece
        except aiohttp.SocketTimeoutError:
            raise httpx.ReadTimeout("read timeout") from None
        except aiohttp.ClientPayloadError as exc:
            raise httpx.RemoteProtocolError(f"the upstream broke off its reply: {exc}") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise httpx.ReadError(f"the upstream connection failed: {exc}") from None

    async def aclose(self) -> None:
        slots, self._slots = self._slots, None
        if slots is None:
            return
        try:
            reply = self._reply
            if reply.content.at_eof():
                reply.release()
            else:
                reply.close()
        finally:
            slots.release()


class _Held(httpx.AsyncByteStream):
    """A proxied reply's body (httpx's transport): closing it frees the slot."""

    def __init__(self, stream: httpx.AsyncByteStream, slots: _Slots) -> None:
        self._stream = stream
        self._slots: _Slots | None = slots

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for piece in self._stream:
            yield piece

    async def aclose(self) -> None:
        slots, self._slots = self._slots, None
        if slots is None:
            return
        try:
            await self._stream.aclose()
        finally:
            slots.release()


def upstream_limits(settings: UpstreamSettings) -> httpx.Limits:
    return httpx.Limits(
        max_connections=settings.max_connections,
        max_keepalive_connections=settings.max_keepalive_connections,
        keepalive_expiry=settings.keepalive_expiry_s,
    )


def create_upstream_client(
    settings: UpstreamSettings, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """The app's shared client: over `transport` (a mock, httpx's own for respx) when given,
    which then carries every request, egress proxies unread, as in httpx; else over an
    `UpstreamTransport` for these settings. Timeouts are set per request by the caller."""
    return UpstreamClient(
        transport=transport or UpstreamTransport.for_settings(settings),
        timeout=httpx.Timeout(settings.timeout_s, connect=settings.connect_timeout_s),
        follow_redirects=False,
    )
