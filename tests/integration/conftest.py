"""Fixtures for the integration tests: a fake upstream and the proxy, both served by uvicorn
on 127.0.0.1, and the official openai SDK pointed at the proxy."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import openai
import pytest

from proxy.app import create_app
from proxy.cli import uvicorn_speedups
from proxy.settings import Settings
from tests.integration.harness import (
    API_KEY,
    WAIT_S,
    FakeUpstream,
    SentRequests,
    ServerThread,
    proxy_settings,
)

# uvicorn as `compaction-proxy serve` runs it (proxy/cli.py).
PROXY_UVICORN: dict[str, Any] = {"server_header": False, **uvicorn_speedups()}


@pytest.fixture(scope="session")
def upstream_server() -> Iterator[tuple[FakeUpstream, ServerThread]]:
    app = FakeUpstream()
    server = ServerThread(app, "fake-upstream", lifespan="off").start()
    try:
        yield app, server
    finally:
        app.reset()
        server.stop()


@pytest.fixture(scope="session")
def proxy_server(upstream_server: tuple[FakeUpstream, ServerThread]) -> Iterator[ServerThread]:
    _, upstream = upstream_server
    app = create_app(proxy_settings(f"{upstream.url}/v1"))
    server = ServerThread(app, "proxy", **PROXY_UVICORN).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fake_upstream(upstream_server: tuple[FakeUpstream, ServerThread]) -> Iterator[FakeUpstream]:
    """The shared fake upstream, with a fresh state for this test (released again after it)."""
    app, _ = upstream_server
    app.reset()
    yield app
    app.reset()


@pytest.fixture
def upstream_url(upstream_server: tuple[FakeUpstream, ServerThread]) -> str:
    return f"{upstream_server[1].url}/v1"


@pytest.fixture
def proxy_url(proxy_server: ServerThread) -> str:
    """The base URL a client is given: the proxy's /v1."""
    return f"{proxy_server.url}/v1"


@pytest.fixture
def start_proxy() -> Iterator[Callable[[Settings], str]]:
    """Start an extra proxy with its own settings; returns its /v1 URL. Stopped after the test."""
    started: list[ServerThread] = []

    def start(settings: Settings) -> str:
        server = ServerThread(create_app(settings), f"proxy-{len(started)}", **PROXY_UVICORN)
        server.start()
        started.append(server)
        return f"{server.url}/v1"

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def sent() -> SentRequests:
    return SentRequests()


@pytest.fixture
def sdk(proxy_url: str, sent: SentRequests) -> Iterator[openai.OpenAI]:
    http_client = openai.DefaultHttpxClient(event_hooks={"request": [sent.hook]})
    client = openai.OpenAI(
        base_url=proxy_url,
        api_key=API_KEY,
        max_retries=0,
        timeout=WAIT_S,
        http_client=http_client,
    )
    with client:
        yield client


@pytest.fixture
async def async_sdk(proxy_url: str, sent: SentRequests) -> AsyncIterator[openai.AsyncOpenAI]:
    http_client = openai.DefaultAsyncHttpxClient(event_hooks={"request": [sent.ahook]})
    client = openai.AsyncOpenAI(
        base_url=proxy_url,
        api_key=API_KEY,
        max_retries=0,
        timeout=WAIT_S,
        http_client=http_client,
    )
    async with client:
        yield client
