"""Talking to the upstream: open a request, map transport failures, relay the reply.

Every reply is relayed as raw bytes while they arrive (no decoding, no buffering), so
streaming and non-streaming responses take the same path and memory stays flat.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from typing import Protocol
from urllib.parse import urlsplit

import anyio
import httpx
from starlette.responses import Response, StreamingResponse

from proxy.errors import ProxyError
from proxy.headers import REQUEST_ID, Headers, client_response_headers
from proxy.settings import UpstreamSettings

log = logging.getLogger("proxy.upstream")

RequestContent = bytes | AsyncIterator[bytes]

# Replies up to this size with a Content-Length are read whole before answering (see relay).
WHOLE_REPLY_BYTES = 256 * 1024


class ReplyTap(Protocol):
    """Reads a reply as it is relayed (usage accounting), changing nothing unless it says so."""

    def whole(self, status: int, headers: httpx.Headers, body: bytes) -> Mapping[str, str]:
        """A reply read whole (`body` as relayed, still content-encoded); headers to add."""
        ...

    def relay(
        self, status: int, headers: httpx.Headers, chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        """A reply relayed as it arrives; yields what the client gets."""
        ...


class UpstreamBrokeOff(Exception):
    """The upstream failed after the reply had started; the client connection is aborted."""


class Upstream:
    """The upstream API behind the proxy: one base URL, one shared pooled client."""

    def __init__(self, client: httpx.AsyncClient, settings: UpstreamSettings) -> None:
        self.client = client
        self.base_url = settings.base_url
        self.host = urlsplit(settings.base_url).netloc
        self.timeout = httpx.Timeout(settings.timeout_s, connect=settings.connect_timeout_s)

    def url_for(self, path: str, query: bytes = b"") -> str:
        url = f"{self.base_url}/{path.lstrip('/')}"
        return f"{url}?{query.decode('latin-1')}" if query else url

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
        """
        # A bare Request, not client.build_request: the client's default headers (Accept,
        # Accept-Encoding, User-Agent) would be added to what the client sent.
        request = httpx.Request(method, self.url_for(path, query), headers=headers, content=content)
        request.extensions["timeout"] = self.timeout.as_dict()
        try:
            return await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise self.failure(exc) from None

    def failure(self, exc: httpx.HTTPError) -> ProxyError:
        """Map a transport failure to 502 (unreachable) or 504 (too slow), naming the host."""
        if isinstance(exc, httpx.ConnectTimeout):
            return ProxyError(
                504,
                f"Timed out connecting to the upstream {self.host} "
                f"(after {self.timeout.connect}s).",
                type="upstream_error",
                code="upstream_timeout",
            )
        if isinstance(exc, httpx.TimeoutException):
            return ProxyError(
                504,
                f"The upstream {self.host} did not answer in time (timeout {self.timeout.read}s).",
                type="upstream_error",
                code="upstream_timeout",
            )
        detail = str(exc) or type(exc).__name__
        return ProxyError(
            502,
            f"Could not reach the upstream {self.host}: {detail}",
            type="upstream_error",
            code="upstream_unreachable",
        )

    async def relay(
        self,
        upstream: httpx.Response,
        request_id: str,
        extra_headers: Mapping[str, str] | None = None,
        tap: ReplyTap | None = None,
    ) -> Response:
        """The upstream's reply for the client, byte for byte; the upstream response is closed.

        A small reply of known length (a typical non-streaming completion) is read whole and
        sent as one response: its bytes are already on their way, and it spares a streaming
        task per request. Anything else is streamed as it arrives: if the client disconnects,
        Starlette cancels the body iterator and the `finally` closes the upstream response,
        which aborts the upstream connection.
        """
        headers = client_response_headers(upstream.headers.multi_items())
        content_type = upstream.headers.get("content-type", "")
        extra = dict(extra_headers or {})
        if REQUEST_ID not in upstream.headers:  # the upstream's own id wins
            extra[REQUEST_ID] = request_id
        streaming = content_type.startswith("text/event-stream")
        if streaming:
            extra.setdefault("cache-control", "no-cache")
            extra.setdefault("x-accel-buffering", "no")
        length = upstream.headers.get("content-length", "")
        response: Response
        if not streaming and length.isdigit() and int(length) <= WHOLE_REPLY_BYTES:
            try:
                body = b"".join([chunk async for chunk in _relay_body(upstream, self.host)])
            except UpstreamBrokeOff as exc:
                return ProxyError(
                    502,
                    f"The upstream {self.host} broke off its reply: {exc.__cause__}",
                    type="upstream_error",
                    code="upstream_broke_off",
                ).response(extra)
            if tap is not None:
                extra.update(tap.whole(upstream.status_code, upstream.headers, body))
            response = Response(body, upstream.status_code)
        else:
            chunks = _relay_body(upstream, self.host)
            if tap is not None:
                chunks = tap.relay(upstream.status_code, upstream.headers, chunks)
            response = StreamingResponse(chunks, upstream.status_code)
        names = {name.lower() for name in extra}
        headers = [(k, v) for k, v in headers if k.lower() not in names] + list(extra.items())
        raw_headers = [
            (name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers
        ]
        response.raw_headers = raw_headers
        return response


async def _relay_body(upstream: httpx.Response, host: str) -> AsyncIterator[bytes]:
    try:
        if upstream.is_stream_consumed:  # built in memory and read (httpx.MockTransport)
            yield upstream.content
            return
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        # Status and headers are already sent. Ending the body cleanly would pass a truncated
        # reply off as complete; raising makes the server abort the connection instead, so
        # the client sees the failure exactly as it would talking to the upstream directly.
        log.warning("upstream %s failed mid-response: %s", host, type(exc).__name__)
        raise UpstreamBrokeOff(f"upstream {host} broke off the response") from exc
    finally:
        with anyio.CancelScope(shield=True):
            await upstream.aclose()
