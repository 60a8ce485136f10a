"""Single flight, in-process and across replicas (two Redis-backed stores on a real server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from proxy.compaction.protocol import Usage
from proxy.store import (
    MemoryBackend,
    NullStore,
    SingleFlight,
    StoredSummary,
    SummaryFlight,
    SummaryStore,
)
from proxy.store.redis import RedisBackend


def RedisStore(url: str, key_prefix: str, *, ttl_s: int, lock_ttl_s: float) -> SummaryStore:
    return SummaryStore(RedisBackend(url, key_prefix, ttl_s), lock_ttl_s=lock_ttl_s)


REDIS_URL = "redis://127.0.0.1:6379/0"
KEY = "ab" * 32


def summary(text: str, length: int = 4) -> StoredSummary:
    return StoredSummary(text, length, 5, Usage(50, 5), 1.0)


class Factory:
    """A summarizer stand-in that blocks until released and records what happened to it."""

    def __init__(self, result: StoredSummary | None = None) -> None:
        self.calls = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.result = result if result is not None else summary("made")

    async def __call__(self) -> StoredSummary:
        self.calls += 1
        self.started.set()
        try:
            async with asyncio.timeout(5):  # a test that forgets to release fails, not hangs
                await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return self.result


async def test_twenty_concurrent_callers_one_call() -> None:
    flight = SingleFlight()
    make = Factory()
    tasks = [asyncio.create_task(flight.run(KEY, make)) for _ in range(20)]
    await asyncio.wait_for(make.started.wait(), 5)
    assert flight.waiters(KEY) == 20
    make.release.set()
    results = await asyncio.gather(*tasks)
    assert make.calls == 1
    assert all(r is make.result for r in results)
    assert len(flight) == 0  # done calls leave the table


async def test_different_keys_run_separately() -> None:
    flight = SingleFlight()
    a, b = Factory(summary("a")), Factory(summary("b"))
    a.release.set()
    b.release.set()
    ra, rb = await asyncio.gather(flight.run("a", a), flight.run("b", b))
    assert (ra.text, rb.text, a.calls, b.calls) == ("a", "b", 1, 1)


async def test_failure_reaches_every_waiter_and_is_not_cached() -> None:
    flight = SingleFlight()
    calls = 0
    started, gate = asyncio.Event(), asyncio.Event()

    async def failing() -> str:
        nonlocal calls
        calls += 1
        started.set()
        await asyncio.wait_for(gate.wait(), 5)
        raise RuntimeError("summarizer down")

    tasks = [asyncio.create_task(flight.run(KEY, failing)) for _ in range(3)]
    await asyncio.wait_for(started.wait(), 5)
    assert flight.waiters(KEY) == 3
    gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert calls == 1
    assert all(isinstance(r, RuntimeError) for r in results)
    assert len(flight) == 0

    async def ok() -> str:
        return "ok"

    assert await flight.run(KEY, ok) == "ok"


async def test_cancelled_waiter_does_not_cancel_shared_call() -> None:
    flight = SingleFlight()
    make = Factory()
    first = asyncio.create_task(flight.run(KEY, make))
    second = asyncio.create_task(flight.run(KEY, make))
    await asyncio.wait_for(make.started.wait(), 5)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert flight.waiters(KEY) == 1
    assert not make.cancelled.is_set()
    make.release.set()
    assert await second is make.result
    assert make.calls == 1 and not make.cancelled.is_set()


async def test_call_cancelled_when_every_waiter_leaves() -> None:
    flight = SingleFlight()
    make = Factory()
    tasks = [asyncio.create_task(flight.run(KEY, make)) for _ in range(3)]
    await asyncio.wait_for(make.started.wait(), 5)
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert len(flight) == 0  # forgotten at once: new callers must not join a dying call
    await asyncio.wait_for(flight.join(), 5)
    assert make.cancelled.is_set()
    # The next caller starts afresh rather than joining the cancelled call.
    again = Factory(summary("again"))
    again.release.set()
    assert (await flight.run(KEY, again)).text == "again"


async def test_summary_flight_stores_and_reuses_in_memory() -> None:
    store = SummaryStore(MemoryBackend(1_000_000, 60))
    flight = SummaryFlight(store)
    make = Factory()
    make.release.set()
    assert await flight.run(KEY, make) is make.result
    assert await store.get(KEY) == make.result
    again = Factory(summary("other"))
    again.release.set()
    assert await flight.run(KEY, again) == make.result  # found in the store, not remade
    assert (again.calls, flight.made, flight.found) == (0, 1, 1)


async def test_summary_flight_without_store_just_makes() -> None:
    flight = SummaryFlight(NullStore())
    make = Factory()
    make.release.set()
    assert await flight.run(KEY, make) is make.result
    assert await flight.run(KEY, make) is make.result
    assert make.calls == 2


@pytest.fixture
async def replicas(key_prefix: str) -> AsyncIterator[tuple[SummaryStore, SummaryStore]]:
    a = RedisStore(REDIS_URL, key_prefix, ttl_s=60, lock_ttl_s=30)
    b = RedisStore(REDIS_URL, key_prefix, ttl_s=60, lock_ttl_s=30)
    yield a, b
    await a.close()
    await b.close()


class PollRecorder:
    """Injected sleep: records each backoff delay, yields briefly for real."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self.polling = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        self.polling.set()
        await asyncio.sleep(0.005)


