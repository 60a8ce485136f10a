"""Start-up work a first request would otherwise pay (~40 ms against ~1 ms warm).

Run by the lifespan before the server listens, so no request waits for it:

- the upstream pool bound to the loop (and for https, its TLS context: certifi's bundle
  loaded, ~20 ms);
- anyio's event-loop backend (imported on first use by the request path's task groups);
- each built encoding's first encode (tiktoken's regex state);
- the counting profile of each model name the configuration names (`[models]`,
  `[compaction.models]`, the summarizer's model; see proxy.tokens.models.known_models):
  encoding, image and tool constants, memo salt. Other names are client input: each gets
  its profile on first use;
- a rehearsal: a few chat requests, plain and streamed, through a second app built from the
  same settings (and the same token counter) against a throwaway upstream on 127.0.0.1,
  served by uvicorn's HTTP protocol (the class `serve` uses) on a throwaway port. It runs
  the request path's code (uvicorn's parser and response cycle, middleware, parsing,
  counting, compaction step, the upstream pool, the relay) until Python has specialised it,
  without touching the real app's metrics, logs, store, quotas or pool: nothing is sent to
  the upstream. Skipped with `--workers` (prometheus' multiprocess files are shared by
  every app in a process);
- in the real app: the middleware stack (Starlette builds it on the first request), the
  chat route's upstream URL parsed, and the forwarding routes' latency histograms created
  (empty: a scrape shows them at count 0 from the start);
- last, a full garbage collection, and what survives it frozen (`gc.freeze`): start-up
  leaves ~10^5 long-lived objects that the cyclic GC would otherwise scan in full during some
  early request (several ms).

Only a served app (uvicorn ran the lifespan and the app has its own transport) rehearses
and freezes; in-process use (tests, an injected transport) gets the cheap steps only.

Then `preconnect` opens one connection to the upstream (TCP, plus TLS for https) and leaves
it idle in the pool without writing a byte of HTTP, so the first request skips the handshake
(`server.warm_connect_s`, on by default; the upstream sees a connection, no request).
With `server.warm_probe_s` set, `start_probe` runs the /readyz checks once, which sends the
upstream a `GET /models` (off by default: that is a request no client sent).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette

from proxy import wire
from proxy.connections import ConnectionLimits
from proxy.logs import access_log
from proxy.metrics import Metrics, multiprocess_dir
from proxy.readiness import Readiness
from proxy.redact import redact_url
from proxy.settings import AuthSettings, CacheSettings, QuotaSettings, ServerSettings
from proxy.state import ProxyState
from proxy.tokens.models import known_models
from proxy.transport import ServedTransport, direct_transport

log = logging.getLogger("proxy.app")

REHEARSALS = 10  # per kind (plain, streamed): CPython specialises code after a few runs
CHAT_PATH = "chat/completions"
# Routes whose requests go upstream: their latency histograms are created at start.
FORWARDING_ROUTES = ("/v1/chat/completions", "/v1/{path:path}")
_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Say hello, warm-up ünïcödé 漢字."},
]
_REPLY = json.dumps(
    {
        "id": "chatcmpl-warm-up",
        "object": "chat.completion",
        "created": 0,
        "model": "warm-up",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22},
    }
).encode()  # fmt: skip
_CHUNK = json.dumps(
    {
        "id": "chatcmpl-warm-up",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "warm-up",
        "choices": [{"index": 0, "delta": {"content": "Hello!"}, "finish_reason": None}],
    }
).encode()
_SSE = b"data: " + _CHUNK + b"\n\ndata: " + _CHUNK + b"\n\ndata: [DONE]\n\n"


async def warm_up(
    app: Starlette,
    state: ProxyState,
    transport: ServedTransport | None,
    metrics: Metrics | None = None,
) -> float:
    """Seconds spent. Failures are logged and skipped: warming must never stop a start."""
    started = time.perf_counter()
    serving = transport is not None and transport.served  # else in-process, under tests
    try:
        if transport is not None and serving:
            transport.warm()
        async with anyio.create_task_group():  # imports anyio's asyncio backend (~15 ms)
            pass
        warm = getattr(state.counter, "warm", None)
        if callable(warm):
            warm()
        prepare = getattr(state.counter, "prepare", None)
        if callable(prepare):
            prepare(known_models(state.settings))
        if serving and multiprocess_dir() is None:
            await rehearse(state)
        if app.middleware_stack is None:
            app.middleware_stack = app.build_middleware_stack()
        state.upstream.prepare(CHAT_PATH)
        if metrics is not None:
            metrics.prime(FORWARDING_ROUTES)
    except Exception:
        log.warning("start-up warm-up failed; the first request pays for it", exc_info=True)
    if serving:
        gc.collect()
        gc.freeze()
    return time.perf_counter() - started


async def rehearse(state: ProxyState, rounds: int = REHEARSALS) -> None:
    """Chat requests through an app of its own (see the module docstring)."""
    from proxy.app import create_app  # the app module imports this one

    server = await asyncio.start_server(_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    settings = state.settings
    settings = settings.model_copy(
        update={
            "upstream": settings.upstream.model_copy(
                # Straight to the throwaway upstream, never through an egress proxy.
                update={
                    "base_url": f"http://127.0.0.1:{port}/v1",
                    "proxy_url": None,
                    "proxy_from_env": False,
                }
            ),
            "server": ServerSettings(),  # body limits and such: a rehearsal must pass them
            "auth": AuthSettings(),
            "quota": QuotaSettings(backend="memory"),
            "cache": CacheSettings(backend="memory"),
        }
    )
    transport = ServedTransport(httpx.Limits(max_connections=4))
    transport.serve()
    app = create_app(settings, counter=state.counter, transport=transport)
    front, connections = await _serve_protocol(app, state.settings.server)
    front_port = front.sockets[0].getsockname()[1]
    was_disabled, access_log.disabled = access_log.disabled, True
    try:
        await _send_rehearsals(
            httpx.URL(f"http://127.0.0.1:{front_port}/v1/chat/completions"), rounds
        )
    finally:
        access_log.disabled = was_disabled
        front.close()
        for connection in list(connections):
            connection.shutdown()
        await front.wait_closed()
        await app.state.proxy.upstream.client.aclose()
        server.close()
        await server.wait_closed()


async def _send_rehearsals(url: httpx.URL, rounds: int) -> None:
    """The rehearsal's client: `proxy.wire` on one keep-alive connection."""
    pool = wire.WirePool(None, 1)
    try:
        for _ in range(rounds):
            for stream in (False, True):
                body = json.dumps({"model": "warm-up", "messages": _MESSAGES, "stream": stream})
                content = body.encode()
                headers = [
                    (b"host", url.netloc),
                    (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(content)),
                ]
                data = wire.request_bytes("POST", url, headers, content)
                assert data is not None
                reply = await wire.send(pool, url, data, {"connect": 5.0, "read": 30.0}, _no_slot)
                try:
                    await reply.aread()
                finally:
                    await reply.aclose()
    finally:
        pool.close()


