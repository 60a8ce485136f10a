"""`/readyz`: is each thing a request needs there? Upstream, Redis (when configured), tokenizer.

A load balancer polls this every few seconds on every replica, so each probe's answer is
kept for `server.readiness_cache_s` and concurrent polls share one probe: an upstream never
sees more than one probe per replica per period. `/healthz` stays a liveness check (the
process answers), so an upstream outage takes replicas out of rotation without restarting
them.

The upstream probe is `GET <base_url>/models` without credentials: any HTTP answer (a 401
included) proves the upstream is reachable; only a transport failure or a timeout counts as
down. Nothing echoed here holds a credential: hosts are shown without `user:pass@`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from proxy.redact import host_of, redact_url
from proxy.settings import Settings

Clock = Callable[[], float]

_PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class CheckResult:
    ok: bool
    detail: Mapping[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"ok": self.ok, **self.detail}


Probe = Callable[[], Awaitable[CheckResult]]


class _Cached:
    """One probe's latest answer, refreshed at most once per `ttl_s`, one probe at a time."""

    def __init__(self, probe: Probe, ttl_s: float, timeout_s: float, clock: Clock) -> None:
        self.probe = probe
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.result: CheckResult | None = None
        self.at = float("-inf")
        self.lock = asyncio.Lock()

    async def get(self) -> CheckResult:
        if self.result is not None and self.clock() - self.at < self.ttl_s:
            return self.result
        async with self.lock:
            if self.result is None or self.clock() - self.at >= self.ttl_s:
                try:
                    async with asyncio.timeout(self.timeout_s):
                        self.result = await self.probe()
                except TimeoutError:
                    self.result = CheckResult(False, {"error": f"no answer in {self.timeout_s:g}s"})
                self.at = self.clock()
            return self.result


class Readiness:
    """The named checks; `report()` runs them (cached) and says which failed."""

    def __init__(
        self,
        probes: Mapping[str, Probe],
        *,
        cache_s: float = 5.0,
        timeout_s: float = 2.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.checks = {
            name: _Cached(probe, cache_s, timeout_s, clock) for name, probe in probes.items()
        }

    async def report(self) -> tuple[bool, dict[str, Any]]:
        names = list(self.checks)
        results = await asyncio.gather(*(self.checks[name].get() for name in names))
        failing = [name for name, result in zip(names, results, strict=True) if not result.ok]
        body: dict[str, Any] = {
            "status": "ready" if not failing else "not_ready",
            "checks": {name: result.as_json() for name, result in zip(names, results, strict=True)},
        }
        if failing:
            body["failing"] = failing
        return not failing, body


def upstream_probe(client: httpx.AsyncClient, base_url: str, timeout_s: float) -> Probe:
    url = f"{base_url.rstrip('/')}/models"
    host = host_of(base_url)

    async def probe() -> CheckResult:
        started = time.perf_counter()
        if client.is_closed:
            return CheckResult(False, {"host": host, "error": "client closed (shutting down)"})
        try:
            response = await client.get(url, timeout=timeout_s)
            await response.aclose()
        except httpx.HTTPError as exc:
            return CheckResult(False, {"host": host, "error": type(exc).__name__})
        latency = round((time.perf_counter() - started) * 1000, 1)
        return CheckResult(True, {"host": host, "status": response.status_code, "ms": latency})

    return probe


class Pingable(Protocol):
    async def ping(self) -> None: ...


def redis_probe(store: Pingable, where: str) -> Probe:
    """`where`: the store's address with credentials already removed."""

    async def probe() -> CheckResult:
        try:
            await store.ping()
        except Exception as exc:  # any failure to answer is "down"; the class name says which
            return CheckResult(False, {"url": where, "error": type(exc).__name__})
        return CheckResult(True, {"url": where})

    return probe


def readiness_for(
    settings: Settings, client: httpx.AsyncClient, store: object, estimated: Callable[[], bool]
) -> Readiness:
    """The checks this configuration calls for: Redis only with `cache.backend = "redis"`."""
    probes = {
        "upstream": upstream_probe(client, settings.upstream.base_url, _PROBE_TIMEOUT_S),
        "tokenizer": tokenizer_probe(estimated),
    }
    if settings.cache.backend == "redis" and hasattr(store, "ping"):
        from proxy.store.connect import first_url  # the redis extra is installed: store is one

        probes["redis"] = redis_probe(store, redact_url(first_url(settings.cache.redis_url)))
    return Readiness(probes, cache_s=settings.server.readiness_cache_s, timeout_s=_PROBE_TIMEOUT_S)


def tokenizer_probe(estimated: Callable[[], bool]) -> Probe:
    """Loaded at start (or start fails); with `tokenizer.on_missing = "estimate"` and files
    missing, ready but counting by estimate, as configured."""

    async def probe() -> CheckResult:
        return CheckResult(True, {"mode": "estimate" if estimated() else "tiktoken"})

    return probe
