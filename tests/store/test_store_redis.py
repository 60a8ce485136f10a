"""The store over the Redis backend against a real server: round trip, one MGET per lookup,
sharing, locks, outages."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from proxy.compaction.protocol import Usage
from proxy.redact import redact_url
from proxy.store import StoredSummary, SummaryStore
from proxy.store.redis import RedisBackend

REDIS_URL = "redis://127.0.0.1:6379/0"
KEYS = [f"{i:064x}" for i in range(1, 31)]


def summary(length: int, text: str = "") -> StoredSummary:
    return StoredSummary(text or f"résumé {length}", length, 9, Usage(300, 40), 1_700_000_000.25)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def RedisStore(
    url: str,
    key_prefix: str,
    *,
    ttl_s: int,
    lock_ttl_s: float,
    clock: Callable[[], float] | None = None,
    socket_timeout_s: float = 0.5,
) -> SummaryStore:
    backend = RedisBackend(url, key_prefix, ttl_s, socket_timeout_s=socket_timeout_s)
    extra: dict[str, Any] = {} if clock is None else {"clock": clock}
    return SummaryStore(backend, lock_ttl_s=lock_ttl_s, where=redact_url(url), **extra)


def client_of(store: SummaryStore) -> Redis:
    assert isinstance(store.backend, RedisBackend)
    client = store.backend._client
    assert isinstance(client, Redis)
    return client


class CommandLog:
    """Wraps a client's execute_command: records command names, can simulate an outage."""

    def __init__(self, client: Redis) -> None:
        self.names: list[str] = []
        self.down = False
        self._inner: Callable[..., Awaitable[Any]] = client.execute_command
        client.execute_command = self  # type: ignore[method-assign]

    async def __call__(self, *args: Any, **options: Any) -> Any:
        self.names.append(str(args[0]).upper())
        if self.down:
            raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Refused.")
        return await self._inner(*args, **options)


@pytest.fixture
async def store(key_prefix: str) -> AsyncIterator[SummaryStore]:
    s = RedisStore(REDIS_URL, key_prefix, ttl_s=600, lock_ttl_s=5)
    yield s
    await s.close()


async def test_round_trip_with_ttl(
    store: SummaryStore, redis_client: Redis, key_prefix: str
) -> None:
    await store.put(KEYS[2], summary(3))
    assert await store.get(KEYS[2]) == summary(3)
    assert await store.get(KEYS[3]) is None
    raw_key = f"{key_prefix}summary:{KEYS[2]}"
    assert 0 < await redis_client.ttl(raw_key) <= 600
    assert store.available and store.errors == 0
    assert store.shared


async def test_one_mget_per_lookup(store: SummaryStore, key_prefix: str) -> None:
    for k in (3, 10, 25):
        await store.put(KEYS[k - 1], summary(k))
    log = CommandLog(client_of(store))
    assert [s.length for s in await store.lookup(KEYS, 30)] == [25, 10, 3]
    assert [s.length for s in await store.lookup(KEYS, 24)] == [10, 3]
    assert [s.length for s in await store.lookup(KEYS, 9)] == [3]
    assert await store.lookup(KEYS, 2) == []
    assert log.names == ["MGET"] * 4
    assert await store.lookup(KEYS, 0) == []  # nothing to probe: no round trip
    assert await store.lookup([], 10) == []
    assert log.names == ["MGET"] * 4


async def test_two_instances_share_entries(store: SummaryStore, key_prefix: str) -> None:
    other = RedisStore(REDIS_URL, key_prefix, ttl_s=600, lock_ttl_s=5)
    try:
        await store.put(KEYS[4], summary(5))
        assert await other.lookup(KEYS, 30) == [summary(5)]
        await other.put(KEYS[6], summary(7))
        assert [s.length for s in await store.lookup(KEYS, 30)] == [7, 5]
    finally:
        await other.close()
    isolated = RedisStore(REDIS_URL, key_prefix + "other:", ttl_s=600, lock_ttl_s=5)
    try:
        assert await isolated.lookup(KEYS, 30) == []
    finally:
        await isolated.close()


async def test_unreadable_or_mislabelled_entries_are_misses(
    store: SummaryStore, redis_client: Redis, key_prefix: str
) -> None:
    await redis_client.set(f"{key_prefix}summary:{KEYS[7]}", b"not json")
    await store.put(KEYS[5], summary(9))  # claims 9 messages under the 6-message key
    await store.put(KEYS[1], summary(2))
    assert await store.lookup(KEYS, 30) == [summary(2)]
    assert await store.get(KEYS[7]) is None
    assert store.available and store.errors == 0


async def test_locks(store: SummaryStore, redis_client: Redis, key_prefix: str) -> None:
    other = RedisStore(REDIS_URL, key_prefix, ttl_s=600, lock_ttl_s=5)
    try:
        assert await store.acquire_lock(KEYS[0], "t1") == "acquired"
        assert await other.acquire_lock(KEYS[0], "t2") == "held"
        assert 0 < await redis_client.pttl(f"{key_prefix}lock:{KEYS[0]}") <= 5000
        await other.release_lock(KEYS[0], "t2")  # not its lock: no effect
        assert await other.acquire_lock(KEYS[0], "t2") == "held"
        await store.release_lock(KEYS[0], "t1")
        assert await other.acquire_lock(KEYS[0], "t2") == "acquired"
    finally:
        await other.close()


async def test_unavailable_redis_degrades_silently(caplog: pytest.LogCaptureFixture) -> None:
    store = RedisStore("redis://user:s3cret@127.0.0.1:1/0", "p:", ttl_s=60, lock_ttl_s=5)
    caplog.set_level(logging.WARNING)
    try:
        assert await store.lookup(KEYS, 30) == []
        assert await store.get(KEYS[0]) is None
        await store.put(KEYS[0], summary(1))
        assert await store.acquire_lock(KEYS[0], "t") == "unavailable"
        await store.release_lock(KEYS[0], "t")
    finally:
        await store.close()
    assert store.available is False
    assert store.errors == 1  # later calls were skipped during the retry-after window
    assert store.last_error == "ConnectionError"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "s3cret" not in caplog.text and "user" not in caplog.text
    assert "127.0.0.1:1" in caplog.text


async def test_outage_retry_after_and_recovery(
    key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    store = RedisStore(REDIS_URL, key_prefix, ttl_s=60, lock_ttl_s=5, clock=clock)
    log = CommandLog(client_of(store))
    caplog.set_level(logging.WARNING)
    try:
        await store.put(KEYS[0], summary(1))
        log.down = True
        assert await store.lookup(KEYS, 30) == []
        assert (store.available, store.errors) == (False, 1)
        calls = len(log.names)
        assert await store.lookup(KEYS, 30) == []  # within retry-after: not even tried
        assert len(log.names) == calls
        clock.now += 2.5
        assert await store.lookup(KEYS, 30) == []
        assert store.errors == 2
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
        log.down = False
        clock.now += 2.5
        assert await store.lookup(KEYS, 30) == [summary(1)]
        assert store.available
    finally:
        await store.close()


async def test_silent_server_times_out_quickly() -> None:
    # A server that accepts and never answers: the socket timeout bounds the stall (no retry).
    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = RedisStore(
        f"redis://127.0.0.1:{port}/0", "p:", ttl_s=60, lock_ttl_s=5, socket_timeout_s=0.2
    )
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        assert await store.lookup(KEYS, 30) == []
        elapsed = loop.time() - started
    finally:
        await store.close()
        server.close()
        await server.wait_closed()
    assert store.errors == 1 and store.last_error == "TimeoutError"
    assert elapsed < 1.0
