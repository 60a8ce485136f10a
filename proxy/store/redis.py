"""Redis backend: summaries shared by every replica, with an expiring lock for single flight.

Values under `<prefix>summary:<chain hash>`, every key with a TTL; a lookup is one MGET
(per node on a cluster). Short socket timeouts keep an outage from stalling requests; every
failure is a StoreUnavailable naming the exception's class (the store's wrapper decides
what to do about it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from proxy.store.protocol import StoreUnavailable

# Delete the lock only if it is still ours: after expiry it may belong to another replica.
_RELEASE_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""

_OUTAGE = (RedisError, OSError, TimeoutError)


class RedisBackend:
    """See the module docstring. `client` is injectable (tests, shared pools)."""

    name = "redis"
    shared = True

    def __init__(
        self,
        url: str,
        key_prefix: str,
        ttl_s: int,
        *,
        socket_timeout_s: float = 0.5,
        connect_timeout_s: float = 0.5,
        client: Redis | RedisCluster | None = None,
    ) -> None:
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
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
        self._release = client.register_script(_RELEASE_LUA)

    def summary_key(self, key: str) -> str:
        return f"{self.key_prefix}summary:{key}"

    def lock_key(self, key: str) -> str:
        return f"{self.key_prefix}lock:{key}"

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        names = [self.summary_key(k) for k in keys]
        with _outage():
            if isinstance(self._client, RedisCluster):  # prefix keys spread over slots
                found: list[Any] = await self._client.mget_nonatomic(names)
            else:
                found = await self._client.mget(names)
        return [value.encode() if isinstance(value, str) else value for value in found]

    async def set(self, key: str, value: bytes) -> None:
        with _outage():
            await self._client.set(self.summary_key(key), value, ex=self.ttl_s)

    async def lock(self, key: str, token: str, ttl_s: float) -> bool:
        """SET NX PX: if the holder dies, the lock expires on its own."""
        with _outage():
            taken = await self._client.set(
                self.lock_key(key), token, nx=True, px=max(1, int(ttl_s * 1000))
            )
        return bool(taken)

    async def unlock(self, key: str, token: str) -> None:
        with _outage():
            await self._release(keys=[self.lock_key(key)], args=[token])

    async def ping(self) -> None:
        await self._client.ping()

    async def close(self) -> None:
        with contextlib.suppress(*_OUTAGE):
            await self._client.aclose()


@contextlib.contextmanager
def _outage() -> Any:
    try:
        yield
    except _OUTAGE as exc:
        raise StoreUnavailable(type(exc).__name__) from None
