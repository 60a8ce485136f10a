"""Summary store: pay for each summary once, keep the forwarded prefix stable.

`chain_hashes` names every prefix of the history; a `SummaryStore` maps those names to
summaries over a backend (bytes get/set/lock: memory, redis, or none), matching entries to
prefixes and handling outages once for all; `SummaryFlight` makes sure concurrent
requests, on one replica or several, pay for a given summary once.

A backend is one file plus one line in `BACKENDS`. The redis backend is imported lazily,
so this package works without the `redis` extra.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from proxy.redact import redact_url
from proxy.settings import CacheSettings, ConfigError
from proxy.store.chain import (
    CHAIN_VERSION,
    canonical,
    chain_hashes,
    namespace_for,
    scope_for,
)
from proxy.store.memory import MemoryBackend
from proxy.store.protocol import Backend, StoredSummary, StoreUnavailable
from proxy.store.singleflight import SingleFlight, SummaryFlight
from proxy.store.store import LockResult, NullStore, SummaryStore

__all__ = [
    "BACKENDS",
    "CHAIN_VERSION",
    "Backend",
    "LockResult",
    "MemoryBackend",
    "NullStore",
    "SingleFlight",
    "StoreUnavailable",
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


def _memory(settings: CacheSettings) -> Backend:
    return MemoryBackend(settings.max_bytes, settings.ttl_s)


def _redis(settings: CacheSettings) -> Backend:
    with redis_required("cache.backend"):
        from proxy.store.redis import RedisBackend
    from proxy.store.connect import connect, first_url, is_cluster

    url = settings.redis_url
    client = connect(url, socket_timeout_s=0.5) if is_cluster(url) else None
    return RedisBackend(first_url(url), settings.key_prefix, settings.ttl_s, client=client)


# `cache.backend` -> the backend it names (None: no store).
BACKENDS: dict[str, Callable[[CacheSettings], Backend] | None] = {
    "memory": _memory,
    "redis": _redis,
    "none": None,
}


def create_store(settings: CacheSettings) -> SummaryStore:
    """The store `cache.backend` names. Raises ConfigError if redis is asked for but missing."""
    make = BACKENDS[settings.backend]
    if make is None:
        return NullStore()
    where = ""
    if settings.backend == "redis":
        from proxy.store.connect import first_url

        where = redact_url(first_url(settings.redis_url))
    return SummaryStore(make(settings), lock_ttl_s=settings.lock_ttl_s, where=where)
