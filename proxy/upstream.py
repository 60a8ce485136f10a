"""Talking to the upstream: open a request, map transport failures, relay the reply.

Every reply is relayed as raw bytes while they arrive (no decoding, no buffering), so
streaming and non-streaming responses take the same path and memory stays flat.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Protocol

import anyio
import httpx
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from proxy.clearance import Clearance
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
from proxy.transport import (
    PoolSlots,
    arrived,
    closes_at_once,
    direct_transport,
    ended,
    pool_slots,
    read_whole,
)

log = logging.getLogger("proxy.upstream")

RequestContent = bytes | AsyncIterator[bytes]

# httpx's errors raised before a request is written (refused or unresolvable, a URL it
# cannot send to; PoolTimeout and ConnectTimeout too): the upstream never saw the request.
_UNSENT = (httpx.ConnectError, httpx.UnsupportedProtocol)

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
    """The upstream API behind the proxy: one base URL, one shared pooled client."""

    def __init__(self, client: httpx.AsyncClient, settings: UpstreamSettings) -> None:
        self.client = client
        self.base_url = settings.base_url
        self.host = host_of(settings.base_url)
        self.timeout = httpx.Timeout(settings.timeout_s, connect=settings.connect_timeout_s)
        self._timeouts = self.timeout.as_dict()
        self._urls: dict[str, httpx.URL] = {}

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
        """In-use and free connection slots towards the upstream (None: not counted, as for
        httpx's own transport in-process)."""
        return pool_slots(self.client)

    async def open(
        self,
        method: str,
        path: str,
        *,
        headers: Headers,
        content: RequestContent | None,
        query: bytes = b"",
        clearance: Clearance | None = None,
    ) -> httpx.Response:
        """Send the request and return once the upstream's status and headers are in.

        The body is left unread (`stream=True`); the caller relays it and must close it.
        Header values go out as the bytes the client sent. With `clearance`, nothing is
        written before it clears; a request that fails before asking it asks it then, so
        its refusal wins over the failure as if it had been asked first.
        """
        if clearance is None:
            return await self._open(method, path, headers, content, query, None)
        try:
            return await self._open(method, path, headers, content, query, clearance)
        except Exception:
            waiting = clearance.cleared()  # None at once when it was asked already
            if waiting is not None:
                await waiting
            raise
        except BaseException:
            clearance.abandon()
            raise

    async def _open(
        self,
        method: str,
        path: str,
        headers: Headers,
        content: RequestContent | None,
        query: bytes,
        clearance: Clearance | None,
    ) -> httpx.Response:
        # A bare Request, not client.build_request: the client's default headers (Accept,
        # Accept-Encoding, User-Agent) would be added to what the client sent.
        try:
            url = self._url(path, query)
            direct = direct_transport(self.client, url)
            if direct is not None and not isinstance(content, AsyncIterator):
                # Served: the same request without httpx building and sending it.
                raw = as_bytes(headers)
                try:
                    return await direct.send_bytes(
                        method, url, raw, content, self._timeouts, clearance
                    )
                except httpx.HTTPError as exc:
                    raise self.failure(exc) from None
            request = httpx.Request(method, url, headers=as_bytes(headers), content=content)
        except httpx.InvalidURL as exc:
            raise ProxyError(
                400,
                f"The request URL cannot be forwarded: {exc}",
                code="invalid_url",
                unsent=True,
            ) from None
        request.extensions["timeout"] = self._timeouts
        if clearance is not None:
            waiting = clearance.cleared()
            if waiting is not None:
                await waiting
        try:
            return await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise self.failure(exc) from None

    def failure(self, exc: httpx.HTTPError) -> ProxyError:
        """Map a transport failure to 502 (unreachable) or 504 (too slow), naming the host;
        `unsent` when httpx's error says nothing was written (see ProxyError)."""
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
            whole = read_whole(upstream)
            if whole is not None:  # the served stream reads to the end itself
                return await whole
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
        """Starlette's, but what the upstream has sent already is read (and tapped) before
        the head goes out, so that head and body leave back to back instead of with the
        tap's reading between them; a body that has all arrived is read to its end first,
        and goes out with the reply's end, in one write. The head never waits for a body
        still to come."""
        chunks, upstream = self.chunks, self.upstream
        body = b""
        piece = await anext(chunks, None) if arrived(upstream) else b""
        while piece is not None and ended(upstream):  # reading on cannot wait
            body += piece
            piece = await anext(chunks, None)
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})  # fmt: skip
        if piece is None:  # the body ended with what had arrived
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        body += piece
        if body:
            await send({"type": "http.response.body", "body": body, "more_body": True})
        async for chunk in chunks:
            if chunk:  # (b"": a tap holding an event back until the rest of it comes)
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
    if closes_at_once(upstream):  # nothing to shield: it never suspends
        await upstream.aclose()
        return
    with anyio.CancelScope(shield=True):
        await upstream.aclose()


async def _relay_body(
    upstream: httpx.Response, host: str, seen: BodyTap | None = None
) -> AsyncIterator[bytes]:
    """The body as it arrives, one piece per chunk read; with `seen`, each chunk as it passes
    it on (b"" while it holds an event back; in this loop: a tap adds no generator layer per
    chunk). httpx closes the upstream response once its body has ended; the RelayResponse
    sending this closes it on every other path."""
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
            yield feed(chunk)  # b"" too: one piece per chunk read (see stream_response)
        rest = seen.end()
        if rest:
            yield rest
    except httpx.HTTPError as exc:
        # Status and headers are already sent (what is read before them had arrived, and
        # reading that cannot fail). Ending the body cleanly would pass a truncated reply off
        # as complete; raising makes the server abort the connection instead, so the client
        # sees the failure exactly as it would talking to the upstream directly.
        log.warning("upstream %s failed mid-response: %s", host, type(exc).__name__)
        raise UpstreamBrokeOff(f"upstream {host} broke off the response") from exc
