"""Start-up work, done by the lifespan before the server listens, so no request waits for it.

- each built encoding's first encode (tiktoken's regex state), and the counting profile of
  each model name the configuration names (`[models]`, `[compaction.models]`, the
  summarizer's model; see proxy.tokens.models.known_models): encoding, image and tool
  constants, memo salt. Other names are client input: each gets its profile on first use;
- the upstream pool bound to the loop (and for https, its TLS context: certifi's bundle
  loaded, ~20 ms);
- the forwarding routes' latency histograms created, empty: a scrape shows them at count 0
  from the start;
- last, a full garbage collection, and what survives it frozen (`gc.freeze`): start-up
  leaves ~10^5 long-lived objects (the tokenizer's tables, imported modules) that the cyclic
  GC would otherwise scan in full during some early request, for several ms.

Code paths the first requests run are not rehearsed: the first request pays a few ms for
what Python has not run yet, once per process.

Then `preconnect` opens one connection to the upstream (TCP, plus TLS for https) and leaves
it idle in the pool without writing a byte of HTTP, so the first request skips the handshake
(`server.warm_connect_s`, on by default; the upstream sees a connection, no request).
With `server.warm_probe_s` set, `start_probe` runs the /readyz checks once, which sends the
upstream a `GET /models` (off by default: that is a request no client sent).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

from proxy.metrics import Metrics
from proxy.readiness import Readiness
from proxy.redact import redact_url
from proxy.state import ProxyState
from proxy.tokens.models import known_models
from proxy.transport import ServedTransport, direct_transport

log = logging.getLogger("proxy.app")

CHAT_PATH = "chat/completions"
# Routes whose requests go upstream: their latency histograms are created at start.
FORWARDING_ROUTES = ("/v1/chat/completions", "/v1/{path:path}")


async def warm_up(
    state: ProxyState, transport: ServedTransport | None, metrics: Metrics | None = None
) -> float:
    """Seconds spent. Failures are logged and skipped: warming must never stop a start.
    Only a served app (uvicorn ran the lifespan and the app has its own transport) freezes
    its start-up objects; in-process use (tests, an injected transport) leaves the GC be."""
    started = time.perf_counter()
    serving = transport is not None and transport.served  # else in-process, under tests
    try:
        warm = getattr(state.counter, "warm", None)
        if callable(warm):
            warm()
        prepare = getattr(state.counter, "prepare", None)
        if callable(prepare):
            prepare(known_models(state.settings))
        if transport is not None and serving:
            transport.warm()
        if metrics is not None:
            metrics.prime(FORWARDING_ROUTES)
    except Exception:
        log.warning("start-up warm-up failed; the first request pays for it", exc_info=True)
    if serving:
        gc.collect()
        gc.freeze()
    return time.perf_counter() - started


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