async def test_second_replica_waits_for_first_replicas_summary(
    replicas: tuple[SummaryStore, SummaryStore], redis_client: Redis, key_prefix: str
) -> None:
    store_a, store_b = replicas
    poll = PollRecorder()
    flight_a = SummaryFlight(store_a)
    flight_b = SummaryFlight(store_b, sleep=poll)
    make_a, make_b = Factory(summary("from a")), Factory(summary("from b"))
    make_b.release.set()  # if b ever made its own, the asserts below say so (no hang)
    task_a = asyncio.create_task(flight_a.run(KEY, make_a))
    await asyncio.wait_for(make_a.started.wait(), 5)
    task_b = asyncio.create_task(flight_b.run(KEY, make_b))
    await asyncio.wait_for(
        poll.polling.wait(), 5
    )  # b found the lock taken and is polling the store
    make_a.release.set()
    result_a, result_b = await asyncio.wait_for(asyncio.gather(task_a, task_b), 5)
    assert result_a == result_b == summary("from a")
    assert make_b.calls == 0 and make_a.calls == 1
    assert (flight_b.found, flight_b.made) == (1, 0)
    assert await redis_client.exists(f"{key_prefix}lock:{KEY}") == 0
    assert await store_b.get(KEY) == summary("from a")


async def test_waiter_takes_over_when_the_holder_fails(
    replicas: tuple[SummaryStore, SummaryStore],
) -> None:
    store_a, store_b = replicas
    poll = PollRecorder()
    flight_a, flight_b = SummaryFlight(store_a), SummaryFlight(store_b, sleep=poll)
    gate_started, gate = asyncio.Event(), asyncio.Event()

    async def failing() -> StoredSummary:
        gate_started.set()
        await asyncio.wait_for(gate.wait(), 5)
        raise RuntimeError("summarizer down")

    task_a = asyncio.create_task(flight_a.run(KEY, failing))
    await asyncio.wait_for(gate_started.wait(), 5)
    make_b = Factory(summary("from b"))
    make_b.release.set()
    task_b = asyncio.create_task(flight_b.run(KEY, make_b))
    await asyncio.wait_for(poll.polling.wait(), 5)
    gate.set()  # a fails and releases its lock; b takes it on its next poll
    with pytest.raises(RuntimeError):
        await task_a
    assert await task_b == summary("from b")
    assert make_b.calls == 1


async def test_cancelled_holder_releases_its_lock(
    replicas: tuple[SummaryStore, SummaryStore], redis_client: Redis, key_prefix: str
) -> None:
    store_a, _ = replicas
    make = Factory()
    flight = SummaryFlight(store_a)
    task = asyncio.create_task(flight.run(KEY, make))
    await asyncio.wait_for(make.started.wait(), 5)
    assert await redis_client.exists(f"{key_prefix}lock:{KEY}") == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(flight.local.join(), 5)  # the shared call unwinds after the waiter
    assert make.cancelled.is_set()
    assert await redis_client.exists(f"{key_prefix}lock:{KEY}") == 0


async def test_waiter_gives_up_after_the_lock_ttl_with_backoff(
    redis_client: Redis, key_prefix: str
) -> None:
    # A holder that never finishes (lock renewed by hand): the waiter polls with exponential
    # backoff on an injected clock, then makes the summary itself once lock_ttl_s has passed.
    store = RedisStore(REDIS_URL, key_prefix, ttl_s=60, lock_ttl_s=3)
    await redis_client.set(f"{key_prefix}lock:{KEY}", "someone-else", px=60_000)
    now = 0.0
    delays: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        nonlocal now
        delays.append(seconds)
        now += seconds

    flight = SummaryFlight(
        store, poll_initial_s=0.1, poll_max_s=1.0, clock=lambda: now, sleep=fake_sleep
    )
    make = Factory()
    make.release.set()
    try:
        assert await flight.run(KEY, make) is make.result
    finally:
        await store.close()
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 0.5])
    assert make.calls == 1


async def test_redis_down_every_replica_makes_its_own() -> None:
    store = RedisStore("redis://127.0.0.1:1/0", "p:", ttl_s=60, lock_ttl_s=30)
    make = Factory()
    make.release.set()
    try:
        assert await SummaryFlight(store).run(KEY, make) is make.result
    finally:
        await store.close()
    assert make.calls == 1 and not store.available
