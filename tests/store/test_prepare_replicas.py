"""Summaries made ahead of need across replicas: two app instances on one real Redis.

A session's turns may reach any replica: the one that starts a preparation takes the
session's lock in Redis, the others see it held and make none; the turn that crosses the
budget finds the summary on whichever replica it reaches. A replica shut down while it
prepares releases the lock, so another may prepare at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import respx
from redis.asyncio import Redis

from proxy.settings import Settings
from tests.conftest import until
from tests.keys.conftest import KEY_A, key_entry, keyed_settings
from tests.replay import coding_agent
from tests.store.conftest import REDIS_URL
from tests.test_prepare import BUDGET, Proxy, first_started
from tests.upstream_fakes import FakeUpstream


def replica_settings(prefix: str) -> Settings:
    return keyed_settings(
        key_entry("team-a", KEY_A),
        compaction={
            "budget_tokens": BUDGET,
            "strategy": "simple",  # summaries made ahead of need: the summarizing stage
            "summarizer": {"retries": 0, "timeout_s": 10},
        },
        cache={"backend": "redis", "redis_url": REDIS_URL, "key_prefix": prefix},
        quota={"key_prefix": prefix},
    )


@pytest.fixture
async def replicas(key_prefix: str) -> AsyncIterator[tuple[Proxy, Proxy]]:
    a, b = Proxy(replica_settings(key_prefix)), Proxy(replica_settings(key_prefix))
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def locks(redis_client: Redis, prefix: str) -> list[bytes]:
    return [key async for key in redis_client.scan_iter(match=f"{prefix}lock:prepare:*")]


async def test_two_replicas_prepare_a_session_once(
    replicas: tuple[Proxy, Proxy],
    upstream: respx.MockRouter,
    redis_client: Redis,
    key_prefix: str,
) -> None:
    a, b = replicas
    fake = FakeUpstream(gate=asyncio.Event()).install(upstream)
    session = coding_agent(60)
    turn = await first_started(a, session)
    await until(lambda: len(fake.summary_calls) == 1)
    assert len(await locks(redis_client, key_prefix)) == 1
    # The same turn reaches the other replica (a client's retry) while the first prepares.
    response = await b.send(session, turn)
    assert response.headers["x-compaction-prepared"] == "started"
    await b.preparer.join()  # it saw the session's lock held: nothing to make
    assert len(fake.summary_calls) == 1
    assert await b.metric("compaction_proxy_prepared_summaries_total", result="skipped") == 1
    fake.gate.set()
    await a.preparer.join()
    assert await locks(redis_client, key_prefix) == []
    fake.gate.clear()  # a turn that called the summarizer now would hang
    for crossing in range(turn + 1, len(session.turns)):
        async with asyncio.timeout(5):
            response = await b.send(session, crossing)
        if response.headers["x-compaction-status"] != "passthrough":
            break
    assert response.headers["x-compaction-status"] == "reused"
    assert response.headers["x-compaction-cache"] == "hit"
    assert response.headers["x-compaction-prepared"] == "used"
    assert len(fake.summary_calls) == 1


async def test_a_replica_shut_down_while_preparing_lets_another_prepare(
    replicas: tuple[Proxy, Proxy],
    upstream: respx.MockRouter,
    redis_client: Redis,
    key_prefix: str,
) -> None:
    a, b = replicas
    fake = FakeUpstream(gate=asyncio.Event()).install(upstream)
    session = coding_agent(60)
    turn = await first_started(a, session)
    await until(lambda: len(fake.summary_calls) == 1)
    await a.state.compactor.aclose()  # its shutdown: the preparation is cancelled
    assert a.preparer.running == 0
    assert await locks(redis_client, key_prefix) == []
    fake.gate.set()
    response = await b.send(session, turn)
    assert response.headers["x-compaction-prepared"] == "started"
    await b.preparer.join()
    assert len(fake.summary_calls) == 2  # the cancelled call, then the other replica's
    assert await b.metric("compaction_proxy_prepared_summaries_total", result="done") == 1
