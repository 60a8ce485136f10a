"""Proxy keys over real sockets with the official openai SDK: the errors it raises for a bad
key and an exhausted quota, its retry honouring our retry-after, and a stream it asked for
without usage arriving without the usage chunk the proxy requested on its behalf."""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
from starlette.applications import Starlette

from proxy.app import create_app
from tests.integration.conftest import PROXY_UVICORN
from tests.integration.harness import (
    REPLY_TEXT,
    WAIT_S,
    FakeUpstream,
    ServerThread,
    proxy_settings,
)

pytestmark = pytest.mark.integration

REDIS_URL = "redis://127.0.0.1:6379/0"

PROXY_KEY = "sk-proxy-integration-team"
MESSAGES: list[dict[str, str]] = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def redis_quota() -> Iterator[dict[str, Any]]:
    """The quota section for the shared Redis under a fresh prefix, deleted afterwards."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis at {REDIS_URL} is not reachable ({exc!r}); start redis-server")
    prefix = f"test-integration-keys-{secrets.token_hex(6)}:"
    try:
        yield {"backend": "redis", "redis_url": REDIS_URL, "key_prefix": prefix}
    finally:
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()


def serve_keyed(
    upstream_url: str, quota: dict[str, Any], requests_per_minute: int
) -> tuple[Starlette, ServerThread]:
    entry = {
        "id": "team",
        "key_sha256": hashlib.sha256(PROXY_KEY.encode()).hexdigest(),
        "requests_per_minute": requests_per_minute,
    }
    app = create_app(proxy_settings(upstream_url, auth={"keys": [entry]}, quota=quota))
    return app, ServerThread(app, "proxy-keys", **PROXY_UVICORN).start()


@pytest.fixture(params=["memory", "redis"])
def keyed_proxy(
    request: pytest.FixtureRequest, upstream_url: str
) -> Iterator[tuple[Starlette, str]]:
    """A served proxy (its upstream requests on its own transport) with one key of 1 request/minute,
    its quota in memory or in Redis."""
    quota = request.getfixturevalue("redis_quota") if request.param == "redis" else {}
    app, server = serve_keyed(upstream_url, quota, requests_per_minute=1)
    try:
        yield app, f"{server.url}/v1"
    finally:
        server.stop()


def sdk(url: str, key: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=retries, timeout=WAIT_S)


def test_unknown_key_raises_authentication_error(
    keyed_proxy: tuple[Starlette, str], fake_upstream: FakeUpstream
) -> None:
    _, url = keyed_proxy
    with pytest.raises(openai.AuthenticationError) as info:
        sdk(url, "sk-not-a-proxy-key").chat.completions.create(model="echo", messages=MESSAGES)
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"
    assert "Incorrect API key" in info.value.message
    assert fake_upstream.requests == []


def test_quota_raises_rate_limit_error_with_message_and_retry_after(
    keyed_proxy: tuple[Starlette, str], fake_upstream: FakeUpstream
) -> None:
    app, url = keyed_proxy
    app.state.proxy.quotas.clock = lambda: 1_800_000_020.0  # 40 s before the minute ends
    client = sdk(url, PROXY_KEY)
    first = client.chat.completions.create(model="echo", messages=MESSAGES)
    assert first.choices[0].message.content == REPLY_TEXT
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="echo", messages=MESSAGES)
    assert info.value.status_code == 429
    assert info.value.code == "rate_limit_exceeded"
    assert "Rate limit reached for key 'team' on requests per minute" in info.value.message
    headers = info.value.response.headers
    assert headers["retry-after"] == "40"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert len(fake_upstream.requests) == 1


def test_the_sdk_retry_waits_as_retry_after_says_and_then_gets_through(
    keyed_proxy: tuple[Starlette, str], fake_upstream: FakeUpstream
) -> None:
    app, url = keyed_proxy
    quotas = app.state.proxy.quotas
    # The proxy's clock 3 s before a minute ends: the second call is refused with
    # retry-after 3, and only a retry that waits as told lands in the next minute.
    offset = 57.0 - time.time() % 60
    quotas.clock = lambda: time.time() + offset
    sdk(url, PROXY_KEY).chat.completions.create(model="echo", messages=MESSAGES)
    retried = sdk(url, PROXY_KEY, retries=2).chat.completions.create(
        model="echo", messages=MESSAGES
    )
    assert retried.choices[0].message.content == REPLY_TEXT
    assert quotas.rejected == 1  # refused once, then let through after the reset
    assert len(fake_upstream.requests) == 2


def test_stream_without_include_usage_gets_no_usage_chunk(
    keyed_proxy: tuple[Starlette, str], fake_upstream: FakeUpstream
) -> None:
    _, url = keyed_proxy
    chunks: list[Any] = list(
        sdk(url, PROXY_KEY).chat.completions.create(model="echo", messages=MESSAGES, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY_TEXT
    assert all(c.choices for c in chunks)  # the usage-only chunk was removed
    [got] = fake_upstream.requests
    assert got.json()["stream_options"] == {"include_usage": True}


def test_concurrent_requests_over_a_redis_quota_reach_the_upstream_exactly_as_allowed(
    upstream_url: str, fake_upstream: FakeUpstream, redis_quota: dict[str, Any]
) -> None:
    """Over the served path the charge is on its way while the upstream request is made:
    of 10 requests sent at once against 7 per minute, 7 reach the upstream, 3 get 429."""
    app, server = serve_keyed(upstream_url, redis_quota, requests_per_minute=7)
    app.state.proxy.quotas.clock = lambda: 1_800_000_020.0  # one minute for all of them
    body = {"model": "echo", "messages": MESSAGES}

    async def send_all() -> list[int]:
        async with httpx.AsyncClient(base_url=f"{server.url}/v1", timeout=WAIT_S) as client:
            replies = await asyncio.gather(*(
                client.post(
                    "/chat/completions", json=body, headers={"authorization": f"Bearer {PROXY_KEY}"}
                )
                for _ in range(10)
            ))  # fmt: skip
        return sorted(reply.status_code for reply in replies)

    try:
        statuses = asyncio.run(send_all())
    finally:
        server.stop()
    assert statuses == [200] * 7 + [429] * 3
    assert len(fake_upstream.requests) == 7


def test_usage_command_reads_a_running_proxy(
    upstream_url: str,
    fake_upstream: FakeUpstream,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from proxy.cli import main

    monkeypatch.setenv("ADMIN_TOKEN_FOR_TEST", "admin-secret")
    entry = {"id": "team", "key_sha256": hashlib.sha256(PROXY_KEY.encode()).hexdigest()}
    settings = proxy_settings(
        upstream_url, auth={"keys": [entry]}, admin={"token_env": "ADMIN_TOKEN_FOR_TEST"}
    )
    server = ServerThread(create_app(settings), "proxy-usage", **PROXY_UVICORN).start()
    try:
        reply = sdk(f"{server.url}/v1", PROXY_KEY).chat.completions.create(
            model="gpt-4o-mini", messages=MESSAGES
        )
        assert reply.usage is not None
        monkeypatch.setenv("COMPACTION_PROXY_ADMIN__TOKEN_ENV", "ADMIN_TOKEN_FOR_TEST")
        capsys.readouterr()
        for _ in range(100):  # recording happens just after the reply; bounded wait for it
            with pytest.raises(SystemExit):
                main(["usage", "--url", server.url, "--json"])
            rows = json.loads(capsys.readouterr().out)
            if rows:
                break
            time.sleep(0.05)
        [row] = rows
        assert (row["key"], row["model"], row["requests"]) == ("team", "gpt-4o-mini", 1)
        assert row["prompt_tokens_forwarded"] == reply.usage.prompt_tokens
        assert row["completion_tokens"] == reply.usage.completion_tokens
    finally:
        server.stop()
