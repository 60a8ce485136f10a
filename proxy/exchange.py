"""One exchange: a client's HTTP request and the proxy's answer to it.

`ExchangeMiddleware` opens a `Record` for every HTTP request, makes it current (a contextvar,
so each log line the request causes can carry its request id), notes the status sent, and
hands the finished record to its sinks (the access log, the metrics) once the response has
gone out or the client has left. A record is a handful of slots filled in place: one small
object per request, nothing to build or copy until a sink reads it.

`Exchange` is what every route handler shares: the app's state, the client's headers, the
request id, the quota verdict and the usage the request is accounted under, the upstream
call (with its status and time to first byte noted on the record), error envelopes, and the
499 for a client that went away. Policy stays where it lives (compactor, quotas, headers,
upstream); this module only carries the request through it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.auth import Caller, ProxyKey
from proxy.auth.query import forwarded_query
from proxy.disconnect import DisconnectWatch
from proxy.errors import ProxyError
from proxy.headers import REQUEST_ID, Headers, client_headers_of
from proxy.quota.ledger import Reservation
from proxy.quota.quotas import Verdict
from proxy.record import CURRENT_RECORD, Record, current_record
from proxy.report import PASSTHROUGH, Outcome
from proxy.state import ProxyState
from proxy.upstream import ReplyTap, RequestContent

log = logging.getLogger("proxy.exchange")

T = TypeVar("T")

_REQUEST_ID_BYTES = REQUEST_ID.encode("latin-1")


class UsageTap(Protocol):
    """A keyed request's usage, for the ways it can end without a reply (proxy.usage's
    ChatTap)."""

    def unanswered(self, sent: bool) -> None:
        """Let go upstream, no reply: one request (`sent`: the upstream may bill it)."""
        ...

    def given_up(self, counted: bool) -> None:
        """Never let go upstream: one request if its quota charge `counted` it; else only
        what its compaction step's summarizer calls used."""
        ...

    def reserved(self, reservation: Reservation | None) -> None:
        """The price the quota charge reserved, to settle when the request ends."""
        ...


class ExchangeSink(Protocol):
    """Told about each request: when it arrives, when its status goes out, when it is over."""

    def started(self, record: Record) -> None: ...

    def responding(self, record: Record) -> None: ...

    def finished(self, record: Record) -> None: ...


class ExchangeMiddleware:
    """Opens, times and closes the record of each HTTP request (outermost in create_app)."""

    def __init__(self, app: ASGIApp, sinks: Sequence[ExchangeSink] = ()) -> None:
        self.app = app
        self.sinks = tuple(sinks)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        record = Record(
            request_id=_request_id(scope["headers"]),
            method=scope["method"],
            path=scope["path"],
            client=f"{client[0]}:{client[1]}" if client else None,
            started=time.perf_counter(),
        )
        sinks = self.sinks
        token = CURRENT_RECORD.set(record)
        for sink in sinks:
            sink.started(record)

        async def send_noting_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                for sink in sinks:
                    sink.responding(record)
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        except Exception:
            if record.status is None:
                record.status = 500  # answered by the server-error handler outside us
            raise
        finally:
            route = scope.get("route")
            record.route = getattr(route, "path", "") or "unmatched"
            record.duration_s = time.perf_counter() - record.started
            for sink in sinks:
                sink.finished(record)
            CURRENT_RECORD.reset(token)


