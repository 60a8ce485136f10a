"""The one pooled HTTP client the app uses towards the upstream (and the summarizer).

httpx is the API; the wire is `proxy.wire` (a small httptools client) for plain-http
requests with a known body, aiohttp for the rest (https, HEAD, streamed request bodies).
On every request httpcore's pool walks all its connections (an O(n^2) idle count, a poll()
per idle socket), so a plain httpx relay loses about two thirds of its throughput from
concurrency 1 to 64; neither of these does. Numbers and the other options measured:
bench/README.md, `python -m bench.transports`.

`UpstreamTransport` is an `httpx.AsyncBaseTransport` that sends with one of them and maps
aiohttp's errors onto httpx's (`proxy.wire` raises httpx's itself): refused -> ConnectError;
connect/read/pool timeouts -> ConnectTimeout, ReadTimeout, PoolTimeout. httpx's write
timeout is not applied. aiohttp does not enforce `max_keepalive_connections` (idle ones
expire after keepalive_expiry), `proxy.wire` does; both share one count of
`max_connections` slots. Header bytes cross unchanged: `proxy.wire` writes them as given;
aiohttp writes header text as UTF-8, so such a request whose header bytes are not UTF-8
(latin-1 from `requests` or Node) goes through httpx's own transport, which writes bytes as
given. A request is sent once: `proxy.wire` never resends, and aiohttp's own resend of
idempotent requests when a reused keep-alive connection drops is off, since the upstream
may already have acted on the first. `slots` counts the pool's in-use and free connection
slots. Which wire a client gets is chosen by whoever builds it (`create_app(transport=...)`);
the app's default, `ServedTransport`, is httpx's own transport in-process and this one once
served.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
from yarl import URL

from proxy import wire
from proxy.clearance import Clearance
from proxy.egress import proxy_mounts
from proxy.settings import UpstreamSettings

# aiohttp adds these when absent; a proxy must send only what it was given.
_SKIP_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
_LARGE_BODY = 1 << 20  # aiohttp warns on bytes bodies above 1 MiB; BytesIO is sent in chunks
_HTTP_11 = {"http_version": b"HTTP/1.1"}


@dataclass(frozen=True)
class PoolSlots:
    """Connection slots of the upstream pool: one is held from send until the response closes."""

    in_use: int
    free: int


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


@contextlib.contextmanager
def _map_errors(*, sending: bool) -> Iterator[None]:
    """aiohttp -> httpx exceptions. Subclasses first: the first matching clause wins."""
    try:
        yield
    except aiohttp.ConnectionTimeoutError as exc:
        raise httpx.ConnectTimeout(str(exc) or "connect timeout") from exc
    except aiohttp.SocketTimeoutError as exc:
        raise httpx.ReadTimeout(str(exc) or "read timeout") from exc
    except aiohttp.ClientConnectorError as exc:  # refused, DNS, TLS
        raise httpx.ConnectError(str(exc)) from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        raise httpx.RemoteProtocolError(str(exc) or "server disconnected") from exc
    except aiohttp.ClientResponseError as exc:  # unparsable response
        raise httpx.RemoteProtocolError(exc.message) from exc
    except aiohttp.ClientConnectionResetError as exc:
        raise httpx.WriteError(str(exc)) from exc
    except (aiohttp.ClientConnectionError, OSError) as exc:
        error = httpx.WriteError if sending else httpx.ReadError
        raise error(str(exc) or type(exc).__name__) from exc
    except (aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError) as exc:
        raise httpx.UnsupportedProtocol(str(exc)) from exc
    except aiohttp.ClientError as exc:
        raise httpx.TransportError(str(exc) or type(exc).__name__) from exc


class _NoCookies(httpx.Cookies):
    """A shared client keeps no upstream cookies: one user's would go to the next.

    (Also skips httpx's per-response cookie parsing, ~15% of the client's CPU per request.)
    """

    def extract_cookies(self, response: httpx.Response) -> None:
        return None


class _ResponseStream(httpx.AsyncByteStream):
    """The body as it arrives; closing before the end closes the upstream connection."""

    def __init__(self, response: aiohttp.ClientResponse, slot: _Slots) -> None:
        self._response = response
        self._slot: _Slots | None = slot

    async def __aiter__(self) -> AsyncIterator[bytes]:
        reader = self._response.content
        with _map_errors(sending=False):
            while True:
                try:
                    chunk = await reader.readany()
                except aiohttp.ClientError:
                    # readany() raises a stored failure before returning what it had already
                    # buffered; hand those last bytes over first, as a direct client gets them.
                    buffered = _buffered(reader)
                    if buffered:
                        yield buffered
                    raise
                if not chunk:
                    return
                yield chunk

    async def read(self) -> bytes:
        """The whole body (what iterating it would give, in one piece)."""
        with _map_errors(sending=False):
            return await self._response.content.read()

    async def aclose(self) -> None:  # never suspends (see closes_at_once)
        if self._slot is None:
            return
        self._slot.release()
        self._slot = None
        if self._response.content.at_eof():
            self._response.release()  # back to the pool
        else:
            self._response.close()  # abort: the upstream sees the connection drop


class _FallbackStream(httpx.AsyncByteStream):
    """A response of httpx's own transport that gives its pool slot back when closed."""

    def __init__(self, stream: httpx.AsyncByteStream, slot: _Slots) -> None:
        self._stream = stream
        self._slot: _Slots | None = slot

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            if self._slot is not None:
                self._slot.release()
                self._slot = None


