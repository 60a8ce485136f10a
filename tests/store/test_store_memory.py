"""The in-process store: lookups by prefix, byte bound, TTL, null store and the factory."""

from __future__ import annotations

import sys

import pytest

from proxy.compaction.protocol import Usage
from proxy.settings import CacheSettings, ConfigError
from proxy.store import MemoryStore, NullStore, create_store
from proxy.store.protocol import LockingStore, StoredSummary, SummaryStore

KEYS = [f"k{i}" for i in range(1, 11)]  # KEYS[k-1] names the k-message prefix


def summary(length: int, text: str = "") -> StoredSummary:
    return StoredSummary(text or f"s{length}", length, 7, Usage(100, 20), 1.5)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_longest_and_lookup_all() -> None:
    store = MemoryStore(1_000_000, 3600)
    assert await store.longest(KEYS, 10) is None
    assert await store.lookup_all(KEYS, 10) == []
    for k in (2, 5, 8):
        await store.put(KEYS[k - 1], summary(k))
    assert await store.get(KEYS[4]) == summary(5)
    assert await store.longest(KEYS, 10) == summary(8)
    assert await store.longest(KEYS, 8) == summary(8)
    assert await store.longest(KEYS, 7) == summary(5)
    assert await store.longest(KEYS, 1) is None
    assert await store.longest(KEYS, 0) is None
    assert await store.longest(KEYS[:4], 100) == summary(2)
    assert [s.length for s in await store.lookup_all(KEYS, 10)] == [8, 5, 2]
    assert [s.length for s in await store.lookup_all(KEYS, 6)] == [5, 2]
    assert isinstance(store, SummaryStore) and not isinstance(store, LockingStore)


async def test_entry_under_the_wrong_length_is_ignored() -> None:
    store = MemoryStore(1_000_000, 3600)
    await store.put(KEYS[2], summary(4))  # claims 4 messages under the 3-message key
    await store.put(KEYS[0], summary(1))
    assert await store.longest(KEYS, 10) == summary(1)
    assert await store.lookup_all(KEYS, 10) == [summary(1)]


async def test_byte_bound_evicts_oldest() -> None:
    one = MemoryStore(10_000_000, 3600)
    await one.put(KEYS[0], summary(1, "x" * 1000))
    entry_bytes = one.bytes_used
    assert entry_bytes >= 1000

    store = MemoryStore(entry_bytes * 3, 3600)
    for k in (1, 2, 3):
        await store.put(KEYS[k - 1], summary(k, "x" * 1000))
    assert len(store) == 3
    await store.put(KEYS[3], summary(4, "x" * 1000))
    assert len(store) == 3
    assert store.bytes_used <= store.max_bytes
    assert await store.get(KEYS[0]) is None  # the oldest went
    assert [s.length for s in await store.lookup_all(KEYS, 10)] == [4, 3, 2]


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
    assert await store.longest(KEYS, 10) == summary(1)
    clock.now = 60.5
    assert await store.longest(KEYS, 10) is None
    assert len(store) == 0


async def test_null_store() -> None:
    store = NullStore()
    await store.put(KEYS[0], summary(1))
    assert await store.get(KEYS[0]) is None
    assert await store.longest(KEYS, 10) is None
    assert await store.lookup_all(KEYS, 10) == []
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
    assert isinstance(create_store(CacheSettings(backend="none")), NullStore)
    memory = create_store(CacheSettings(backend="memory", max_bytes=1234, ttl_s=5))
    assert isinstance(memory, MemoryStore) and memory.max_bytes == 1234
    redis_store = create_store(CacheSettings(backend="redis"))
    assert redis_store.name == "redis"
    assert isinstance(redis_store, LockingStore)
    await redis_store.close()


def test_create_store_without_redis_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name == "redis" or name.startswith("redis."):
            monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "redis", None)
    monkeypatch.delitem(sys.modules, "proxy.store.redis", raising=False)
    with pytest.raises(ConfigError, match=r"compaction-proxy\[redis\]"):
        create_store(CacheSettings(backend="redis"))
    assert isinstance(create_store(CacheSettings(backend="memory")), MemoryStore)
