"""The store over the in-process backend: lookups by prefix, byte bound, TTL, the null
store, the factory, and the outage policy every backend gets from the one wrapper."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import pytest

from proxy.compaction.protocol import Usage
from proxy.settings import CacheSettings, ConfigError
from proxy.store import (
    BACKENDS,
    MemoryBackend,
    NullStore,
    StoredSummary,
    StoreUnavailable,
    SummaryStore,
    create_store,
)
from proxy.store.protocol import Backend

KEYS = [f"k{i}" for i in range(1, 11)]  # KEYS[k-1] names the k-message prefix


def summary(length: int, text: str = "") -> StoredSummary:
    return StoredSummary(text or f"s{length}", length, 7, Usage(100, 20), 1.5)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def MemoryStore(max_bytes: int, ttl_s: float, **options: Any) -> SummaryStore:
    return SummaryStore(MemoryBackend(max_bytes, ttl_s, **options))


def backend_of(store: SummaryStore) -> MemoryBackend:
    assert isinstance(store.backend, MemoryBackend)
    return store.backend


async def test_lookup_finds_every_stored_prefix_longest_first() -> None:
    store = MemoryStore(1_000_000, 3600)
    assert await store.lookup(KEYS, 10) == []
    for k in (2, 5, 8):
        await store.put(KEYS[k - 1], summary(k))
    assert await store.get(KEYS[4]) == summary(5)
    assert [s.length for s in await store.lookup(KEYS, 10)] == [8, 5, 2]
    assert [s.length for s in await store.lookup(KEYS, 6)] == [5, 2]
    assert [s.length for s in await store.lookup(KEYS[:4], 100)] == [2]
    assert await store.lookup(KEYS, 1) == [] and await store.lookup(KEYS, 0) == []
    assert [s.length for s in await store.lookup(KEYS, 10, lambda k: k != 8)] == [5, 2]
    assert isinstance(store.backend, Backend) and not store.shared


async def test_entry_under_the_wrong_length_is_ignored() -> None:
    store = MemoryStore(1_000_000, 3600)
    await store.put(KEYS[2], summary(4))  # claims 4 messages under the 3-message key
    await store.put(KEYS[0], summary(1))
    assert await store.lookup(KEYS, 10) == [summary(1)]


async def test_byte_bound_evicts_oldest() -> None:
    one = MemoryStore(10_000_000, 3600)
    await one.put(KEYS[0], summary(1, "x" * 1000))
    entry_bytes = backend_of(one).bytes_used
    assert entry_bytes >= 1000

    store = MemoryStore(entry_bytes * 3, 3600)
    for k in (1, 2, 3):
        await store.put(KEYS[k - 1], summary(k, "x" * 1000))
    backend = backend_of(store)
    assert len(backend) == 3
    await store.put(KEYS[3], summary(4, "x" * 1000))
    assert len(backend) == 3
    assert backend.bytes_used <= backend.max_bytes
    assert await store.get(KEYS[0]) is None  # the oldest went
    assert [s.length for s in await store.lookup(KEYS, 10)] == [4, 3, 2]
    assert backend._cache.present == {KEYS[1], KEYS[2], KEYS[3]}  # the probe set follows


async def test_entry_bigger_than_the_bound_is_skipped() -> None:
    store = MemoryStore(5_000, 3600)
    await store.put(KEYS[0], summary(1))
    await store.put(KEYS[1], summary(2, "y" * 10_000))
    assert await store.get(KEYS[1]) is None
    assert await store.get(KEYS[0]) == summary(1)


async def test_ttl_with_injected_timer() -> None:
    clock = Clock()
    store = MemoryStore(1_000_000, 60, timer=clock)
    await store.put(KEYS[0], summary(1))
    clock.now = 59.0
    assert await store.lookup(KEYS, 10) == [summary(1)]
    clock.now = 60.5
    assert await store.lookup(KEYS, 10) == []
    assert len(backend_of(store)) == 0
    await store.put(KEYS[1], summary(2))
    assert backend_of(store)._cache.present == {KEYS[1]}  # the expired key left it too


async def test_null_store() -> None:
    store = NullStore()
    await store.put(KEYS[0], summary(1))
    assert await store.get(KEYS[0]) is None
    assert await store.lookup(KEYS, 10) == []
    assert await store.acquire_lock(KEYS[0], "t") == "unavailable"
    assert (store.name, store.available) == ("none", False)
    await store.close()


def test_summary_encoding_round_trip_and_strictness() -> None:
    s = StoredSummary("résumé \ud800", 3, 12, Usage(1, 2), 1.25)
    assert StoredSummary.decode(s.encode()) == s
    for bad in (b"", b"[]", b'{"v": 2}', b'{"v": 1, "text": "t"}', b"\xff"):
        with pytest.raises(ValueError):
            StoredSummary.decode(bad)
    tampered = s.encode().replace(b'"length":3', b'"length":"3"')
    with pytest.raises(ValueError):
        StoredSummary.decode(tampered)


async def test_create_store_backends() -> None:
    none = create_store(CacheSettings(backend="none"))
    assert none.backend is None and none.name == "none"
    memory = create_store(CacheSettings(backend="memory", max_bytes=1234, ttl_s=5))
    assert backend_of(memory).max_bytes == 1234 and memory.name == "memory"
    redis_store = create_store(CacheSettings(backend="redis", lock_ttl_s=7))
    assert redis_store.name == "redis" and redis_store.shared and redis_store.lock_ttl_s == 7
    await redis_store.close()
    assert set(BACKENDS) == {"memory", "redis", "none"}


def test_create_store_without_redis_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name == "redis" or name.startswith("redis."):
            monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "redis", None)
    monkeypatch.delitem(sys.modules, "proxy.store.redis", raising=False)
    with pytest.raises(ConfigError, match=r"compaction-proxy\[redis\]"):
        create_store(CacheSettings(backend="redis"))
    assert create_store(CacheSettings(backend="memory")).name == "memory"


class DictBackend:
    """A backend of a dozen lines, as a new one would be: bytes by key, a lock, an outage."""

    name = "dict"
    shared = True

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.locks: dict[str, str] = {}
        self.down = False
        self.calls = 0

    def _check(self) -> None:
        self.calls += 1
        if self.down:
            raise StoreUnavailable("DictDown")

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        self._check()
        return [self.values.get(k) for k in keys]

    async def set(self, key: str, value: bytes) -> None:
        self._check()
        self.values[key] = value

    async def lock(self, key: str, token: str, ttl_s: float) -> bool:
        self._check()
        return self.locks.setdefault(key, token) == token

    async def unlock(self, key: str, token: str) -> None:
        self._check()
        if self.locks.get(key) == token:
            del self.locks[key]

    async def ping(self) -> None:
        self._check()

    async def close(self) -> None:
        return None


async def test_any_backend_gets_matching_and_the_outage_policy_from_the_wrapper(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    backend = DictBackend()
    store = SummaryStore(backend, retry_after_s=2.0, clock=clock, where="dict://here")
    await store.put(KEYS[1], summary(2))
    backend.values[KEYS[4]] = summary(9).encode()  # mislabelled: a miss
    backend.values[KEYS[6]] = b"not json"  # unreadable: a miss
    assert await store.lookup(KEYS, 10) == [summary(2)]
    assert await store.acquire_lock(KEYS[0], "a") == "acquired"
    assert await store.acquire_lock(KEYS[0], "b") == "held"

    backend.down = True
    caplog.set_level("WARNING", logger="proxy.store")
    assert await store.lookup(KEYS, 10) == []  # fails open
    assert await store.acquire_lock(KEYS[0], "b") == "unavailable"  # not even tried
    await store.put(KEYS[0], summary(1))
    assert (store.available, store.errors, store.last_error) == (False, 1, "DictDown")
    assert backend.calls == 5  # the retry-after window spares the backend
    clock.now += 2.5
    backend.down = False
    assert await store.lookup(KEYS, 10) == [summary(2)]
    assert store.available
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "failed" in r.message]
    assert len(warnings) == 1 and "dict://here" in warnings[0].message