def _headers_for_aiohttp(raw: list[tuple[bytes, bytes]]) -> list[tuple[str, str]] | None:
    """The headers as aiohttp wants them (text it writes as UTF-8); None if that would change
    a byte. Transfer-Encoding is aiohttp's to set for streamed bodies."""
    try:
        pairs = [(k.decode("utf-8"), v.decode("utf-8")) for k, v in raw]
    except UnicodeDecodeError:
        return None
    return [(k, v) for k, v in pairs if k.lower() != "transfer-encoding"]


_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_YARL_URLS: dict[str, URL] = {}


def _yarl_url(url: httpx.URL) -> URL:
    text = str(url)
    parsed = _YARL_URLS.get(text)
    if parsed is None:
        parsed = URL(text, encoded=True)
        if len(_YARL_URLS) >= 256:
            _YARL_URLS.clear()
        if not url.query:  # a query may carry a credential: not kept
            _YARL_URLS[text] = parsed
    return parsed


def _headers_as_httpx_sends(
    method: str, url: httpx.URL, headers: list[tuple[bytes, bytes]], content: bytes | None
) -> list[tuple[bytes, bytes]]:
    """The header list `httpx.Request(method, url, headers=headers, content=content)` builds:
    Host first (unless given), the headers as given, then Content-Length for a non-empty body
    (unless given), or `Content-Length: 0` for an empty POST/PUT/PATCH."""
    names = {name.lower() for name, _ in headers}
    raw = list(headers)
    if content and b"content-length" not in names:
        raw.append((b"Content-Length", str(len(content)).encode("ascii")))
        names.add(b"content-length")
    auto: list[tuple[bytes, bytes]] = []
    if b"host" not in names and url.host:
        auto.append((b"Host", url.netloc))
    if (
        b"content-length" not in names
        and b"transfer-encoding" not in names
        and method.upper() in _BODY_METHODS
    ):
        auto.append((b"Content-Length", b"0"))
    return auto + raw


def _on_the_wire(
    method: str, url: httpx.URL, headers: list[tuple[bytes, bytes]], content: bytes | None
) -> list[bytes] | None:
    """The request's bytes when `proxy.wire` carries it (a body of known length, or none, to
    a plain-http upstream, not a HEAD; see there), else None: aiohttp's."""
    method = method.upper()
    if method == "HEAD" or url.scheme != "http":
        return None
    if any(name.lower() == b"transfer-encoding" for name, _ in headers):
        return None
    return wire.request_bytes(method, url, headers, content)


def _waiting_for(clearance: Clearance) -> tuple[aiohttp.ClientMiddlewareType]:
    """aiohttp's hook between building a request and connecting and writing it."""

    async def middleware(
        request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
    ) -> aiohttp.ClientResponse:
        await clearance.cleared()
        return await handler(request)

    return (middleware,)


def _buffered(reader: aiohttp.StreamReader) -> bytes:
    """Bytes received but not yet read, without the stored-exception check (private API)."""
    read_nowait = getattr(reader, "_read_nowait", None)
    if read_nowait is None:
        return b""
    try:
        data = read_nowait(-1)
    except Exception:
        return b""
    return data if isinstance(data, bytes) else b""