def _no_slot() -> None:
    """(The rehearsal's requests hold no pool slot.)"""


async def _serve_protocol(
    app: Starlette, server: ServerSettings
) -> tuple[asyncio.Server, set[Any]]:
    """`app` behind the HTTP protocol `serve` runs (uvicorn's httptools one with the proxy's
    limits), on a throwaway port of 127.0.0.1; the protocols' set of open connections.
    No access line: the protocol's own is off, whatever uvicorn's logging says."""
    import uvicorn
    from uvicorn.server import ServerState

    limits = ConnectionLimits(
        server.max_connections, server.header_timeout_s, server.body_timeout_s
    )
    factory: Any = limits  # a protocol factory, as `serve` passes it (uvicorn types a class)
    config = uvicorn.Config(app, http=factory, lifespan="off", ws="none", log_config=None)
    config.load()
    server_state = ServerState()

    def protocol() -> asyncio.Protocol:
        made = limits(config=config, server_state=server_state, app_state={})
        made.access_log = False
        return made

    front = await asyncio.get_running_loop().create_server(protocol, "127.0.0.1", 0)
    return front, server_state.connections


async def preconnect(state: ProxyState, wait_s: float) -> asyncio.Task[None] | None:
    """One connection to the upstream opened now and left idle in the pool (see the module
    docstring), when the upstream is reached directly over the served pool (not
    through an egress proxy's mount, see proxy.egress: then nothing is opened). Waits up to
    `wait_s`: a slow or absent upstream delays the start by no more than that, and a failure
    is one DEBUG line (the first request then connects, and fails, as it would have). The
    task is returned when still running, to be cancelled at shutdown."""
    if wait_s <= 0:
        return None
    upstream = state.upstream
    url = upstream.prepare(CHAT_PATH)
    direct = direct_transport(upstream.client, url)
    if direct is None:
        return None
    timeout_s = state.settings.upstream.connect_timeout_s
    task = asyncio.create_task(direct.preconnect(url, timeout_s))

    def done(finished: asyncio.Task[None]) -> None:
        if not finished.cancelled() and finished.exception() is not None:
            log.debug(
                "start-up connection to %s failed: %r",
                redact_url(upstream.base_url),
                finished.exception(),
            )

    task.add_done_callback(done)
    await asyncio.wait({task}, timeout=wait_s)
    return None if task.done() else task


async def start_probe(readiness: Readiness, wait_s: float) -> asyncio.Task[object] | None:
    """The /readyz checks once, now: the upstream probe opens the pool's first connection
    (and Redis', when configured), and its answer is kept like any probe's, so a load
    balancer's first poll costs the upstream nothing more. Waits up to `wait_s`, so a slow
    or absent upstream delays the start by no more than that; the task is returned to be
    cancelled at shutdown when it is still running."""
    if wait_s <= 0:
        return None
    task: asyncio.Task[object] = asyncio.create_task(readiness.report())
    done, _ = await asyncio.wait({task}, timeout=wait_s)
    if done and task.exception() is not None:
        log.warning("start-up readiness probe failed: %r", task.exception())
    return None if done else task


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A minimal HTTP/1.1 upstream: a JSON reply, or SSE for a body asking to stream."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = await reader.readexactly(length)
            sse = b'"stream":true' in body.replace(b" ", b"")
            payload = _SSE if sse else _REPLY
            kind = b"text/event-stream" if sse else b"application/json"
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: " + kind
                + b"\r\ncontent-length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
            )  # fmt: skip
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()
