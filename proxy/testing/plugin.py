"""pytest fixtures for testing against compaction-proxy in-process, with a fake upstream.

Opt in with `-p compaction_proxy` (or `pytest_plugins = ["proxy.testing.plugin"]` in the root
conftest.py); installing the package alone registers nothing. Async fixtures need
pytest-asyncio (in strict mode, mark the tests `@pytest.mark.asyncio`).

    @pytest.mark.compaction_proxy(compaction={"budget_tokens": 500})
    async def test_long_chats_are_compacted(openai_client, fake_openai): ...

fake_openai       the FakeOpenAI upstream, mocked with respx for the test's duration
proxy_app         the proxy app (lifespan running), pointed at fake_openai
proxy_client      an httpx.AsyncClient over ASGI to the app (base URL http://proxy.test)
openai_client     an openai.AsyncOpenAI wired to the app in-process (base URL .../v1)
served_proxy_url  the app served on 127.0.0.1 (a thread), its /v1 URL: for code that makes
                  its own client (OPENAI_BASE_URL), sync or async
sync_openai_client  an openai.OpenAI (the sync client) pointed at served_proxy_url
compaction_proxy_settings  the Settings: test defaults + the `compaction_proxy` markers
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import pytest_asyncio
from starlette.applications import Starlette

from proxy.settings import Settings
from proxy.testing.app import make_app, make_settings, merge
from proxy.testing.fake_openai import FakeOpenAI
from proxy.testing.serve import serve

if TYPE_CHECKING:
    import openai

MARKER = "compaction_proxy"
PROXY_URL = "http://proxy.test"
API_KEY = "sk-compaction-proxy-test"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(**sections): proxy settings for this test, e.g. "
        '@pytest.mark.compaction_proxy(compaction={"budget_tokens": 500})',
    )


@pytest.fixture
def compaction_proxy_settings(request: pytest.FixtureRequest) -> Settings:
    """Test defaults, then each `compaction_proxy` marker from the outermost (module, class)
    to the test's own, merged section by section."""
    sections: dict[str, Any] = {}
    for marker in reversed(list(request.node.iter_markers(MARKER))):
        if marker.args:
            raise pytest.UsageError(f"@pytest.mark.{MARKER} takes keyword sections only")
        sections = merge(sections, marker.kwargs)
    return make_settings(**sections)


@pytest.fixture
def fake_openai(compaction_proxy_settings: Settings) -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI(compaction_proxy_settings.upstream.base_url)
    with fake.mock():
        yield fake


@pytest_asyncio.fixture
async def proxy_app(
    fake_openai: FakeOpenAI, compaction_proxy_settings: Settings
) -> AsyncIterator[Starlette]:
    app = make_app(compaction_proxy_settings)
    async with app.router.lifespan_context(app):  # closes the pooled client and store after
        yield app


@pytest_asyncio.fixture
async def proxy_client(proxy_app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=proxy_app)
    async with httpx.AsyncClient(transport=transport, base_url=PROXY_URL) as client:
        yield client


@pytest_asyncio.fixture
async def openai_client(proxy_app: Starlette) -> AsyncIterator[openai.AsyncOpenAI]:
    try:
        import openai
    except ImportError:
        pytest.fail("the openai_client fixture needs the openai package: pip install openai")
    http_client = openai.DefaultAsyncHttpxClient(transport=_sdk_asgi_transport(openai, proxy_app))
    client = openai.AsyncOpenAI(
        base_url=f"{PROXY_URL}/v1", api_key=API_KEY, max_retries=0, http_client=http_client
    )
    async with client:
        yield client


def _sdk_asgi_transport(openai: Any, app: Starlette) -> Any:
    """An ASGI transport from the httpx flavour the SDK is built on (`httpx`, or `httpx2` in
    newer releases): its client accepts only its own transports."""
    for base in openai.DefaultAsyncHttpxClient.__mro__:
        if base.__name__ == "AsyncClient" and not base.__module__.startswith("openai"):
            return importlib.import_module(base.__module__.split(".")[0]).ASGITransport(app=app)
    return httpx.ASGITransport(app=app)


@pytest.fixture
def served_proxy_url(
    fake_openai: FakeOpenAI, compaction_proxy_settings: Settings
) -> Iterator[str]:
    """The proxy on a real socket of 127.0.0.1, in front of `fake_openai`: its /v1 URL.

    Synchronous: for code that builds its own client (`OpenAI()` with OPENAI_BASE_URL set to
    this, `requests`, a subprocess), and for tests without an event loop.
    """
    app = make_app(compaction_proxy_settings)
    with serve(app) as url:
        if fake_openai.router is not None:  # a client on httpx would be mocked too: let it by
            fake_openai.router.route(url__startswith=url).pass_through()
        yield f"{url}/v1"


@pytest.fixture
def sync_openai_client(served_proxy_url: str) -> Iterator[openai.OpenAI]:
    """An `openai.OpenAI` (the synchronous client) to the served proxy."""
    try:
        import openai
    except ImportError:
        pytest.fail("the sync_openai_client fixture needs the openai package: pip install openai")
    with openai.OpenAI(base_url=served_proxy_url, api_key=API_KEY, max_retries=0) as client:
        yield client
