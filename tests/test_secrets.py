"""Secrets stay out of what the proxy prints, and key-less clients don't share a store."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
import respx

from proxy.app import create_app
from proxy.redact import redact_url
from proxy.settings import ConfigError, Settings, load_settings
from tests.conftest import UPSTREAM, make_settings, respx_app
from tests.upstream_fakes import FakeUpstream


@pytest.mark.parametrize(
    ("url", "printed"),
    [
        ("https://user:pw-SECRET@api.example.com/v1", "https://***@api.example.com/v1"),
        (
            "https://api.example.com:8443/v1?api-key=SECRET&v=2",
            "https://api.example.com:8443/v1?api-key=***&v=***",
        ),
        ("redis://:SECRET@10.0.0.1:6379/0", "redis://***@10.0.0.1:6379/0"),
        ("http://host/v1?flag", "http://host/v1?flag"),
        ("http://[::1/broken", "***"),
    ],
)
def test_redact_url(url: str, printed: str) -> None:
    assert redact_url(url) == printed


@pytest.mark.parametrize(
    "variable",
    ["COMPACTION_PROXY_UPSTREAM__BASE_URL", "COMPACTION_PROXY_COMPACTION__SUMMARIZER__BASE_URL"],
)
def test_userinfo_in_an_upstream_url_is_refused_at_start_without_printing_it(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    if "SUMMARIZER" in variable:
        monkeypatch.setenv(
            "COMPACTION_PROXY_COMPACTION__SUMMARIZER", '{"base_url": "https://u:pw-SECRET@h/v1"}'
        )
    else:
        monkeypatch.setenv(variable, "https://u:pw-SECRET@h/v1")
    with pytest.raises(ConfigError) as caught:
        load_settings()
    message = str(caught.value)
    assert "user:password@" in message and "api_key" in message
    assert "pw-SECRET" not in message


def test_a_proxy_url_password_is_not_printed_by_a_refusal_or_the_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COMPACTION_PROXY_UPSTREAM__PROXY_URL", "ftp://u:pw-SECRET@egress:3128")
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert "upstream.proxy_url" in str(caught.value)
    assert "pw-SECRET" not in str(caught.value)
    monkeypatch.setenv("COMPACTION_PROXY_UPSTREAM__PROXY_URL", "http://u:pw-SECRET@egress:3128")
    settings = load_settings()
    assert "pw-SECRET" not in f"{settings!r} {settings} {settings.model_dump()}"


def test_an_unusable_proxy_in_the_environment_stops_the_start_without_printing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "ftp://u:pw-SECRET@egress:3128")
    with pytest.raises(ConfigError) as caught:
        create_app(make_settings())
    assert "ftp://***@egress:3128" in str(caught.value)
    assert "pw-SECRET" not in str(caught.value)


async def test_the_start_up_line_names_the_proxy_without_its_password(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("HTTP_PROXY", "http://u:pw-SECRET@egress.test:3128")
    app = create_app(make_settings(server={"warm_connect_s": 0}))
    async with app.router.lifespan_context(app):
        pass
    assert "through the proxy http://***@egress.test:3128" in caplog.text
    assert "pw-SECRET" not in caplog.text


async def test_start_up_line_and_readyz_never_show_a_query_credential(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = make_settings(upstream={"base_url": "http://upstream.test/v1?api-key=SECRET-q"})
    app = respx_app(settings)
    caplog.set_level(logging.INFO)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as c,
    ):
        ready = await c.get("/readyz")
    assert ready.status_code == 503  # upstream.test is not mocked here: the probe fails
    assert "SECRET" not in ready.text and ready.json()["checks"]["upstream"]["host"]
    assert any("proxying to" in r.getMessage() for r in caplog.records)
    assert not any("SECRET" in r.getMessage() for r in caplog.records)


async def test_the_upstream_clients_own_request_line_is_not_logged(
    caplog: pytest.LogCaptureFixture, upstream: respx.MockRouter, client: httpx.AsyncClient
) -> None:
    upstream.get("/models").respond(json={"data": []})
    caplog.set_level(logging.DEBUG)
    reply = await client.get("/v1/models?api-key=SECRET-in-query")
    assert reply.status_code == 200
    assert not any("SECRET-in-query" in r.getMessage() for r in caplog.records)
    assert not any(r.getMessage().startswith("HTTP Request:") for r in caplog.records)


HISTORY = [
    {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "words " * 120}
    for i in range(12)
] + [{"role": "user", "content": "thanks"}]


async def _twice(settings: Settings, headers: dict[str, str]) -> tuple[list[str], int]:
    app = respx_app(settings)
    with respx.mock(base_url=UPSTREAM, assert_all_called=False) as router:
        fake = FakeUpstream().install(router)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://p"
        ) as c:
            caches = []
            for _ in range(2):
                reply = await c.post(
                    "/v1/chat/completions",
                    json={"model": "gpt-4o-mini", "messages": HISTORY},
                    headers=headers,
                )
                assert reply.status_code == 200
                assert reply.headers["x-compaction-status"] in ("compacted", "reused")
                caches.append(reply.headers["x-compaction-cache"])
    await app.state.proxy.upstream.client.aclose()
    return caches, len(fake.summary_calls)


def _settings(**cache: Any) -> Settings:
    return make_settings(
        compaction={"budget_tokens": 500, "max_preserved_messages": 1}, cache=cache
    )


async def test_key_less_clients_get_no_store_by_default() -> None:
    caches, summaries = await _twice(_settings(), {})
    assert caches == ["none", "none"]  # nothing to learn about another client's history
    assert summaries == 2


async def test_key_less_clients_share_a_store_only_when_configured() -> None:
    caches, summaries = await _twice(_settings(anonymous="shared"), {})
    assert caches == ["miss", "hit"]
    assert summaries == 1


async def test_clients_with_a_key_keep_their_store() -> None:
    caches, summaries = await _twice(_settings(), {"authorization": "Bearer sk-a"})
    assert caches == ["miss", "hit"]
    assert summaries == 1
