"""Slow clients and too many of them, handled where uvicorn reads the socket.

uvicorn bounds neither how long a client may take to send its headers nor the gaps in its
body, and it refuses over-limit connections only once their headers are complete, so a few
thousand clients that connect and stall hold every file descriptor. This protocol (uvicorn's
httptools one, plus timers) adds:

- a connection limit checked on accept: one over it gets 503 in OpenAI's envelope and is
  closed at once, before it can hold anything;
- a header deadline (`server.header_timeout_s`, from connection or from a request's first
  byte): 408 in the envelope if part of a request came, a silent close if nothing did;
- a body gap (`server.body_timeout_s` without a body byte): 408 in the envelope if the app
  has not started answering, then close. The app's pending read ends as a disconnect, and
  `read_timed_out` tells it why (so its own log says 408, not 499);
- a head limit (`server.max_header_bytes`): a request line and headers larger than that get
  431 in the envelope and the connection is closed, before the parser has seen more than the
  limit. httptools sets no limit of its own and gathers a header's pieces by concatenation,
  so its cost grows with the square of the header's size: unbounded, one 64 MB header held
  the event loop for ~5 s and four 32 MB ones left ~300 MB of RSS. Bytes are counted as
  they are read, so the bound holds to within one socket read (256 KB) on a connection
  that pipelines requests.

uvicorn's h11 protocol has a head limit of its own (`h11_max_incomplete_event_size`), but it
answers 400, and under the proxy it served 0.63-0.89x the requests per second of httptools
at 1.24-1.53x the CPU per request (two interleaved runs of bench.overhead's load: small
bodies, concurrency 1 and 64, plain and streamed, both on uvloop). So the httptools
protocol stays, extended through uvicorn's own `http=` setting, which takes a protocol
class; the methods overridden here (`connection_made`, `data_received`, the parser
callbacks) are the ones uvicorn's httptools protocol has had since 0.30, the oldest release
the proxy admits.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass
from typing import Any

from starlette.types import Scope
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.errors import ProxyError
from proxy.settings import ServerSettings

log = logging.getLogger("proxy.connections")

_TIMED_OUT = "proxy.read_timed_out"  # scope key: the body timer fired for this request


# Descriptors besides client sockets: listening socket, logs, tokenizer files, Redis...
_SPARE_FDS = 64


@dataclass(frozen=True)
class ConnectionLimits:
    """Given to uvicorn as its `http` protocol factory: picklable, so `--workers` can use it."""

    max_connections: int
    header_timeout_s: float
    body_timeout_s: float
    max_header_bytes: int

    def __call__(self, **kwargs: Any) -> GuardedHttpToolsProtocol:
        return GuardedHttpToolsProtocol(self, **kwargs)


def server_options(server: ServerSettings) -> dict[str, Any]:
    """uvicorn.run keyword arguments that apply these limits (`compaction-proxy serve`).

    Each client connection may hold an upstream one too: a limit the process's file
    descriptors cannot hold is lowered, with a warning, so the limit refuses before
    accept() starts failing for everyone.
    """
    limit = server.max_connections
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    fits = max(1, (soft - _SPARE_FDS) // 2) if soft != resource.RLIM_INFINITY else limit
    if fits < limit:
        log.warning(
            "server.max_connections = %d needs ~%d file descriptors, the limit is %d: using %d",
            limit,
            2 * limit + _SPARE_FDS,
            soft,
            fits,
        )
        limit = fits
    limits = ConnectionLimits(
        limit, server.header_timeout_s, server.body_timeout_s, server.max_header_bytes
    )
    return {"http": limits}


def read_timeout(seconds: float, what: str) -> ProxyError:
    return ProxyError(
        408,
        f"The request {what} did not arrive in time (more than {seconds:g}s without data); "
        "the connection is closed.",
        code="request_timeout",
        headers={"connection": "close"},
    )


def too_many_connections(limit: int) -> ProxyError:
    return ProxyError(
        503,
        f"This proxy has too many open connections (server.max_connections = {limit}); "
        "retry shortly.",
        type="server_error",
        code="too_many_connections",
        headers={"connection": "close", "retry-after": "1"},
    )


def head_too_large(limit: int) -> ProxyError:
    return ProxyError(
        431,
        f"The request's head (request line and headers) is larger than this proxy accepts "
        f"(server.max_header_bytes = {limit} bytes); the connection is closed.",
        code="request_header_fields_too_large",
        headers={"connection": "close"},
    )


def read_timed_out(scope: Scope) -> ProxyError | None:
    """The 408 to answer when the app's body read ended because the body timer fired."""
    seconds = scope.get(_TIMED_OUT)
    return read_timeout(seconds, "body") if isinstance(seconds, float) else None


