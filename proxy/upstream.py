"""Talking to the upstream: open a request, map transport failures, relay the reply.

Every reply is relayed as raw bytes while they arrive (no decoding, no buffering), so
streaming and non-streaming responses take the same path and memory stays flat.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Protocol

import anyio
import httpx
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from proxy.disconnect import DisconnectWatch
from proxy.errors import ClientDisconnected, ProxyError
from proxy.headers import (
    REQUEST_ID,
    Headers,
    RawHeaders,
    as_bytes,
    as_text,
    client_response_raw,
)
from proxy.paths import quote_query
from proxy.redact import host_of
from proxy.settings import UpstreamSettings
from proxy.transport import PoolSlots, UnrelayableReply, UnsendableHeader

log = logging.getLogger("proxy.upstream")

RequestContent = bytes | AsyncIterator[bytes]

# httpx's errors raised before a request is written (refused or unresolvable, a URL it
# cannot send to; PoolTimeout and ConnectTimeout too): the upstream never saw the request.
_UNSENT = (httpx.ConnectError, httpx.UnsupportedProtocol)
# Dropped from a reply whose body the proxy may change (see `relay`).
_LENGTH = b"content-length"

# Replies up to this size with a Content-Length are read whole before answering (see relay).
WHOLE_REPLY_BYTES = 256 * 1024
# Parsed upstream URLs kept per path (httpx parses a URL string in ~15-30 us; the chat route
# uses one URL for every request). Only query-less ones: a query may carry a credential.
_URL_CACHE = 256


class BodyTap(Protocol):
    """Sees a relayed body chunk by chunk, in the relay's own loop (no generator of its own)."""

    def feed(self, chunk: bytes) -> bytes:
        """What the client gets for this chunk now (b"": nothing yet)."""
        ...

    def end(self) -> bytes:
        """What is still to send once the upstream's body has ended."""
        ...


class ReplyTap(Protocol):
    """Reads a reply as it is relayed (usage accounting), changing nothing unless it says so."""

    def whole(self, status: int, headers: httpx.Headers, body: bytes) -> RawHeaders:
        """A reply read whole (`body` as relayed, still content-encoded); headers to add, as
        wire bytes with lower-case names."""
        ...

    def body(self, status: int, headers: httpx.Headers, streaming: bool) -> BodyTap | None:
        """A reply relayed as it arrives (`streaming`: an SSE body): what sees its chunks,
        None to pass them untouched. `finish` follows however the body ends, once the
        client has been sent all it gets."""
        ...

    def finish(self) -> None:
        """The relayed body ended (completely, failed, or the client left)."""
        ...

    def cut(self, status: int) -> None:
        """A reply to be read whole never was (the client left, the upstream broke off or
        stalled): none of its body reached the client, and `whole` is not called."""
        ...


class UpstreamBrokeOff(Exception):
    """The upstream failed after the reply had started; the client connection is aborted."""


