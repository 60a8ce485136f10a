"""Shared fixtures: the app in-process over httpx.ASGITransport, the upstream mocked by respx."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

# Tokenizer files without network: the verified copies beside the repo (tests and CI only).
_SHARED_CACHE = Path(__file__).resolve().parents[2] / "shared" / "tiktoken-cache"
if "TIKTOKEN_CACHE_DIR" not in os.environ and _SHARED_CACHE.is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(_SHARED_CACHE)

# Settings read COMPACTION_PROXY_* from the environment; tests must not inherit a user's.
for _name in [n for n in os.environ if n.startswith("COMPACTION_PROXY_")]:
    del os.environ[_name]

from proxy.app import create_app  # noqa: E402
from proxy.settings import Settings  # noqa: E402

UPSTREAM = "http://upstream.test/v1"


def make_settings(**sections: Any) -> Settings:
    data: dict[str, Any] = {"upstream": {"base_url": UPSTREAM}}
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return Settings.model_validate(data)


async def until(predicate: Callable[[], bool]) -> None:
    """Wait for a condition another task will make true (bounded; fails the test after 10 s)."""
    async with asyncio.timeout(10):
        while not predicate():  # noqa: ASYNC110 - polls state owned by the code under test
            await asyncio.sleep(0.005)


@pytest.fixture
def settings() -> Settings:
    return make_settings()


@pytest.fixture
def upstream() -> Iterator[respx.MockRouter]:
    with respx.mock(base_url=UPSTREAM, assert_all_called=False) as router:
        yield router


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy.test") as c:
        yield c
    await app.state.proxy.upstream.client.aclose()
