"""The one pooled HTTP client the app uses towards the upstream (and the summarizer).

httpx is the API; the wire is `proxy.wire` (a small httptools client) for every request to
a plain-http upstream, aiohttp (`proxy.aiowire`) for https, httpx's own transport through
an egress proxy (`proxy.egress`). On every request httpcore's pool walks all its
connections (an O(n^2) idle count, a poll() per idle socket), so a plain httpx relay loses
about two thirds of its throughput from concurrency 1 to 64; neither of these does. Numbers
and the other options measured: bench/README.md, `python -m bench.transports`.

`UpstreamTransport` is an `httpx.AsyncBaseTransport` that sends with one of them; both
raise httpx's errors: refused -> ConnectError; connect/read/pool timeouts -> ConnectTimeout,
ReadTimeout, PoolTimeout. httpx's write timeout is not applied. aiohttp is imported only
when the transport is built with `https=True` (at start-up, from the configured URLs: the
app's `lifespan`), never on a request: its import holds ~9 MB of RSS, and a transport built
without it refuses https URLs (UnsupportedProtocol, a 502). aiohttp does not enforce
`max_keepalive_connections` (idle ones expire after keepalive_expiry), `proxy.wire` does;
both share one count of `max_connections` slots. Header bytes cross unchanged:
`proxy.wire` writes them as given; aiohttp writes header text as UTF-8, so an https
request whose header bytes are not UTF-8 (latin-1 from `requests` or Node) goes through
httpx's own transport, which writes bytes as given. A request is sent once: neither wire
resends it when a reused keep-alive connection drops, since the upstream may already have
acted on the first. `slots` counts the pool's in-use and free connection slots. Which wire
a client gets is chosen by whoever builds it (`create_app(transport=...)`); the app's
default, `ServedTransport`, is httpx's own transport in-process and this one once served.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from proxy import wire
from proxy.clearance import Clearance
from proxy.egress import proxy_mounts
from proxy.settings import UpstreamSettings

if TYPE_CHECKING:
    from proxy.aiowire import AiohttpWire


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


class _NoCookies(httpx.Cookies):
    """A shared client keeps no upstream cookies: one user's would go to the next.

    (Also skips httpx's per-response cookie parsing, ~15% of the client's CPU per request.)
    """

    def extract_cookies(self, response: httpx.Response) -> None:
        return None


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


_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


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


_LENGTH_HEADERS = (b"content-length", b"transfer-encoding")


def _streamed_head(
    headers: list[tuple[bytes, bytes]],
) -> tuple[list[tuple[bytes, bytes]], int | None]:
    """The headers of a request whose body is streamed, as `proxy.wire` frames it, and the
    body's length: its Content-Length when given without a Transfer-Encoding, else None and
    the body chunked (`Transfer-Encoding: chunked` added unless given, as httpx adds it for
    a body of unknown length; a Content-Length beside it dropped, as RFC 9112 asks)."""
    codings = [value for name, value in headers if name.lower() == b"transfer-encoding"]
    lengths = [value for name, value in headers if name.lower() == b"content-length"]
    if not codings and len(lengths) == 1 and lengths[0].strip().isdigit():
        return headers, int(lengths[0])
    if codings and b",".join(codings).rstrip().lower().endswith(b"chunked"):
        return [(name, value) for name, value in headers if name.lower() != b"content-length"], None
    kept = [(name, value) for name, value in headers if name.lower() not in _LENGTH_HEADERS]
    return [*kept, (b"Transfer-Encoding", b"chunked")], None


def _chunked(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name.lower() == b"transfer-encoding" for name, _ in headers)


class UpstreamTransport(httpx.AsyncBaseTransport):
    """`https`: build the https wire (aiohttp) too; without it, https URLs are refused."""

    def __init__(self, limits: httpx.Limits, *, https: bool = False) -> None:
        self._limits = limits
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: _Slots | None = None
        self._fallback: httpx.AsyncHTTPTransport | None = None
        self._wire = self._new_wire_pool()
        self._tls: AiohttpWire | None = None
        if https:
            from proxy.aiowire import AiohttpWire  # ~9 MB of RSS: only for an https upstream

            self._tls = AiohttpWire(limits.keepalive_expiry)

    @property
    def https(self) -> bool:
        """Built to carry https requests (aiohttp imported)."""
        return self._tls is not None

    def _new_wire_pool(self) -> wire.WirePool:
        return wire.WirePool(self._limits.keepalive_expiry, self._limits.max_keepalive_connections)

    @property
    def slots(self) -> PoolSlots:
        """In-use and free slots of the pool in the current event loop (all free before use)."""
        if self._slots is None:
            limit = self._limits.max_connections or 1 << 30
            return PoolSlots(in_use=0, free=limit)
        return self._slots.counts

    def warm(self) -> None:
        """Bind the pool to the running loop now, and build the https session if there is
        one (the TLS context alone, certifi's bundle loaded, takes ~20 ms), not on the
        first request."""
        self._bind_loop(asyncio.get_running_loop())
        if self._tls is not None:
            self._tls.warm()

    async def preconnect(self, url: httpx.URL, timeout_s: float) -> None:
        """Open one connection (TCP, and TLS for https) to `url`'s host and leave it idle in
        the pool, as a finished request would: the first request then skips the handshake.
        Not one byte of HTTP is written. Raises httpx's errors (ConnectError, ConnectTimeout).
        """
        self.warm()
        if url.scheme == "http":
            idle = await self._wire.connect((url.host, url.port or 80), timeout_s)
            self._wire.put(idle)
            return
        await self._https_wire(url).preconnect(url, timeout_s)

    def _https_wire(self, url: httpx.URL) -> AiohttpWire:
        if url.scheme != "https":
            raise httpx.UnsupportedProtocol(
                f"the upstream URL's scheme {url.scheme!r} is not http(s)"
            )
        if self._tls is None:
            raise httpx.UnsupportedProtocol(
                "this upstream transport was built for plain-http upstreams only "
                "(UpstreamTransport(https=True) carries https)"
            )
        return self._tls

    def _bind_loop(self, loop: asyncio.AbstractEventLoop) -> _Slots:
        if self._loop is not loop or self._slots is None:
            # Lazily, in the running loop: the app builds its client before the loop starts,
            # and in-process tests may run it in more than one loop.
            if self._tls is not None:
                self._tls.retire()
            self._wire.close()
            self._wire = self._new_wire_pool()
            self._slots = _Slots(self._limits.max_connections or 1 << 30)
            self._loop = loop
        return self._slots

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        slots = self._bind_loop(asyncio.get_running_loop())
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        await slots.acquire(timeouts.get("pool"))
        try:
            url, stream = request.url, request.stream
            known = isinstance(stream, httpx.ByteStream)
            if url.scheme == "http":
                content = request.content if known else None
                body = None if known else stream
                assert body is None or isinstance(body, httpx.AsyncByteStream)
                return await self._send_plain(
                    request.method, url, request.headers.raw, content, body, timeouts, slots
                )
            tls = self._https_wire(url)
            # The bytes (None if empty), or an async iterable aiohttp sends chunked (or by
            # Content-Length).
            data: Any = (request.content or None) if known else stream
            response = await tls.send(
                request.method,
                url,
                request.headers.raw,
                data,
                slots.release,
                timeouts,
                request.extensions.get("sni_hostname"),
            )
            if response is None:  # not UTF-8: httpx's transport writes bytes as given
                return await self._send_fallback(request, slots)
            return response
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
        tls = None if url.scheme == "http" else self._https_wire(url)
        slots = self._bind_loop(asyncio.get_running_loop())
        await slots.acquire(timeouts.get("pool"))
        try:
            if tls is None:
                return await self._send_plain(
                    method, url, raw, content, None, timeouts, slots, clearance
                )
            response = await tls.send(
                method, url, raw, content or None, slots.release, timeouts, None, clearance
            )
            if response is None:  # not UTF-8: httpx's transport writes bytes as given
                request = httpx.Request(method, url, headers=raw, content=content)
                request.extensions["timeout"] = timeouts
                if clearance is not None:
                    await clearance.cleared()
                return await self._send_fallback(request, slots)
            return response
        except BaseException:
            slots.release()
            raise

    async def _send_plain(
        self,
        method: str,
        url: httpx.URL,
        headers: list[tuple[bytes, bytes]],
        content: bytes | None,
        body: httpx.AsyncByteStream | None,
        timeouts: dict[str, float | None],
        slots: _Slots,
        clearance: Clearance | None = None,
    ) -> httpx.Response:
        """Over `proxy.wire`: a body of known length in one write (unless the headers say
        Transfer-Encoding: then chunked, as they say), a streamed one as it comes."""
        method = method.upper()
        length = None
        if body is None and content and _chunked(headers):
            body = httpx.ByteStream(content)
        if body is not None:
            headers, length = _streamed_head(headers)
            content = None
        data = wire.request_bytes(method, url, headers, content)
        if data is None:
            raise httpx.LocalProtocolError("a request header holds a line break")
        return await wire.send(
            self._wire,
            url,
            data,
            timeouts,
            slots.release,
            clearance,
            head=method == "HEAD",
            body=body,
            length=length,
        )

    async def _send_fallback(self, request: httpx.Request, slots: _Slots) -> httpx.Response:
        if self._fallback is None:
            self._fallback = httpx.AsyncHTTPTransport(limits=self._limits)
        response = await self._fallback.handle_async_request(request)
        stream = response.stream
        assert isinstance(stream, httpx.AsyncByteStream)
        response.stream = _FallbackStream(stream, slots)
        return response

    async def aclose(self) -> None:
        self._wire.close()
        if self._tls is not None:
            await self._tls.aclose()
        if self._fallback is not None:
            await self._fallback.aclose()
            self._fallback = None


class ServedTransport(httpx.AsyncBaseTransport):
    """httpx's own transport until the app is served, `UpstreamTransport` after.

    In-process use (`httpx.ASGITransport`, which sends no lifespan events) goes through
    `httpx.AsyncHTTPTransport`, the layer respx (default mode), pytest-httpx and hand-written
    mocks patch, so they see every upstream request with no setup. A server (`compaction-proxy
    serve`, `uvicorn --factory`, each `--workers` process) runs the app's lifespan, whose
    startup calls `serve()`: from then on requests take the fast path (`proxy.wire`, and
    aiohttp when an https URL is configured). (A server started with the lifespan off,
    `uvicorn --lifespan off`, keeps httpx's: slower, correct.)
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

    def serve(self, *, https: bool = False) -> None:
        """From now on, requests go over `UpstreamTransport` (`https`: built to carry https
        too; see `needs_https`)."""
        if self._served is None:
            self._served = UpstreamTransport(self._limits, https=https)

    def warm(self) -> None:
        """Once served: the pool bound to the running loop (see UpstreamTransport.warm)."""
        if self._served is not None:
            self._served.warm()

    @property
    def direct(self) -> UpstreamTransport | None:
        """The app's own transport once served (None before: httpx's own carries requests)."""
        return self._served

    @property
    def slots(self) -> PoolSlots | None:
        """The served pool's slots (httpx's own pool keeps no such count)."""
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


def needs_https(client: httpx.AsyncClient, urls: Iterable[str]) -> bool:
    """Some of `urls` are https and `client` would send them over its own transport (not an
    egress proxy's mount, see proxy.egress): that transport must be built with `https`."""
    for text in urls:
        url = httpx.URL(text)
        if url.scheme == "https" and isinstance(
            client._transport_for_url(url), UpstreamTransport | ServedTransport
        ):
            return True
    return False


def pool_slots(client: httpx.AsyncClient) -> PoolSlots | None:
    """The upstream pool's slot counts, when `client` runs on one of the transports here."""
    transport = client._transport
    if isinstance(transport, UpstreamTransport | ServedTransport):
        return transport.slots
    return None


def direct_transport(client: httpx.AsyncClient, url: httpx.URL) -> UpstreamTransport | None:
    """The app's own transport that carries `client`'s request to `url`, when the client picks
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


_DIRECT_STREAMS = wire.DirectStream


def upstream_limits(settings: UpstreamSettings) -> httpx.Limits:
    return httpx.Limits(
        max_connections=settings.max_connections,
        max_keepalive_connections=settings.max_keepalive_connections,
        keepalive_expiry=settings.keepalive_expiry_s,
    )


def create_upstream_client(
    settings: UpstreamSettings, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """Build the app's shared client (over `UpstreamTransport`, built for https when the
    base URL is, unless given a transport).

    With the app's own transports (this module's), egress proxies are mounted as httpx
    would mount them (`proxy.egress`); a transport of someone else's (a mock) carries every
    request, as in httpx. Timeouts are set per request by the caller.
    """
    limits = upstream_limits(settings)
    timeout = httpx.Timeout(settings.timeout_s, connect=settings.connect_timeout_s)
    own = transport is None or isinstance(transport, UpstreamTransport | ServedTransport)
    client = httpx.AsyncClient(
        transport=transport
        or UpstreamTransport(limits, https=httpx.URL(settings.base_url).scheme == "https"),
        mounts=proxy_mounts(settings, limits) if own else None,
        timeout=timeout,
        follow_redirects=False,
    )
    client._cookies = _NoCookies()  # the `cookies` setter would copy it into a plain Cookies
    return client