def _retire(session: aiohttp.ClientSession) -> None:
    """Drop a session whose event loop is gone (or not ours), without awaiting in it."""
    connector = session.connector
    session.detach()  # marks it closed: no "Unclosed client session" warning
    if connector is not None:
        with contextlib.suppress(RuntimeError):  # a closed loop cannot schedule anything
            connector._close()  # sync part of close(): closes its sockets


class UpstreamTransport(httpx.AsyncBaseTransport):
    def __init__(self, limits: httpx.Limits) -> None:
        self._limits = limits
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: _Slots | None = None
        self._fallback: httpx.AsyncHTTPTransport | None = None
        self._timeouts: dict[tuple[Any, ...], aiohttp.ClientTimeout] = {}
        self._wire = self._new_wire_pool()

    def _new_wire_pool(self) -> wire.WirePool:
        return wire.WirePool(self._limits.keepalive_expiry, self._limits.max_keepalive_connections)

    def _new_session(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=0,  # the pool limit is `self._slots`, to raise PoolTimeout, not ConnectTimeout
            keepalive_timeout=self._limits.keepalive_expiry,
            ssl=httpx.create_ssl_context(),
        )
        session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=_SKIP_AUTO_HEADERS,
            auto_decompress=False,  # aiter_raw() is the wire bytes; httpx decodes the rest
            timeout=aiohttp.ClientTimeout(),
            max_line_size=65536,
            max_field_size=65536,
        )
        # No public switch: without it aiohttp resends GET/PUT/DELETE/... once by itself when a
        # reused connection drops, after the upstream may have acted on the first one.
        session._retry_connection = False
        return session

    @property
    def slots(self) -> PoolSlots:
        """In-use and free slots of the pool in the current event loop (all free before use)."""
        if self._slots is None:
            limit = self._limits.max_connections or 1 << 30
            return PoolSlots(in_use=0, free=limit)
        return self._slots.counts

    def _timeout(self, timeouts: dict[str, float | None]) -> aiohttp.ClientTimeout:
        key = (timeouts.get("connect"), timeouts.get("read"))
        timeout = self._timeouts.get(key)
        if timeout is None:  # DNS + TCP + TLS under `connect`; each socket read under `read`
            timeout = aiohttp.ClientTimeout(connect=key[0], sock_connect=key[0], sock_read=key[1])
            if len(self._timeouts) >= 64:
                self._timeouts.clear()
            self._timeouts[key] = timeout
        return timeout

    def warm(self) -> None:
        """Build the pool and its session in the running loop now, not on the first request
        (the TLS context alone, certifi's bundle loaded, takes ~20 ms)."""
        self._bind_loop(asyncio.get_running_loop())
        if self._session is None or self._session.closed:
            self._session = self._new_session()

    async def preconnect(self, url: httpx.URL, timeout_s: float) -> None:
        """Open one connection (TCP, and TLS for https) to `url`'s host and leave it idle in
        the pool, as a finished request would: the first request then skips the handshake.
        Not one byte of HTTP is written. Raises httpx's errors (ConnectError, ConnectTimeout).

        A plain-http URL's connection is `proxy.wire`'s, which carries its requests. For
        https, aiohttp has no call beyond `BaseConnector.connect` with a `ClientRequest` (both
        exported; the request is only read for its connection key: host, port, TLS, proxy),
        the same call its session makes before it writes a request."""
        self.warm()
        if url.scheme == "http":
            idle = await self._wire.connect((url.host, url.port or 80), timeout_s)
            self._wire.put(idle)
            return
        session = self._session_here()
        connector = session.connector
        if connector is None:
            return
        request = aiohttp.ClientRequest(
            "GET", _yarl_url(url), loop=asyncio.get_running_loop(), session=session
        )
        timeout = aiohttp.ClientTimeout(connect=timeout_s, sock_connect=timeout_s)
        with _map_errors(sending=True):
            connection = await connector.connect(request, [], timeout)
        connection.release()  # back to the pool, idle; it expires after keepalive_expiry

    def _bind_loop(self, loop: asyncio.AbstractEventLoop) -> _Slots:
        if self._loop is not loop or self._slots is None:
            # Lazily, in the running loop: the app builds its client before the loop starts,
            # and in-process tests may run it in more than one loop.
            if self._session is not None:
                _retire(self._session)
                self._session = None
            self._wire.close()
            self._wire = self._new_wire_pool()
            self._slots = _Slots(self._limits.max_connections or 1 << 30)
            self._loop = loop
        return self._slots

    def _session_here(self) -> aiohttp.ClientSession:
        session = self._session
        if session is None or session.closed:
            session = self._session = self._new_session()
        return session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        slots = self._bind_loop(asyncio.get_running_loop())
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        await slots.acquire(timeouts.get("pool"))
        try:
            if isinstance(request.stream, httpx.ByteStream):
                wired = _on_the_wire(
                    request.method, request.url, request.headers.raw, request.content
                )
                if wired is not None:
                    return await wire.send(self._wire, request.url, wired, timeouts, slots.release)
            headers = _headers_for_aiohttp(request.headers.raw)
            if headers is None:
                return await self._send_fallback(request, slots)
            # The bytes (None if empty), or an async iterable aiohttp sends chunked (or by
            # Content-Length).
            data: Any = request.stream
            if isinstance(data, httpx.ByteStream):
                data = request.content or None
            return await self._send(
                self._session_here(),
                request.method,
                URL(str(request.url), encoded=True),
                headers,
                data,
                slots,
                timeouts,
                request.extensions.get("sni_hostname"),
            )
        except BaseException:
            slots.release()
            raise

    async def send_bytes(
        self,
        method: str,
        url: httpx.URL,
        headers: list[tuple[bytes, bytes]],
        content: bytes | None,
        timeouts: dict[str, float | None],
        clearance: Clearance | None = None,
    ) -> httpx.Response:
        """`handle_async_request(httpx.Request(method, url, headers=headers, content=content))`
        (with `timeouts` as its timeout extension) without building the httpx.Request: the
        same header bytes go out in the same order and the same errors come back. Nothing
        is written before `clearance` clears; what it raises comes out as raised."""
        raw = _headers_as_httpx_sends(method, url, headers, content)
        data = _on_the_wire(method, url, raw, content)
        text = None if data is not None else _headers_for_aiohttp(raw)
        if data is None and text is None:  # not UTF-8: httpx's transport writes bytes as given
            request = httpx.Request(method, url, headers=raw, content=content)
            request.extensions["timeout"] = timeouts
            if clearance is not None:
                await clearance.cleared()
            return await self.handle_async_request(request)
        slots = self._bind_loop(asyncio.get_running_loop())
        await slots.acquire(timeouts.get("pool"))
        try:
            if data is not None:
                return await wire.send(self._wire, url, data, timeouts, slots.release, clearance)
            assert text is not None
            return await self._send(
                self._session_here(),
                method.upper(),
                _yarl_url(url),
                text,
                content or None,
                slots,
                timeouts,
                None,
                None if clearance is None else _waiting_for(clearance),
            )
        except BaseException:
            slots.release()
            raise

    async def _send_fallback(self, request: httpx.Request, slots: _Slots) -> httpx.Response:
        if self._fallback is None:
            self._fallback = httpx.AsyncHTTPTransport(limits=self._limits)
        response = await self._fallback.handle_async_request(request)
        stream = response.stream
        assert isinstance(stream, httpx.AsyncByteStream)
        response.stream = _FallbackStream(stream, slots)
        return response

    async def _send(
        self,
        session: aiohttp.ClientSession,
        method: str,
        url: URL,
        headers: list[tuple[str, str]],
        data: Any,
        slots: _Slots,
        timeouts: dict[str, float | None],
        sni_hostname: str | None,
        middlewares: tuple[aiohttp.ClientMiddlewareType, ...] | None = None,
    ) -> httpx.Response:
        if isinstance(data, bytes) and len(data) > _LARGE_BODY:
            data = io.BytesIO(data)
        with _map_errors(sending=True):
            response = await session.request(
                method,
                url,
                headers=headers,
                data=data,
                allow_redirects=False,
                timeout=self._timeout(timeouts),
                server_hostname=sni_hostname,
                middlewares=middlewares,
            )
        extensions = _HTTP_11
        if response.reason:
            reason = response.reason.encode("utf-8", errors="surrogateescape")
            extensions = {**_HTTP_11, "reason_phrase": reason}
        return httpx.Response(
            response.status,
            headers=response.raw_headers,
            stream=_ResponseStream(response, slots),
            extensions=extensions,
        )

    async def aclose(self) -> None:
        self._wire.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._fallback is not None:
            await self._fallback.aclose()
            self._fallback = None


