"""Start-up work, done by the lifespan before the server listens, so no request waits for it.

- each built encoding's first encode (tiktoken's regex state), and the counting profile of
  each model name the configuration names (`[models]`, `[compaction.models]`, the
  summarizer's model; see proxy.tokens.models.known_models): encoding, image and tool
  constants, memo salt. Other names are client input: each gets its profile on first use;
- the upstream pool bound to the loop (and for https, its TLS context: certifi's bundle
  loaded, ~20 ms), when the app has its own transport;
- the forwarding routes' latency histograms created, empty: a scrape shows them at count 0
  from the start;
- last, a full garbage collection, and what survives it frozen (`gc.freeze`): start-up
  leaves ~10^5 long-lived objects (the tokenizer's tables, imported modules) that the cyclic
  GC would otherwise scan in full during some early request, for several ms.

Code paths the first requests run are not rehearsed: the first request pays a few ms for
what Python has not run yet, once per process.

No connection is opened ahead of a request (the upstream client, aiohttp, opens connections
only for requests). With `server.warm_probe_s` set, `start_probe` runs the /readyz checks
once, which sends the upstream a `GET /models` (off by default: that is a request no client
sent).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

from proxy.metrics import Metrics
from proxy.readiness import Readiness
from proxy.state import ProxyState
from proxy.tokens.models import known_models
from proxy.transport import UpstreamTransport

log = logging.getLogger("proxy.app")

# Routes whose requests go upstream: their latency histograms are created at start.
FORWARDING_ROUTES = ("/v1/chat/completions", "/v1/{path:path}")


async def warm_up(
    state: ProxyState, transport: UpstreamTransport | None, metrics: Metrics | None = None
) -> float:
    """Seconds spent. Failures are logged and skipped: warming must never stop a start.
    Only an app with its own transport (not a test's injected one) binds its pool and
    freezes its start-up objects; in-process use under tests leaves the GC be."""
    started = time.perf_counter()
    serving = transport is not None
    try:
        warm = getattr(state.counter, "warm", None)
        if callable(warm):
            warm()
        prepare = getattr(state.counter, "prepare", None)
        if callable(prepare):
            prepare(known_models(state.settings))
        if transport is not None:
            settings = state.settings
            summarizer = settings.compaction.summarizer.base_url or settings.upstream.base_url
            transport.warm([settings.upstream.base_url, summarizer])
        if metrics is not None:
            metrics.prime(FORWARDING_ROUTES)
    except Exception:
        log.warning("start-up warm-up failed; the first request pays for it", exc_info=True)
    if serving:
        gc.collect()
        gc.freeze()
    return time.perf_counter() - started


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