def _request_id(raw_headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The client's x-request-id (ASGI names are lower-case), else a fresh one."""
    for name, value in raw_headers:
        if name == _REQUEST_ID_BYTES and value:
            return value.decode("latin-1")
    return f"req_{os.urandom(16).hex()}"  # 128 random bits, as uuid4 (~5x cheaper)


class Exchange:
    """A route handler's view of its request. Build one at the top of the handler."""

    __slots__ = (
        "_opened",
        "_settling",
        "_watch",
        "caller",
        "client_headers",
        "outcome",
        "record",
        "request",
        "request_id",
        "state",
        "usage",
        "verdict",
    )

    def __init__(self, request: Request) -> None:
        self.request = request
        self.state: ProxyState = request.app.state.proxy
        self.client_headers: Headers = client_headers_of(request.scope)
        record = current_record()
        if record is None:  # the app mounted without its middleware
            request_id = _request_id(request.scope["headers"])
            record = Record(request_id, request.method, request.url.path, None, time.perf_counter())
        self.record = record
        self.request_id = record.request_id
        self.outcome: Outcome | None = None
        self.caller: Caller | None = None
        self._watch: DisconnectWatch | None = None
        self._opened = False  # `open` was called: the request was let go upstream
        self.verdict: Verdict | None = None  # the quota's, once `charge` has it
        # Given up while its charge was on its way: the charge's settlement tells `usage`.
        self._settling = False
        self.usage: UsageTap | None = None  # the usage the request is accounted under

    def admit(self) -> Caller:
        """Who is calling (raises a 401 ProxyError with keys on and no known key)."""
        caller = self.caller = self.state.gate.admit(self.request.scope["headers"])
        self.record.key_id = caller.key_id
        self.record.team = caller.team
        return caller

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.record.started) * 1000

    def describe(self, body: Mapping[str, Any]) -> None:
        """Note the model asked for and whether the reply streams (from a parsed chat body)."""
        model = body.get("model")
        self.record.model = model if isinstance(model, str) else None
        self.record.stream = body.get("stream") is True

    def compacted(self, outcome: Outcome) -> Outcome:
        """Keep the compaction step's outcome for the response headers and the record."""
        self.outcome = outcome
        record = self.record
        record.tokens_before = outcome.tokens_before
        record.tokens_after = (
            outcome.tokens_after if outcome.tokens_after is not None else outcome.tokens_before
        )
        record.compaction = outcome.status
        record.compaction_reason = outcome.reason
        record.cache = outcome.cache
        return outcome

    def compaction_headers(self) -> dict[str, str]:
        """The `x-compaction-*` headers; before the step ran they report a plain passthrough."""
        outcome = self.outcome if self.outcome is not None else PASSTHROUGH
        overhead = self.record.overhead_s
        return outcome.headers(self.elapsed_ms() if overhead is None else overhead * 1000)

    def upstream_headers(self) -> Headers:
        """The client's headers for the upstream, under the caller's credential (see admit)."""
        caller = self.caller if self.caller is not None else self.admit()
        return caller.upstream_headers(self.client_headers, self.request_id)

    async def charge(self, key: ProxyKey | None, tokens: int, cost: int = 0) -> Verdict:
        """The request's quota verdict for `tokens` forwarded prompt tokens, reserving `cost`
        nano-dollars of spend (see Quotas.charge), kept for `unanswered`. Awaited before
        `open`: nothing goes upstream before the quota has said yes. Given up while the
        verdict is on its way, the charge is settled all the same and `usage` is told
        whether it counted the request."""
        usage = self.usage
        try:
            verdict = await self.state.quotas.charge(
                key, tokens, reserve_nano=cost, given_up=None if usage is None else usage.given_up
            )
        except asyncio.CancelledError:
            self._settling = True
            raise
        self.verdict = verdict
        self.record.limit = verdict.limit
        if usage is not None and verdict.reservation is not None:
            usage.reserved(verdict.reservation)
        return verdict

    async def open(
        self,
        method: str,
        path: str,
        *,
        headers: Headers,
        content: RequestContent | None,
    ) -> httpx.Response:
        """Send upstream (the client's query string kept); noting status and time to headers."""
        record = self.record
        self._opened = True
        sent = time.perf_counter()
        record.overhead_s = sent - record.started
        query = self.request.scope.get("query_string", b"")
        if self.caller is not None and self.caller.key is not None:
            query = forwarded_query(query)  # no proxy key in a forwarded query string
        response = await self.state.upstream.open(
            method, path, headers=headers, content=content, query=query
        )
        record.upstream_status = response.status_code
        record.upstream_ttfb_s = time.perf_counter() - sent
        return response

    def unanswered(self, *, sent: bool) -> None:
        """The request ended without a reply (an error, or the client left): its usage, so
        that a key's usage counts every request its quota counted. Let go upstream (`open`
        was called): one request however it ended (`sent`: the upstream may have it and
        bill its prompt; see ChatTap.unanswered). Not let go: one request with no tokens if
        its charge counted it, else only what its compaction step spent; a charge still on
        its way when the request was given up tells usage itself once it settles."""
        usage = self.usage
        if usage is None or self._settling:
            return
        if self._opened:
            usage.unanswered(sent)
            return
        verdict = self.verdict
        usage.given_up(verdict is not None and verdict.counted)

    def _watching(self) -> DisconnectWatch:
        watch = self._watch
        if watch is None:
            watch = self._watch = DisconnectWatch(self.request.receive)
        return watch

    async def guard(self, work: Callable[[], Awaitable[T]]) -> T:
        """Run `work()`, cancelled if the client disconnects (raises ClientDisconnected).

        Only once the body has been read: see proxy.disconnect. Every guarded step of the
        request and the relay of its reply share one watcher.
        """
        return await self._watching().run(work)

    async def relay(
        self,
        response: httpx.Response,
        extra_headers: Mapping[str, str] | None = None,
        tap: ReplyTap | None = None,
        *,
        watch: bool = True,
        raw_headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> Response:
        """`watch`: a disconnect while the reply is read whole (small replies) or streamed
        aborts the upstream (only once the request body has been read, as for `guard`).
        `raw_headers`: more of ours, lower-case names and values as wire bytes."""
        watcher = self._watching() if watch else None
        try:
            return await self.state.upstream.relay(
                response, self.request_id, extra_headers, tap, watch=watcher,
                raw_headers=raw_headers,
            )  # fmt: skip
        except BaseException:
            self._unwatch()
            raise

    def _unwatch(self) -> None:
        if self._watch is not None:
            self._watch.close()

    def error(self, exc: ProxyError, extra_headers: Mapping[str, str] | None = None) -> Response:
        """The error's envelope, with the request id (and any `extra_headers`)."""
        self._unwatch()
        return exc.response({**(extra_headers or {}), REQUEST_ID: self.request_id})

    def disconnected(self) -> Response:
        """The client left before the upstream answered: 499, for the log and the metrics."""
        self._unwatch()
        log.info("client disconnected before the upstream answered")
        return Response(status_code=499)
