"""Redis store: summaries shared by every replica, with an expiring lock for single flight.

Values are StoredSummary JSON under `<prefix>summary:<chain hash>`, every key with a TTL.
A lookup is one MGET over the probed chain keys. Short socket timeouts and a retry-after
window keep an outage from stalling requests: while Redis is failing, every method answers
"nothing stored" at once, counts the error and logs (rate-limited, credentials redacted).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from proxy.store.protocol import (
    LockResult,
    RateLimitedLog,
    StoredSummary,
    matches,
    probe_range,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# Delete the lock only if it is still ours: after expiry it may belong to another replica.
_RELEASE_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""

_OUTAGE = (RedisError, OSError, TimeoutError)


def redact_url(url: str) -> str:
    """scheme://host:port/db without user or password, for logs."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<unparsable redis url>"
    return f"{parts.scheme}://{host}{port}{parts.path}"


class RedisStore:
    """See the module docstring. `client` and `clock` are injectable (tests, shared pools)."""

    name = "redis"

    def __init__(
        self,
        url: str,
        key_prefix: str,
        ttl_s: int,
        lock_ttl_s: float,
        *,
        socket_timeout_s: float = 0.5,
        connect_timeout_s: float = 0.5,
        retry_after_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        client: Redis | RedisCluster | None = None,
    ) -> None:
        self.available = True
        self.errors = 0
        self.last_error: str | None = None  # exception class name only
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        self.lock_ttl_s = lock_ttl_s
        self._retry_after_s = retry_after_s
        self._retry_at = float("-inf")
        self._clock = clock
        self._where = redact_url(url)
        self._log = RateLimitedLog(log, clock=clock)
        if client is None:
            # One retry, on connection errors only: a pooled connection that went stale across
            # a Redis restart reconnects at once, while a timeout never doubles the stall.
            client = Redis.from_url(
                url,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=connect_timeout_s,
                retry=Retry(NoBackoff(), 1, (RedisConnectionError,)),
            )
        self._client = client
        # A cluster spreads prefix keys over slots: one MGET per node instead of one in all.
        self._cluster = isinstance(client, RedisCluster)
        self._release = client.register_script(_RELEASE_LUA)

    def summary_key(self, key: str) -> str:
        return f"{self.key_prefix}summary:{key}"

    def lock_key(self, key: str) -> str:
        return f"{self.key_prefix}lock:{key}"

    async def _guarded(self, op: str, call: Callable[[], Awaitable[T]], default: T) -> T:
        """Run one Redis call; on failure answer `default`, never raise (cancellation aside)."""
        if self._clock() < self._retry_at:
            return default
        try:
            result = await call()
        except _OUTAGE as exc:
            self.errors += 1
            self.available = False
            self.last_error = type(exc).__name__
            self._retry_at = self._clock() + self._retry_after_s
            self._log.warning(
                "summary store: redis %s failed at %s (%s); continuing without the store "
                "for %.1fs (errors=%d)",
                op, self._where, type(exc).__name__, self._retry_after_s, self.errors,
            )  # fmt: skip
            return default
        self.available = True
        return result

    def _decode(self, raw: bytes | str | None) -> StoredSummary | None:
        if raw is None:
            return None
        try:
            return StoredSummary.decode(raw)
        except ValueError as exc:
            self._log.warning("summary store: ignoring unreadable entry (%s)", exc)
            return None

    async def _mget(self, keys: list[str], max_length: int) -> list[StoredSummary | None]:
        """Entries for prefixes 1..n, in order, in one MGET; a length mismatch reads as absent."""
        probed = probe_range(keys, max_length)
        if not probed:
            return []

        async def call() -> list[bytes | str | None]:
            names = [self.summary_key(k) for k in probed]
            if isinstance(self._client, RedisCluster):
                return await self._client.mget_nonatomic(names)
            return await self._client.mget(names)

        empty: list[bytes | str | None] = []
        raws = await self._guarded("mget", call, empty)
        return [matches(self._decode(raw), i + 1) for i, raw in enumerate(raws)]

    async def get(self, key: str) -> StoredSummary | None:
        async def call() -> bytes | str | None:
            return await self._client.get(self.summary_key(key))

        return self._decode(await self._guarded("get", call, None))

    async def longest(self, keys: list[str], max_length: int) -> StoredSummary | None:
        for summary in reversed(await self._mget(keys, max_length)):
            if summary is not None:
                return summary
        return None

    async def lookup_all(self, keys: list[str], max_length: int) -> list[StoredSummary]:
        return [s for s in reversed(await self._mget(keys, max_length)) if s is not None]

    async def put(self, key: str, summary: StoredSummary) -> None:
        async def call() -> object:
            return await self._client.set(self.summary_key(key), summary.encode(), ex=self.ttl_s)

        await self._guarded("set", call, None)

    async def acquire_lock(self, key: str, token: str) -> LockResult:
        """SET NX PX lock_ttl_s: if the holder dies, the lock expires on its own."""
        ttl_ms = max(1, int(self.lock_ttl_s * 1000))

        async def call() -> LockResult:
            taken = await self._client.set(self.lock_key(key), token, nx=True, px=ttl_ms)
            return "acquired" if taken else "held"

        return await self._guarded("lock", call, "unavailable")

    async def release_lock(self, key: str, token: str) -> None:
        async def call() -> object:
            return await self._release(keys=[self.lock_key(key)], args=[token])

        await self._guarded("unlock", call, None)

    async def ping(self) -> None:
        """Raises unless Redis answers now (readiness: not guarded like the calls above)."""
        await self._client.ping()

    async def close(self) -> None:
        with contextlib.suppress(*_OUTAGE):
            await self._client.aclose()
