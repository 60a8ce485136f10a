"""aiohttp as the wire for https upstreams (until `proxy.wire` speaks TLS).

Imported only when a transport is built for an https upstream (`UpstreamTransport(...,
https=True)`, decided at start-up from the configured URLs): `import aiohttp` holds ~9 MB
of RSS (its connector builds two SSL contexts at import), which a plain-http proxy has no
use for (`tests/test_footprint.py`).

aiohttp's errors are mapped onto httpx's: refused -> ConnectError; connect/read timeouts ->
ConnectTimeout, ReadTimeout. aiohttp writes header text as UTF-8, so a request whose header
bytes are not UTF-8 is refused here (`send` returns None) and goes through httpx's own
transport, which writes bytes as given. aiohttp's own resend of idempotent requests when a
reused keep-alive connection drops is off, since the upstream may already have acted on
the first.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import httpx
from yarl import URL

from proxy import wire
from proxy.clearance import Clearance

# aiohttp adds these when absent; a proxy must send only what it was given.
_SKIP_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
_LARGE_BODY = 1 << 20  # aiohttp warns on bytes bodies above 1 MiB; BytesIO is sent in chunks
_HTTP_11 = {"http_version": b"HTTP/1.1"}


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


class _ResponseStream(wire.DirectStream):
    """The body as it arrives; closing before the end closes the upstream connection."""

    def __init__(self, response: aiohttp.ClientResponse, release: Callable[[], None]) -> None:
        self._response = response
        self._release: Callable[[], None] | None = release

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
        with _map_errors(sending=False):
            return await self._response.content.read()

    async def aclose(self) -> None:  # never suspends (see transport.closes_at_once)
        release = self._release
        if release is None:
            return
        self._release = None
        try:
            if self._response.content.at_eof():
                self._response.release()  # back to the pool
            else:
                self._response.close()  # abort: the upstream sees the connection drop
        finally:
            release()


def _text_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[str, str]] | None:
    """The headers as aiohttp wants them (text it writes as UTF-8); None if that would change
    a byte. Transfer-Encoding is aiohttp's to set for streamed bodies."""
    try:
        pairs = [(k.decode("utf-8"), v.decode("utf-8")) for k, v in raw]
    except UnicodeDecodeError:
        return None
    return [(k, v) for k, v in pairs if k.lower() != "transfer-encoding"]


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


class AiohttpWire:
    """One aiohttp session (built in the running loop, rebuilt in a new one); the caller
    holds the pool slots (`UpstreamTransport`), so the connector itself is unlimited."""

    def __init__(self, keepalive_expiry: float | None) -> None:
        self._keepalive_expiry = keepalive_expiry
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[tuple[Any, ...], aiohttp.ClientTimeout] = {}

    def _new_session(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=0,  # the pool limit is the transport's slots, to raise PoolTimeout
            keepalive_timeout=self._keepalive_expiry,
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

    def warm(self) -> None:
        """The session built now, in the running loop (the TLS context alone, certifi's
        bundle loaded, takes ~20 ms)."""
        self._here()

    def retire(self) -> None:
        """Drop the session of a loop that is gone (or not ours), without awaiting in it."""
        session, self._session = self._session, None
        if session is None:
            return
        connector = session.connector
        session.detach()  # marks it closed: no "Unclosed client session" warning
        if connector is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop cannot schedule anything
                connector._close()  # sync part of close(): closes its sockets

    def _here(self) -> aiohttp.ClientSession:
        session = self._session
        if session is None or session.closed:
            session = self._session = self._new_session()
        return session

    def _timeout(self, timeouts: dict[str, float | None]) -> aiohttp.ClientTimeout:
        key = (timeouts.get("connect"), timeouts.get("read"))
        timeout = self._timeouts.get(key)
        if timeout is None:  # DNS + TCP + TLS under `connect`; each socket read under `read`
            timeout = aiohttp.ClientTimeout(connect=key[0], sock_connect=key[0], sock_read=key[1])
            if len(self._timeouts) >= 64:
                self._timeouts.clear()
            self._timeouts[key] = timeout
        return timeout

    async def preconnect(self, url: httpx.URL, timeout_s: float) -> None:
        """One connection (TCP + TLS) left idle in the pool. aiohttp has no call for it beyond
        `BaseConnector.connect` with a `ClientRequest` (both exported; the request is only
        read for its connection key: host, port, TLS, proxy), the same call its session
        makes before it writes a request."""
        session = self._here()
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

    async def send(
        self,
        method: str,
        url: httpx.URL,
        raw_headers: list[tuple[bytes, bytes]],
        data: Any,
        release: Callable[[], None],
        timeouts: dict[str, float | None],
        sni_hostname: str | None = None,
        clearance: Clearance | None = None,
    ) -> httpx.Response | None:
        """The request (`data`: bytes, None, or an async iterable sent chunked or by its
        Content-Length); None, sending nothing, when a header is not UTF-8 text."""
        headers = _text_headers(raw_headers)
        if headers is None:
            return None
        if isinstance(data, bytes) and len(data) > _LARGE_BODY:
            data = io.BytesIO(data)
        with _map_errors(sending=True):
            response = await self._here().request(
                method.upper(),
                _yarl_url(url),
                headers=headers,
                data=data,
                allow_redirects=False,
                timeout=self._timeout(timeouts),
                server_hostname=sni_hostname,
                middlewares=None if clearance is None else _waiting_for(clearance),
            )
        extensions = _HTTP_11
        if response.reason:
            reason = response.reason.encode("utf-8", errors="surrogateescape")
            extensions = {**_HTTP_11, "reason_phrase": reason}
        return httpx.Response(
            response.status,
            headers=response.raw_headers,
            stream=_ResponseStream(response, release),
            extensions=extensions,
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