class Upstream:
    """The upstream API behind the proxy: one base URL, one shared pooled client.

    `pool`: the pool slots of the client's transport, when the app built it (a transport
    given to `create_app`, a mock, keeps no such count)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        settings: UpstreamSettings,
        pool: Callable[[], PoolSlots] | None = None,
    ) -> None:
        self.client = client
        self.base_url = settings.base_url
        self.host = host_of(settings.base_url)
        self.timeout = httpx.Timeout(settings.timeout_s, connect=settings.connect_timeout_s)
        self._timeouts = self.timeout.as_dict()
        self._urls: dict[str, httpx.URL] = {}
        self._pool = pool

    def url_for(self, path: str, query: bytes = b"") -> str:
        """`path` is already a URL path (percent-encoded as the client wrote it)."""
        url = f"{self.base_url}/{path}"
        return f"{url}?{quote_query(query)}" if query else url

    def _url(self, path: str, query: bytes) -> httpx.URL:
        """httpx's parsed form of url_for (raises httpx.InvalidURL)."""
        if query:
            return httpx.URL(self.url_for(path, query))
        url = self._urls.get(path)
        if url is None:
            url = httpx.URL(self.url_for(path))
            if len(self._urls) >= _URL_CACHE:
                self._urls.clear()
            self._urls[path] = url
        return url

    def prepare(self, path: str) -> httpx.URL:
        """The upstream URL of `path` parsed now, at start (kept like any request's), so the
        first request to it does not parse it."""
        return self._url(path, b"")

    def pool_slots(self) -> PoolSlots | None:
        """In-use and free connection slots towards the upstream (None: not counted)."""
        return None if self._pool is None else self._pool()

    async def open(
        self,
        method: str,
        path: str,
        *,
        headers: Headers,
        content: RequestContent | None,
        query: bytes = b"",
    ) -> httpx.Response:
        """Send the request and return once the upstream's status and headers are in.

        The body is left unread (`stream=True`); the caller relays it and must close it.
        Header values go out as the bytes the client sent (one that cannot is a 400, see
        UnsendableHeader). A bare Request, not client.build_request: the client's default
        headers (Accept, Accept-Encoding, User-Agent) would be added to what the client sent.
        """
        try:
            url = self._url(path, query)
            request = httpx.Request(method, url, headers=as_bytes(headers), content=content)
        except httpx.InvalidURL as exc:
            raise ProxyError(
                400,
                f"The request URL cannot be forwarded: {exc}",
                code="invalid_url",
                unsent=True,
            ) from None
        request.extensions["timeout"] = self._timeouts
        try:
            return await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise self.failure(exc) from None

    def failure(self, exc: httpx.HTTPError) -> ProxyError:
        """Map a transport failure to 502 (unreachable) or 504 (too slow), naming the host;
        `unsent` when httpx's error says nothing was written (see ProxyError). A request
        header that cannot go out as sent is the client's: 400, nothing sent."""
        if isinstance(exc, UnsendableHeader):
            return ProxyError(
                400,
                f"The request cannot be forwarded as sent: {exc}.",
                param="headers",
                code="invalid_header",
                unsent=True,
            )
        if isinstance(exc, UnrelayableReply):
            return ProxyError(
                502,
                f"The upstream {self.host} sent a reply the proxy does not relay: {exc}.",
                type="upstream_error",
                code="upstream_invalid_reply",
            )
        if isinstance(exc, httpx.ConnectTimeout):
            return ProxyError(
                504,
                f"Timed out connecting to the upstream {self.host} "
                f"(after {self.timeout.connect}s).",
                type="upstream_error",
                code="upstream_timeout",
                unsent=True,
            )
        if isinstance(exc, httpx.TimeoutException):
            return ProxyError(
                504,
                f"The upstream {self.host} did not answer in time (timeout {self.timeout.read}s).",
                type="upstream_error",
                code="upstream_timeout",
                unsent=isinstance(exc, httpx.PoolTimeout),
            )
        detail = str(exc) or type(exc).__name__
        return ProxyError(
            502,
            f"Could not reach the upstream {self.host}: {detail}",
            type="upstream_error",
            code="upstream_unreachable",
            unsent=isinstance(exc, _UNSENT),
        )

    async def relay(
        self,
        upstream: httpx.Response,
        request_id: str,
        extra_headers: Mapping[str, str] | None = None,
        tap: ReplyTap | None = None,
        *,
        watch: DisconnectWatch | None = None,
        raw_headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> Response:
        """The upstream's reply for the client, byte for byte (headers too), with ours
        (`extra_headers`, and `raw_headers`: lower-case names and values as wire bytes).

        A small reply of known length (a typical non-streaming completion) is read whole and
        sent as one response: its bytes are already on their way, and it spares a streaming
        task per request. Anything else is streamed as it arrives. With `watch` (the request's
        disconnect watcher, once its body has been read), a client disconnect while the reply
        is read or streamed aborts the upstream; the watcher is closed once the reply no longer
        needs it. On every path the upstream response is closed: here, or by the returned
        response once the server has run it.
        """
        try:
            extra = dict(extra_headers) if extra_headers else {}
            if REQUEST_ID not in upstream.headers:  # the upstream's own id wins
                extra[REQUEST_ID] = request_id
            content_type = upstream.headers.get("content-type", "")
            streaming = content_type.startswith("text/event-stream")
            if streaming:
                extra.setdefault("cache-control", "no-cache")
                extra.setdefault("x-accel-buffering", "no")
            length = upstream.headers.get("content-length", "")
            if streaming or not (length.isdigit() and int(length) <= WHOLE_REPLY_BYTES):
                seen = None
                if tap is not None:
                    seen = tap.body(upstream.status_code, upstream.headers, streaming)
                chunks = _relay_body(upstream, self.host, seen)
                raw = _client_headers(upstream, extra, raw_headers)
                if streaming and seen is not None:
                    # The tap may hold back an event (the usage event the proxy asked for):
                    # the upstream's length would no longer be the body's, so the server
                    # frames what goes out (chunked) instead.
                    raw = [(name, value) for name, value in raw if name != _LENGTH]
                return RelayResponse(upstream, chunks, raw, watch, tap)
        except BaseException:
            if watch is not None:
                watch.close()
            await _close(upstream)
            raise
        return await self._relay_whole(upstream, extra, tap, watch, raw_headers)

    async def _relay_whole(
        self,
        upstream: httpx.Response,
        extra: dict[str, str],
        tap: ReplyTap | None,
        watch: DisconnectWatch | None,
        raw_extra: Sequence[tuple[bytes, bytes]],
    ) -> Response:
        async def read() -> bytes:  # the wire bytes: no content-decoding
            if upstream.is_stream_consumed:  # built in memory and read (httpx.MockTransport)
                return upstream.content
            return b"".join([chunk async for chunk in upstream.aiter_raw()])

        try:
            try:
                body = await (read() if watch is None else watch.run(read))
            except (ClientDisconnected, httpx.HTTPError):
                if tap is not None:
                    tap.cut(upstream.status_code)
                raise
            if tap is not None:
                raw_extra = [*tap.whole(upstream.status_code, upstream.headers, body), *raw_extra]
            raw_headers = _client_headers(upstream, extra, raw_extra)
        except ClientDisconnected:
            log.info("client disconnected while the upstream %s sent its reply", self.host)
            return Response(status_code=499)
        except httpx.TimeoutException as exc:
            return self.failure(exc).response(_with_raw(extra, raw_extra))
        except httpx.HTTPError as exc:
            log.warning("upstream %s failed mid-response: %s", self.host, type(exc).__name__)
            return ProxyError(
                502,
                f"The upstream {self.host} broke off its reply: {type(exc).__name__}",
                type="upstream_error",
                code="upstream_broke_off",
            ).response(_with_raw(extra, raw_extra))
        finally:
            if watch is not None:
                watch.close()
            await _close(upstream)
        response = Response(body, upstream.status_code)
        response.raw_headers = raw_headers
        return response


def _client_headers(
    upstream: httpx.Response, extra: dict[str, str], raw_extra: Sequence[tuple[bytes, bytes]] = ()
) -> RawHeaders:
    """The upstream's end-to-end headers as received, then ours (which replace same-named)."""
    return client_response_raw(upstream.headers.raw, extra, raw_extra)


def _with_raw(extra: dict[str, str], raw_extra: Sequence[tuple[bytes, bytes]]) -> dict[str, str]:
    """`extra` and `raw_extra` as one mapping (an error's envelope takes text)."""
    if not raw_extra:
        return extra
    return {**extra, **dict(as_text(raw_extra))}


class RelayResponse(StreamingResponse):
    """Streams the upstream's body; tells the tap once the client has been sent the end of
    it (so the last byte waits for no accounting), and closes the upstream response however
    the send ends (finished, failed, client gone, or cancelled before the first byte).

    With the request's disconnect watcher, the body is sent under it (a client that leaves
    ends the relay and aborts the upstream); without one, Starlette listens for the
    disconnect itself (a task group per response).
    """

    def __init__(
        self,
        upstream: httpx.Response,
        chunks: AsyncIterator[bytes],
        raw_headers: RawHeaders,
        watch: DisconnectWatch | None = None,
        tap: ReplyTap | None = None,
    ) -> None:
        super().__init__(chunks, upstream.status_code)
        self.chunks = chunks  # (body_iterator, typed as an iterator: stream_response steps it)
        self.raw_headers = raw_headers
        self.upstream = upstream
        self.watch = watch
        self.tap = tap

    async def stream_response(self, send: Send) -> None:
        """Starlette's, except that empty pieces (a tap holding an event back until the rest
        of it comes) are not sent."""
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})  # fmt: skip
        async for chunk in self.chunks:
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = self.watch
        try:
            if watch is None:
                await super().__call__(scope, receive, send)
                return
            try:
                await watch.run(lambda: self.stream_response(send))
            except ClientDisconnected:
                pass  # the status went out already; nobody is left to tell
            except OSError:  # a server on ASGI spec 2.4 reports a gone client this way
                raise ClientDisconnect() from None
        finally:
            if watch is not None:
                watch.close()
            try:
                if self.tap is not None:
                    self.tap.finish()
            finally:
                await _close(self.upstream)


