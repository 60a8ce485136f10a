"""Summary store: pay for each summary once, keep the forwarded prefix stable.

`chain_hashes` names every prefix of the history; a `SummaryStore` maps those names to
summaries (backends: memory, redis, none); `SummaryFlight` makes sure concurrent requests,
on one replica or several, pay for a given summary once. The redis backend is imported
lazily, so this package works without the `redis` extra.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from proxy.settings import CacheSettings, ConfigError
from proxy.store.chain import (
    CHAIN_VERSION,
    ChainMemo,
    canonical,
    chain_hashes,
    namespace_for,
    scope_for,
)
from proxy.store.memory import MemoryStore
from proxy.store.protocol import (
    LockingStore,
    LockResult,
    NullStore,
    StoredSummary,
    SummaryStore,
)
from proxy.store.singleflight import SingleFlight, SummaryFlight

__all__ = [
    "CHAIN_VERSION",
    "ChainMemo",
    "LockResult",
    "LockingStore",
    "MemoryStore",
    "NullStore",
    "SingleFlight",
    "StoredSummary",
    "SummaryFlight",
    "SummaryStore",
    "canonical",
    "chain_hashes",
    "create_store",
    "namespace_for",
    "redis_required",
    "scope_for",
]


@contextmanager
def redis_required(setting: str) -> Iterator[None]:
    """Around a lazy import of the redis backend: a missing `redis` package (the `redis` extra)
    becomes one config line naming the setting that asked for it."""
    try:
        yield
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] != "redis":
            raise
        raise ConfigError(
            f"{setting} = 'redis' needs the redis package: pip install 'compaction-proxy[redis]'"
        ) from None


def create_store(settings: CacheSettings) -> SummaryStore:
    """The backend `cache.backend` names. Raises ConfigError if redis is asked for but missing."""
    if settings.backend == "none":
        return NullStore()
    if settings.backend == "memory":
        return MemoryStore(settings.max_bytes, settings.ttl_s)
    with redis_required("cache.backend"):
        from proxy.store.redis import RedisStore
    from proxy.store.connect import connect, first_url, is_cluster

    url = settings.redis_url
    client = connect(url, socket_timeout_s=0.5) if is_cluster(url) else None
    return RedisStore(
        first_url(url), settings.key_prefix, settings.ttl_s, settings.lock_ttl_s, client=client
    )
