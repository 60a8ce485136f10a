"""Bad input gets a clear OpenAI-style 4xx; upstream failures get 502/504 naming the host."""

from __future__ import annotations

import httpx
import pytest
import respx

from proxy.testing import BrokenStream, FakeOpenAI


def assert_envelope(
    response: httpx.Response, status: int, param: str | None = None
) -> dict[str, object]:
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(
    ("raw", "param", "fragment"),
    [
        (b"{not json", None, "parse the JSON"),
        (b"", None, "empty"),
        (b"[1,2]", None, "JSON object"),
        (b'"text"', None, "JSON object"),
        (b'{"model":"gpt-4o"}', "messages", "Missing required parameter"),
        (b'{"model":"gpt-4o","messages":{"role":"user"}}', "messages", "expected an array"),
        (b'{"model":"gpt-4o","messages":[]}', "messages", "empty array"),
        (b'{"model":"gpt-4o","messages":["hi"]}', "messages[0]", "expected an object"),
        (b'{"model":"gpt-4o","messages":[{"content":"hi"}]}', "messages[0].role", "missing"),
        (
            b'{"model":"gpt-4o","messages":[{"role":"user","content":"a"},{"role":"robot"}]}',
            "messages[1].role",
            "'robot'",
        ),
        (b'{"model":"gpt-4o","messages":[{"role":5}]}', "messages[0].role", "5"),
    ],
)
async def test_bad_chat_bodies_are_400_with_envelope(
    proxy_client: httpx.AsyncClient,
    fake_openai: FakeOpenAI,
    raw: bytes,
    param: str | None,
    fragment: str,
) -> None:
    response = await proxy_client.post("/v1/chat/completions", content=raw)
    error = assert_envelope(response, 400, param)
    assert error["type"] == "invalid_request_error"
    assert fragment in str(error["message"])
    assert fake_openai.calls == []


@pytest.mark.parametrize(
    ("headers", "param"),
    [
        ({"x-compaction": "sometimes"}, "x-compaction"),
        ({"x-compaction-budget": "-5"}, "x-compaction-budget"),
    ],
)
async def test_bad_control_headers_are_400(
    proxy_client: httpx.AsyncClient, headers: dict[str, str], param: str
) -> None:
    response = await proxy_client.post(
        "/v1/chat/completions",
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]},
        headers=headers,
    )
    assert_envelope(response, 400, param)


@pytest.mark.compaction_proxy(server={"max_body_bytes": 1000})
async def test_body_over_limit_is_413(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    big = {"model": "gpt-4o", "messages": [{"role": "user", "content": "x" * 2000}]}
    response = await proxy_client.post("/v1/chat/completions", json=big)
    error = assert_envelope(response, 413)
    assert "max_body_bytes" in str(error["message"])

    async def chunks():  # no content-length: the limit must still hold while streaming
        for _ in range(5):
            yield b"x" * 300

    response = await proxy_client.post("/v1/chat/completions", content=chunks())
    assert_envelope(response, 413)
    assert fake_openai.calls == []


async def test_upstream_unreachable_is_502_naming_host(
    client: httpx.AsyncClient, upstream: respx.MockRouter
) -> None:
    upstream.post("/chat/completions").mock(side_effect=httpx.ConnectError("connection refused"))
    response = await client.post(
        "/v1/chat/completions",
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]},
    )
    error = assert_envelope(response, 502)
    assert "upstream.test" in str(error["message"])
    assert error["type"] == "upstream_error"
    assert response.headers["x-compaction-status"] == "passthrough"


async def test_upstream_timeout_is_504_naming_host(
    client: httpx.AsyncClient, upstream: respx.MockRouter
) -> None:
    upstream.get("/models").mock(side_effect=httpx.ReadTimeout("slow"))
    response = await client.get("/v1/models")
    error = assert_envelope(response, 504)
    assert "upstream.test" in str(error["message"])


async def test_passthrough_unreachable_is_502(
    client: httpx.AsyncClient, upstream: respx.MockRouter
) -> None:
    upstream.post("/embeddings").mock(side_effect=httpx.ConnectError("refused"))
    response = await client.post("/v1/embeddings", json={"input": "x"})
    assert_envelope(response, 502)


async def test_upstream_breaking_off_a_small_reply_is_502(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    fake_openai.replies = [BrokenStream()]  # a 200 whose JSON body stops half-way
    response = await proxy_client.post(
        "/v1/chat/completions",
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]},
    )
    error = assert_envelope(response, 502)
    assert "upstream.test" in str(error["message"])
    assert response.headers["x-compaction-status"] == "passthrough"
