"""Store test fixtures: a real Redis on 127.0.0.1:6379 and one random key prefix per test."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
async def redis_client() -> AsyncIterator[Redis]:
    client = Redis.from_url(REDIS_URL)
    try:
        await client.ping()
    except Exception as exc:  # fail loudly, never skip: these tests exist to run against Redis
        await client.aclose()
        pytest.fail(f"Redis at {REDIS_URL} is not reachable ({exc!r}); start redis-server")
    yield client
    await client.aclose()


@pytest.fixture
async def key_prefix(redis_client: Redis) -> AsyncIterator[str]:
    """A fresh prefix; every key under it is deleted after the test."""
    prefix = f"test-store-{secrets.token_hex(8)}:"
    yield prefix
    keys = [key async for key in redis_client.scan_iter(match=f"{prefix}*")]
    if keys:
        await redis_client.delete(*keys)