class ServedTransport(httpx.AsyncBaseTransport):
    """httpx's own transport until the app is served, aiohttp's `UpstreamTransport` after.

    In-process use (`httpx.ASGITransport`, which sends no lifespan events) goes through
    `httpx.AsyncHTTPTransport`, the layer respx (default mode), pytest-httpx and hand-written
    mocks patch, so they see every upstream request with no setup. A server (`compaction-proxy
    serve`, `uvicorn --factory`, each `--workers` process) runs the app's lifespan, whose
    startup calls `serve()`: from then on requests take the fast aiohttp path. (A server
    started with the lifespan off, `uvicorn --lifespan off`, keeps httpx's: slower, correct.)
    """

    def __init__(self, limits: httpx.Limits) -> None:
        self._limits = limits
        self._in_process: httpx.AsyncHTTPTransport | None = None
        self._served: UpstreamTransport | None = None

    @property
    def served(self) -> bool:
        return self._served is not None

    @property
    def limits(self) -> httpx.Limits:
        return self._limits

    def serve(self) -> None:
        if self._served is None:
            self._served = UpstreamTransport(self._limits)

    def warm(self) -> None:
        """Once served: the pool's session built in the running loop (see UpstreamTransport)."""
        if self._served is not None:
            self._served.warm()

    @property
    def direct(self) -> UpstreamTransport | None:
        """The aiohttp transport once served (None before: httpx's own carries requests)."""
        return self._served

    @property
    def slots(self) -> PoolSlots | None:
        """The aiohttp pool's slots once served (httpx's own pool keeps no such count)."""
        return self._served.slots if self._served is not None else None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._served is not None:
            return await self._served.handle_async_request(request)
        if self._in_process is None:
            self._in_process = httpx.AsyncHTTPTransport(limits=self._limits)
        return await self._in_process.handle_async_request(request)

    async def aclose(self) -> None:
        for transport in (self._in_process, self._served):
            if transport is not None:
                await transport.aclose()


