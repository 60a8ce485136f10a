"""The one pooled HTTP client the app uses towards the upstream (and the summarizer).

httpx is the API; the wire is `proxy.wire` (a small httptools client, TLS included) for
every request to an upstream reached directly, httpx's own transport through an egress
proxy (`proxy.egress`). On every request httpcore's pool walks all its connections (an
O(n^2) idle count, a poll() per idle socket), so a plain httpx relay loses about two thirds
of its throughput from concurrency 1 to 64; `proxy.wire` does not. Numbers and the other
options measured: bench/README.md, `python -m bench.transports`.

`UpstreamTransport` is an `httpx.AsyncBaseTransport` that sends with `proxy.wire`, which
raises httpx's errors: refused -> ConnectError; connect/read/pool timeouts -> ConnectTimeout,
ReadTimeout, PoolTimeout. httpx's write timeout is not applied (a streamed body waits up to
the read timeout for the upstream to take bytes). `max_connections` slots are counted here,
`max_keepalive_connections` and `keepalive_expiry` kept by the wire's pool. Header bytes
cross unchanged: they are written as given. A request is sent once: it is not resent when
a reused keep-alive connection drops, since the upstream may already have acted on the
first. `slots` counts the pool's in-use and free connection slots. Which wire
a client gets is chosen by whoever builds it (`create_app(transport=...)`); the app's
default, `ServedTransport`, is httpx's own transport in-process and this one once served.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from proxy import wire
from proxy.clearance import Clearance
from proxy.egress import proxy_mounts
from proxy.settings import UpstreamSettings


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
    """`https`: build the TLS context at start-up (`warm`) rather than on the first https
    connection (certifi's bundle loaded: ~20 ms)."""

    def __init__(self, limits: httpx.Limits, *, https: bool = False) -> None:
        self._limits = limits
        self._https = https
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: _Slots | None = None
        self._wire = self._new_wire_pool()

    @property
    def https(self) -> bool:
        """Built for an https upstream (its TLS context made at start-up)."""
        return self._https

    def _new_wire_pool(self, tls: ssl.SSLContext | None = None) -> wire.WirePool:
        limits = self._limits
        return wire.WirePool(limits.keepalive_expiry, limits.max_keepalive_connections, tls)

    @property
    def slots(self) -> PoolSlots:
        """In-use and free slots of the pool in the current event loop (all free before use)."""
        if self._slots is None:
            limit = self._limits.max_connections or 1 << 30
            return PoolSlots(in_use=0, free=limit)
        return self._slots.counts

    def warm(self) -> None:
        """Bind the pool to the running loop now, and for https build its TLS context, not
        on the first request."""
        self._bind_loop(asyncio.get_running_loop())
        if self._https:
            self._wire.tls_context()

    async def preconnect(self, url: httpx.URL, timeout_s: float) -> None:
        """Open one connection (TCP, and TLS for https) to `url`'s host and leave it idle in
        the pool, as a finished request would: the first request then skips the handshake.
        Not one byte of HTTP is written. Raises httpx's errors (ConnectError, ConnectTimeout).
        """
        self.warm()
        _check_scheme(url)
        idle = await self._wire.connect(wire.key_of(url), timeout_s)
        self._wire.put(idle)

    def _bind_loop(self, loop: asyncio.AbstractEventLoop) -> _Slots:
        if self._loop is not loop or self._slots is None:
            # Lazily, in the running loop: the app builds its client before the loop starts,
            # and in-process tests may run it in more than one loop.
            self._wire.close()
            self._wire = self._new_wire_pool(self._wire.tls)
            self._slots = _Slots(self._limits.max_connections or 1 << 30)
            self._loop = loop
        return self._slots

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        slots = self._bind_loop(asyncio.get_running_loop())
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        await slots.acquire(timeouts.get("pool"))
        try:
            stream = request.stream
            known = isinstance(stream, httpx.ByteStream)
            body = None if known else stream
            assert body is None or isinstance(body, httpx.AsyncByteStream)
            return await self._send(
                request.method,
                request.url,
                request.headers.raw,
                request.content if known else None,
                body,
                timeouts,
                slots,
                server_name=request.extensions.get("sni_hostname"),
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
        slots = self._bind_loop(asyncio.get_running_loop())
        await slots.acquire(timeouts.get("pool"))
        try:
            return await self._send(method, url, raw, content, None, timeouts, slots, clearance)
        except BaseException:
            slots.release()
            raise

    async def _send(
        self,
        method: str,
        url: httpx.URL,
        headers: list[tuple[bytes, bytes]],
        content: bytes | None,
        body: httpx.AsyncByteStream | None,
        timeouts: dict[str, float | None],
        slots: _Slots,
        clearance: Clearance | None = None,
        server_name: str | None = None,
    ) -> httpx.Response:
        """Over `proxy.wire`: a body of known length in one write (unless the headers say
        Transfer-Encoding: then chunked, as they say), a streamed one as it comes."""
        _check_scheme(url)
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
            server_name=server_name,
        )

    async def aclose(self) -> None:
        self._wire.close()


def _check_scheme(url: httpx.URL) -> None:
    if url.scheme not in ("http", "https"):
        raise httpx.UnsupportedProtocol(f"the upstream URL's scheme {url.scheme!r} is not http(s)")


class ServedTransport(httpx.AsyncBaseTransport):
    """httpx's own transport until the app is served, `UpstreamTransport` after.

    In-process use (`httpx.ASGITransport`, which sends no lifespan events) goes through
    `httpx.AsyncHTTPTransport`, the layer respx (default mode), pytest-httpx and hand-written
    mocks patch, so they see every upstream request with no setup. A server (`compaction-proxy
    serve`, `uvicorn --factory`, each `--workers` process) runs the app's lifespan, whose
    startup calls `serve()`: from then on requests take the fast path (`proxy.wire`, its
    TLS context made at start when an https URL is configured). (A server started with the
    lifespan off, `uvicorn --lifespan off`, keeps httpx's: slower, correct.)
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
        """From now on, requests go over `UpstreamTransport` (`https`: its TLS context made at
        start; see `needs_https`)."""
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
    egress proxy's mount, see proxy.egress): that transport is built with `https` (its TLS
    context made at start, not on the first request)."""
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


def arrived(response: httpx.Response) -> bool:
    """Reading `response`'s body on cannot wait: bytes of it are here, or it has ended (False
    for another transport's response: not known)."""
    stream = response.stream
    return isinstance(stream, wire.WireStream) and stream.arrived


def ended(response: httpx.Response) -> bool:
    """All of `response`'s body has been read from the wire (False: more may come, or not
    known)."""
    stream = response.stream
    return isinstance(stream, wire.WireStream) and stream.ended


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