async def _close(upstream: httpx.Response) -> None:
    with anyio.CancelScope(shield=True):
        await upstream.aclose()


async def _relay_body(
    upstream: httpx.Response, host: str, seen: BodyTap | None = None
) -> AsyncIterator[bytes]:
    """The body as it arrives, one piece per chunk read; with `seen`, each chunk as it passes
    it on (in this loop: a tap adds no generator layer per chunk). httpx closes the upstream
    response once its body has ended; the RelayResponse sending this closes it on every
    other path."""
    try:
        if upstream.is_stream_consumed:  # built in memory and read (httpx.MockTransport)
            if seen is None:
                yield upstream.content
                return
            body = seen.feed(upstream.content) + seen.end()
            if body:
                yield body
            return
        if seen is None:
            async for chunk in upstream.aiter_raw():
                yield chunk
            return
        feed = seen.feed
        async for chunk in upstream.aiter_raw():
            yield feed(chunk)  # (b"" while it holds an event back: not sent)
        rest = seen.end()
        if rest:
            yield rest
    except httpx.HTTPError as exc:
        # Status and headers are already sent. Ending the body cleanly would pass a truncated
        # reply off as complete; raising makes the server abort the connection instead, so
        # the client sees the failure exactly as it would talking to the upstream directly.
        log.warning("upstream %s failed mid-response: %s", host, type(exc).__name__)
        raise UpstreamBrokeOff(f"upstream {host} broke off the response") from exc
