"""create_app(settings) -> the Starlette app. Routes, shared state and lifespan live here."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute

from proxy import admin
from proxy.audit import AuditTrail
from proxy.auth import Gate, KeySource
from proxy.auth.keys_file import reload_on_sighup
from proxy.auth.keystore import create_key_store
from proxy.auth.metrics import KeysCollector
from proxy.chat import chat_completions
from proxy.compactor import Compactor, PromptCounter
from proxy.compress import compress
from proxy.errors import ProxyError
from proxy.exchange import ExchangeMiddleware
from proxy.logs import AccessLog
from proxy.metrics import Metrics
from proxy.passthrough import passthrough
from proxy.paths import upstream_path
from proxy.quota import Quotas, create_ledger
from proxy.quota.metrics import QuotaCollector
from proxy.readiness import Readiness, readiness_for
from proxy.redact import redact_url
from proxy.responses import refuse_websocket, responses
from proxy.settings import WORKER_SETTINGS_ENV, ConfigError, Settings, settings_from_json
from proxy.startup import startup_fields
from proxy.state import ProxyState
from proxy.store import create_store
from proxy.tokens import TokenCounter
from proxy.transport import UpstreamTransport, create_upstream_client
from proxy.turnmemo import TurnMemo
from proxy.upstream import Upstream, UpstreamBrokeOff
from proxy.usage import Meter, Pricing
from proxy.warmup import start_probe, warm_up

log = logging.getLogger("proxy.app")

ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def create_app(
    settings: Settings | None = None,
    *,
    counter: PromptCounter | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Starlette:
    """Build the app and everything it holds; nothing here touches the network.

    Usable in-process (`httpx.ASGITransport(app)`, no lifespan needed) or served by uvicorn,
    whose lifespan closes the pooled client on shutdown. Raises TokenizerUnavailable when
    the tokenizer files cannot be loaded (and `tokenizer.on_missing = "fail"`).

    `transport` carries every upstream request (forwarded and summarizer calls), egress
    proxies unread, as in httpx: a mock, or `httpx.AsyncHTTPTransport()` for respx's default
    mode to see the requests. Without one, the app's own (`UpstreamTransport`: aiohttp, and
    httpx's transport through an egress proxy), in-process and served alike; its lifespan
    makes the TLS context at start when the upstream's or the summarizer's URL is https.
    """
    settings = settings or Settings()
    if counter is None:
        token_counter = TokenCounter(settings)
        token_counter.load()
        counter = token_counter
    own = UpstreamTransport.for_settings(settings.upstream) if transport is None else None
    client = create_upstream_client(settings.upstream, transport or own)
    store = create_store(settings.cache)
    metrics = Metrics(store, token=_metrics_token(settings))
    ledger = create_ledger(settings)
    readiness = readiness_for(settings, client, store, lambda: counter.estimated, ledger)
    pricing = Pricing(settings.pricing)
    meter = Meter(settings, ledger, pricing)
    meter.observer = metrics.usage_observed
    quotas = Quotas(
        ledger,
        on_error=settings.quota.on_redis_error,
        pricing=pricing,
        summarizer_model=settings.compaction.summarizer.model,
        reserve_completion_tokens=settings.quota.reserve_completion_tokens,
        release=lambda reservation: meter.settle(reservation, 0),
    )
    source = KeySource(settings.auth, store=create_key_store(settings))
    state = ProxyState(
        settings=settings,
        upstream=Upstream(client, settings.upstream, None if own is None else lambda: own.slots),
        counter=counter,
        compactor=Compactor(settings, counter, client, store, metrics),
        gate=Gate(settings, source),
        quotas=quotas,
        meter=meter,
        turns=TurnMemo(settings.cache.turn_memo_bytes),
        audit=AuditTrail(settings, metrics.registry),
    )
    metrics.registry.register(QuotaCollector(state.quotas, state.meter))
    metrics.registry.register(KeysCollector(source))
    recent = admin.RecentCompactions()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        upstream = redact_url(settings.upstream.base_url)
        log.info("proxying to %s", upstream, extra=startup_fields(settings))
        if own is not None:
            through = own.proxy_for(settings.upstream.base_url)
            if through is not None:
                log.info("upstream requests go through the proxy %s", through)
        await warm_up(state, own, metrics)
        probe = None
        if own is not None:
            probe = await start_probe(readiness, settings.server.warm_probe_s)
        reload_on_sighup(source)
        await source.start()
        try:
            async with metrics.running():
                yield
        finally:
            if probe is not None:
                probe.cancel()
            await state.compactor.aclose()  # summaries being made ahead of need
            await source.close()
            await state.meter.join()
            if state.audit is not None:
                await anyio.to_thread.run_sync(state.audit.close)
            await ledger.close()
            await client.aclose()
            await store.close()
            counter.close()

    app = Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET", "HEAD"]),
            Route("/readyz", readyz, methods=["GET", "HEAD"]),
            Route("/metrics", metrics.endpoint, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            WebSocketRoute("/v1/responses", refuse_websocket),
            Route("/v1/compress", compress, methods=["POST"]),
            Route("/v1/{path:path}", passthrough, methods=ALL_METHODS),
            # After /v1: each route a request is matched against costs it ~6k instructions.
            *admin.routes(),
            Route("/{path:path}", not_found, methods=ALL_METHODS),
        ],
        middleware=[Middleware(ExchangeMiddleware, sinks=[AccessLog(), metrics, recent])],
        exception_handlers={HTTPException: http_error, Exception: internal_error},
        lifespan=lifespan,
    )
    app.state.proxy = state
    app.state.readiness = readiness
    app.state.metrics = metrics
    # Where the admin page reads recent compactions (see proxy/admin/recent.py).
    app.state.recent_compactions = recent.recent
    return app


def _metrics_token(settings: Settings) -> str | None:
    """The token /metrics asks for (`server.metrics_token_env`), read now: a named variable
    that is not set fails the start, naming it."""
    env = settings.server.metrics_token_env
    if env is None:
        return None
    token = os.environ.get(env)
    if not token:
        raise ConfigError(f"server.metrics_token_env: environment variable {env} is not set")
    return token


def create_worker_app() -> Starlette:
    """The app of one `serve --workers N` process (a uvicorn factory: workers import it).

    Built from the settings the serve command resolved and left in the environment; the
    variable is removed at once, so nothing this process starts inherits the secrets in it.
    """
    text = os.environ.pop(WORKER_SETTINGS_ENV, None)
    if text is None:
        raise RuntimeError(f"{WORKER_SETTINGS_ENV} is not set: start workers with `serve`")
    return create_app(settings_from_json(text))


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    """200 unless a hard dependency is down (503 naming it); soft ones are reported, with
    status "degraded" (see readiness.py)."""
    readiness: Readiness = request.app.state.readiness
    ready, body = await readiness.report()
    return JSONResponse(body, status_code=200 if ready else 503)


async def not_found(request: Request) -> Response:
    return ProxyError(
        404,
        f"Unknown path {request.url.path!r}: this proxy serves the OpenAI API under /v1/ "
        "(set your client's base URL to http://HOST:PORT/v1).",
        code="unknown_url",
    ).response()


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own answers (no such route, method not allowed) in OpenAI's envelope."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404 and request.url.path.startswith("/v1/"):
        try:  # the router's patterns skip paths with line breaks: say what is wrong instead
            upstream_path(request.scope)
        except ProxyError as invalid:
            return invalid.response()
    if exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path!r}."
        code = "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    return ProxyError(exc.status_code, message, code=code, headers=exc.headers).response()


async def internal_error(request: Request, exc: Exception) -> Response:
    # An upstream that broke off mid-reply is logged where it happened, in one line; the
    # exception only makes the server abort the client's connection (the reply has begun).
    if not isinstance(exc, UpstreamBrokeOff):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
    return ProxyError(
        500,
        "The proxy hit an internal error; see its log.",
        type="server_error",
        code="internal_error",
    ).response()
