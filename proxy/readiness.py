"""`/readyz`: is each thing a request needs there? Upstream, Redis (when configured), tokenizer.

A dependency is hard or soft. Hard: requests fail without it (the upstream; the quota
store under `quota.on_redis_error = "closed"`); one that is down makes `/readyz` answer 503,
so a load balancer takes the replica out. Soft: requests keep flowing without it (the
summary store, which degrades to "no store"; the quota store under the default fail-open);
one that is down is reported (`"soft": true`, status `degraded`, named in `failing`) but the
answer stays 200: Redis going away must not take every replica out of rotation at once.
`server.readiness_strict = true` treats every dependency as hard.

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
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

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
    """The named checks; `report()` runs them (cached) and says which failed.

    `soft` names the checks whose failure is reported without making the replica unready.
    """

    def __init__(
        self,
        probes: Mapping[str, Probe],
        *,
        soft: Collection[str] = (),
        cache_s: float = 5.0,
        timeout_s: float = 2.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.checks = {
            name: _Cached(probe, cache_s, timeout_s, clock) for name, probe in probes.items()
        }
        self.soft = frozenset(soft)

    async def report(self) -> tuple[bool, dict[str, Any]]:
        """(ready, the JSON body): ready unless a hard check fails."""
        names = list(self.checks)
        answers = await asyncio.gather(*(self.checks[name].get() for name in names))
        results = dict(zip(names, answers, strict=True))
        failing = [name for name in names if not results[name].ok]
        blocking = [name for name in failing if name not in self.soft]
        checks: dict[str, Any] = {}
        for name in names:
            checks[name] = results[name].as_json()
            if name in self.soft:
                checks[name]["soft"] = True
        status = "not_ready" if blocking else "degraded" if failing else "ready"
        body: dict[str, Any] = {"status": status, "checks": checks}
        if failing:
            body["failing"] = failing
        return not blocking, body


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
    def ping(self) -> Awaitable[object]: ...


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
    settings: Settings,
    client: httpx.AsyncClient,
    store: object,
    estimated: Callable[[], bool],
    ledger: object = None,
) -> Readiness:
    """The checks this configuration calls for: `redis` (the summary store, soft) with
    `cache.backend = "redis"`; `quota` (the quota store; soft when it fails open) when the
    quota ledger is on Redis. `server.readiness_strict` makes every check hard."""
    probes = {
        "upstream": upstream_probe(client, settings.upstream.base_url, _PROBE_TIMEOUT_S),
        "tokenizer": tokenizer_probe(estimated),
    }
    soft: set[str] = set()
    if settings.cache.backend == "redis" and hasattr(store, "ping"):
        from proxy.store.connect import first_url  # the redis extra is installed: store is one

        probes["redis"] = redis_probe(store, redact_url(first_url(settings.cache.redis_url)))
        soft.add("redis")  # a store outage means no reuse, never a failed request
    quota_redis = _ledger_redis(ledger)
    if quota_redis is not None:
        from proxy.store.connect import first_url

        url = settings.quota.redis_url or settings.cache.redis_url
        probes["quota"] = redis_probe(quota_redis, redact_url(first_url(url)))
        if settings.quota.on_redis_error == "open":
            soft.add("quota")
    return Readiness(
        probes,
        soft=() if settings.server.readiness_strict else soft,
        cache_s=settings.server.readiness_cache_s,
        timeout_s=_PROBE_TIMEOUT_S,
    )


def _ledger_redis(ledger: object) -> Pingable | None:
    """What answers PING for a Redis quota ledger: its own `ping`, else its redis-py client's
    (`RedisLedger.client`); None for the memory ledger."""
    if getattr(ledger, "name", None) != "redis":
        return None
    for candidate in (ledger, getattr(ledger, "client", None)):
        if callable(getattr(candidate, "ping", None)):
            return cast(Pingable, candidate)
    return None


def tokenizer_probe(estimated: Callable[[], bool]) -> Probe:
    """Loaded at start (or start fails); with `tokenizer.on_missing = "estimate"` and files
    missing, ready but counting by estimate, as configured."""

    async def probe() -> CheckResult:
        return CheckResult(True, {"mode": "estimate" if estimated() else "tiktoken"})

    return probe
