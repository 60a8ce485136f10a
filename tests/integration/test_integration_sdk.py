"""The official openai SDK against the proxy over real sockets: chat calls, the proxy's response
headers as the SDK exposes them, and errors as the SDK raises them."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest

from proxy.settings import Settings
from tests.integration.harness import (
    API_KEY,
    RATE_LIMIT_MESSAGE,
    REPLY_TEXT,
    WAIT_S,
    FakeUpstream,
    SentRequests,
    closed_port,
    proxy_settings,
)

pytestmark = pytest.mark.integration

MESSAGES: list[dict[str, str]] = [{"role": "user", "content": "Say hello."}]


def test_sync_chat_reaches_upstream_intact(
    sdk: openai.OpenAI, fake_upstream: FakeUpstream, sent: SentRequests
) -> None:
    reply = sdk.chat.completions.create(model="echo", messages=MESSAGES, temperature=0.25)
    assert reply.choices[0].message.content == REPLY_TEXT
    assert reply.usage is not None and reply.usage.total_tokens == 16
    [got] = fake_upstream.requests
    assert (got.method, got.path) == ("POST", "/v1/chat/completions")
    assert got.body == sent.last.content  # the SDK's bytes, untouched
    assert got.header("authorization") == f"Bearer {API_KEY}"
    assert got.header("user-agent") == sent.last.headers["user-agent"]
    assert got.header("content-length") == str(len(got.body))


async def test_async_chat_reaches_upstream_intact(
    async_sdk: openai.AsyncOpenAI, fake_upstream: FakeUpstream, sent: SentRequests
) -> None:
    reply = await async_sdk.chat.completions.create(model="echo", messages=MESSAGES)
    assert reply.choices[0].message.content == REPLY_TEXT
    assert reply.model == "echo"
    [got] = fake_upstream.requests
    assert got.body == sent.last.content


def test_raw_response_exposes_compaction_headers_and_request_id(
    sdk: openai.OpenAI, fake_upstream: FakeUpstream
) -> None:
    raw = sdk.chat.completions.with_raw_response.create(model="echo", messages=MESSAGES)
    assert raw.status_code == 200
    assert raw.headers["x-compaction-status"] == "passthrough"
    tokens_before = raw.headers["x-compaction-tokens-before"]
    assert tokens_before.isdigit() and int(tokens_before) > 0
    assert raw.headers["x-compaction-tokens-after"] == tokens_before
    # The upstream sent no x-request-id: the proxy's own id is the one the upstream was given.
    request_id = raw.headers["x-request-id"]
    assert request_id.startswith("req_")
    assert fake_upstream.requests[0].header("x-request-id") == request_id
    # The upstream's own headers are relayed next to the proxy's, its gzipped body verbatim.
    assert raw.headers["content-encoding"] == "gzip"
    assert raw.headers["openai-processing-ms"] == "7"
    assert raw.headers["x-upstream-marker"] == "fake"
    assert raw.parse().choices[0].message.content == REPLY_TEXT


def test_client_request_id_and_control_headers(
    sdk: openai.OpenAI, fake_upstream: FakeUpstream
) -> None:
    raw = sdk.chat.completions.with_raw_response.create(
        model="echo",
        messages=MESSAGES,
        extra_headers={"x-request-id": "req_from_client", "x-compaction": "off"},
    )
    assert raw.headers["x-request-id"] == "req_from_client"
    assert raw.headers["x-compaction-status"] == "off"
    [got] = fake_upstream.requests
    assert got.header("x-request-id") == "req_from_client"
    assert got.header("x-compaction") is None  # control headers stop at the proxy


def test_bad_control_header_is_an_sdk_bad_request(
    sdk: openai.OpenAI, fake_upstream: FakeUpstream
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(
            model="echo", messages=MESSAGES, extra_headers={"x-compaction": "sometimes"}
        )
    assert caught.value.status_code == 400
    assert "x-compaction" in caught.value.message
    assert not fake_upstream.requests


def test_upstream_429_reaches_the_sdk_with_its_message(
    sdk: openai.OpenAI, fake_upstream: FakeUpstream
) -> None:
    with pytest.raises(openai.RateLimitError) as caught:
        sdk.chat.completions.create(model="ratelimit", messages=MESSAGES)
    error = caught.value
    assert error.status_code == 429
    assert RATE_LIMIT_MESSAGE in error.message
    assert error.code == "rate_limit_exceeded"
    assert error.response.headers["retry-after"] == "7"
    assert error.response.headers["x-compaction-status"] == "passthrough"
    assert len(fake_upstream.requests) == 1


async def test_upstream_429_reaches_the_async_sdk(
    async_sdk: openai.AsyncOpenAI, fake_upstream: FakeUpstream
) -> None:
    with pytest.raises(openai.RateLimitError) as caught:
        await async_sdk.chat.completions.create(model="ratelimit", messages=MESSAGES)
    assert caught.value.status_code == 429
    assert RATE_LIMIT_MESSAGE in caught.value.message


def test_upstream_down_is_a_502_naming_the_upstream_host(
    start_proxy: Callable[[Settings], str],
) -> None:
    port = closed_port()
    proxy_url = start_proxy(proxy_settings(f"http://127.0.0.1:{port}/v1"))
    with openai.OpenAI(
        base_url=proxy_url, api_key=API_KEY, max_retries=0, timeout=WAIT_S
    ) as client:
        with pytest.raises(openai.APIStatusError) as chat:
            client.chat.completions.with_raw_response.create(model="echo", messages=MESSAGES)
        with pytest.raises(openai.APIStatusError) as models:
            client.models.list()
    for caught in (chat, models):
        error = caught.value
        assert error.status_code == 502
        assert f"127.0.0.1:{port}" in error.message
        assert error.code == "upstream_unreachable"
        assert error.response.headers["x-request-id"].startswith("req_")
    assert chat.value.response.headers["x-compaction-status"] == "passthrough"