def pool_slots(client: httpx.AsyncClient) -> PoolSlots | None:
    """The upstream pool's slot counts, when `client` runs on one of the transports here."""
    transport = client._transport
    if isinstance(transport, UpstreamTransport | ServedTransport):
        return transport.slots
    return None


def direct_transport(client: httpx.AsyncClient, url: httpx.URL) -> UpstreamTransport | None:
    """The aiohttp transport that carries `client`'s request to `url`, when the client picks
    it (so not a proxy mount, see proxy.egress, nor a mock that patches the client) and the
    app is served (see ServedTransport). Such a request can go to it without httpx building
    and sending it (`UpstreamTransport.send_bytes`)."""
    transport = client._transport_for_url(url)
    if isinstance(transport, ServedTransport):
        return transport.direct
    return transport if isinstance(transport, UpstreamTransport) else None


def read_whole(response: httpx.Response) -> Coroutine[Any, Any, bytes] | None:
    """Reading `response`'s raw body to the end, straight from the wire (None: another
    transport's response; iterate `aiter_raw()`). Any failure is httpx's, as when iterating."""
    stream = response.stream
    return stream.read() if isinstance(stream, _DIRECT_STREAMS) else None


def closes_at_once(response: httpx.Response) -> bool:
    """Closing `response` cannot suspend (a response of this transport's own, not httpx's):
    no cancellation can land in the middle of it, so it needs no shield."""
    return isinstance(response.stream, _DIRECT_STREAMS)


_DIRECT_STREAMS = (_ResponseStream, wire.WireStream)


def upstream_limits(settings: UpstreamSettings) -> httpx.Limits:
    return httpx.Limits(
        max_connections=settings.max_connections,
        max_keepalive_connections=settings.max_keepalive_connections,
        keepalive_expiry=settings.keepalive_expiry_s,
    )


def create_upstream_client(
    settings: UpstreamSettings, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """Build the app's shared client (over aiohttp unless given a transport).

    With the app's own transports (this module's), egress proxies are mounted as httpx
    would mount them (`proxy.egress`); a transport of someone else's (a mock) carries every
    request, as in httpx. Timeouts are set per request by the caller.
    """
    limits = upstream_limits(settings)
    timeout = httpx.Timeout(settings.timeout_s, connect=settings.connect_timeout_s)
    own = transport is None or isinstance(transport, UpstreamTransport | ServedTransport)
    client = httpx.AsyncClient(
        transport=transport or UpstreamTransport(limits),
        mounts=proxy_mounts(settings, limits) if own else None,
        timeout=timeout,
        follow_redirects=False,
    )
    client._cookies = _NoCookies()  # the `cookies` setter would copy it into a plain Cookies
    return client