def _raw_response(error: ProxyError) -> bytes:
    """The envelope as HTTP/1.1 bytes, for answers written before or beside the app."""
    response = error.response()
    head = [f"HTTP/1.1 {error.status} {_REASONS[error.status]}".encode()]
    head += [name + b": " + value for name, value in response.raw_headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + response.body


_REASONS = {
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above (uvicorn's own `limit_concurrency`
    is left unset: it would answer plain-text 503s, and only after the headers)."""

    def __init__(self, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.limits = limits
        self._timer: asyncio.TimerHandle | None = None
        self._refused = False  # over the connection limit: never handed to uvicorn
        self._discarding = False  # refused a head: what still arrives is not parsed
        self._request_begun = False
        self._head_bytes: int | None = 0  # of the head being read; None while reading a body
        self._heads = 0  # heads parsed whole on this connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        limit = self.limits.max_connections
        if len(self.connections) >= limit:
            self._refused = True
            log.warning("connection refused: server.max_connections (%d) reached", limit)
            transport.write(_raw_response(too_many_connections(limit)))
            transport.close()
            return
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, self._headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if not self._refused:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused or self._discarding:
            return
        counted = self._head_bytes
        if counted is None:  # a body: its size is the app's to judge (server.max_body_bytes)
            super().data_received(data)
            return
        room = self.limits.max_header_bytes - counted
        if len(data) <= room:
            self._head_bytes = counted + len(data)
            super().data_received(data)
            return
        # Over the limit, unless the head ends within the room left: the parser gets that
        # much first, and the rest (a body, further requests) only once the head is whole.
        heads = self._heads
        super().data_received(data[:room])
        if self.transport.is_closing():  # the parser refused the request itself (400)
            return
        if self._heads == heads:
            self._head_too_large()
        else:
            super().data_received(data[room:])

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._request_begun = True
        self._arm(self.limits.header_timeout_s, self._headers_late)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._head_bytes = None
        self._heads += 1
        self._arm(self.limits.body_timeout_s, self._body_late)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._arm(self.limits.body_timeout_s, self._body_late)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._request_begun = False
        self._head_bytes = 0  # the next head begins
        self._disarm()

    def _head_too_large(self) -> None:
        limit = self.limits.max_header_bytes
        self._discarding = True
        self._disarm()
        log.info("request head over server.max_header_bytes (%d bytes): 431", limit)
        busy = self.cycle is not None and not self.cycle.response_complete
        if not busy:  # else a reply is being written on this connection: just close it
            self.transport.write(_raw_response(head_too_large(limit)))
        self.transport.close()

    # -- timers ----------------------------------------------------------------------------

    def _arm(self, seconds: float, callback: Any) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_late(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        busy = self.cycle is not None and not self.cycle.response_complete
        if self._request_begun and not busy:
            log.info("request headers timed out after %gs", self.limits.header_timeout_s)
            error = read_timeout(self.limits.header_timeout_s, "headers")
            self.transport.write(_raw_response(error))
        self.transport.close()

    def _body_late(self) -> None:
        self._timer = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None or cycle.response_complete:
            return
        seconds = self.limits.body_timeout_s
        if self.flow.read_paused:  # we stopped reading (the app is behind), not the client
            self._arm(seconds, self._body_late)
            return
        log.info("request body timed out after %gs", seconds)
        if not cycle.response_started:
            cycle.scope[_TIMED_OUT] = float(seconds)  # type: ignore[literal-required]
            self.transport.write(_raw_response(read_timeout(seconds, "body")))
        cycle.disconnected = True
        cycle.message_event.set()
        self.transport.close()
