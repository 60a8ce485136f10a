"""Request limits (messages, counted tokens), `x-compaction: off`, and big bodies off the loop."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import respx
from hypothesis import given
from hypothesis import strategies as st

from proxy import jsonparse, jsonspans
from proxy.app import create_app
from proxy.settings import Settings
from proxy.tokens import TokenCounter
from proxy.tokens.counter import OFFLOAD_MESSAGES, SLICE_CHARS, TooManyTokens
from proxy.validation import INLINE_BYTES, OFFLOAD_BYTES
from tests.conftest import make_settings, until
from tests.upstream_fakes import FakeUpstream


def chat(count: int, text: str = "hello there") -> dict[str, Any]:
    roles = ("user", "assistant")
    return {
        "model": "gpt-4o",
        "messages": [{"role": roles[i % 2], "content": f"{text} {i}"} for i in range(count)],
    }


@pytest.fixture
def fake(upstream: respx.MockRouter) -> FakeUpstream:
    return FakeUpstream().install(upstream)


async def serve(settings: Settings, counter: TokenCounter | None = None) -> AsyncIterator[Any]:
    app = create_app(settings, counter=counter, transport=httpx.AsyncHTTPTransport())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as c:
        yield c, app


def assert_envelope(response: httpx.Response, status: int, code: str, param: str) -> None:
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code and error["param"] == param
    assert error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize("count", [11, 40_000])  # parsed whole / parsed in a thread, stopped
async def test_too_many_messages_is_a_400_and_nothing_is_forwarded(
    fake: FakeUpstream, count: int
) -> None:
    body = chat(count)
    assert (len(json.dumps(body)) > OFFLOAD_BYTES) == (count > 11)
    async for client, _ in serve(make_settings(server={"max_messages": 10})):
        response = await client.post("/v1/chat/completions", json=body)
        assert_envelope(response, 400, "array_above_max_length", "messages")
        assert "server.max_messages" in response.json()["error"]["message"]
        ok = await client.post("/v1/chat/completions", json=chat(10))
        assert ok.status_code == 200
    assert len(fake.forwarded) == 1


async def test_too_many_tokens_is_a_400_context_length_exceeded(fake: FakeUpstream) -> None:
    settings = make_settings(tokenizer={"max_request_tokens": 500})
    async for client, _ in serve(settings):
        response = await client.post("/v1/chat/completions", json=chat(200))
        assert_envelope(response, 400, "context_length_exceeded", "messages")
        assert "tokenizer.max_request_tokens" in response.json()["error"]["message"]
        big = await client.post("/v1/chat/completions", json=chat(OFFLOAD_MESSAGES + 1))
        assert_envelope(big, 400, "context_length_exceeded", "messages")  # counted in a thread
        assert (await client.post("/v1/chat/completions", json=chat(20))).status_code == 200
    assert len(fake.forwarded) == 1


def test_counting_stops_once_the_token_limit_is_passed() -> None:
    counter = TokenCounter(make_settings(tokenizer={"max_request_tokens": 1000}))
    counter.load()
    with pytest.raises(TooManyTokens):
        counter.count_request(chat(5000, "some words " * 20))
    assert counter.encode_calls < 100  # stopped after ~1000 tokens, not 5000 messages

    counter.encode_calls = 0
    huge = {"messages": [{"role": "user", "content": "word " * (SLICE_CHARS // 5 * 4)}]}
    with pytest.raises(TooManyTokens):
        counter.count_request(huge)
    assert counter.encode_calls == 2  # the role, then the first of 4 slices passed the limit
    counter.close()


async def test_compaction_off_counts_nothing(fake: FakeUpstream) -> None:
    async for client, app in serve(make_settings(compaction={"budget_tokens": 100})):
        counter = app.state.proxy.counter
        response = await client.post(
            "/v1/chat/completions", json=chat(3000), headers={"x-compaction": "off"}
        )
        assert response.status_code == 200
        assert response.headers["x-compaction-status"] == "off"
        assert "x-compaction-tokens-before" not in response.headers
        assert counter.encode_calls == 0
        assert fake.summary_calls == []

        await client.post("/v1/chat/completions", json=chat(3))  # auto: counted
        assert counter.encode_calls > 0


class GatedCounter(TokenCounter):
    """Blocks its thread-pool count until the test says go: proves it is not on the loop."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.started = threading.Event()
        self.go = threading.Event()

    def count_request(self, body: dict[str, Any], keys: Any = None) -> int:
        self.started.set()
        assert self.go.wait(10), "the test never released the count"
        return super().count_request(body, keys)


async def test_healthz_answers_while_a_big_request_is_being_counted(fake: FakeUpstream) -> None:
    settings = make_settings()
    counter = GatedCounter(settings)
    counter.load()
    async for client, _ in serve(settings, counter):
        big = asyncio.create_task(client.post("/v1/chat/completions", json=chat(5000)))
        await until(counter.started.is_set)
        health = await client.get("/healthz")  # the loop is free while the count runs
        assert health.status_code == 200
        assert not big.done()
        counter.go.set()
        assert (await big).status_code == 200
    counter.close()


@pytest.mark.parametrize("parser", ["spans", "stdlib", "refused"])
async def test_healthz_answers_while_a_big_body_is_being_parsed(
    fake: FakeUpstream, monkeypatch: pytest.MonkeyPatch, parser: str
) -> None:
    """Either parser: the span parser, or the stdlib one when the span parser declines; and
    a body small enough for the loop that its fast path refuses (a lone surrogate) goes to
    the span parser in a thread too."""
    started, go = threading.Event(), threading.Event()
    module: Any = jsonparse if parser == "stdlib" else jsonspans
    name = "loads" if parser == "stdlib" else "loads_chat"
    real = getattr(module, name)

    def gated(raw: bytes, *args: Any, **kwargs: Any) -> Any:
        started.set()
        assert go.wait(10), "the test never released the parse"
        return real(raw, *args, **kwargs)

    if parser == "stdlib":
        monkeypatch.setattr(jsonspans, "loads_chat", lambda *args: None)
    monkeypatch.setattr(module, name, gated)
    body = chat(40_000) if parser != "refused" else chat(400, "x \ud800 " + "y" * 300)
    raw = json.dumps(body).encode()
    assert (len(raw) > INLINE_BYTES) == (parser != "refused")
    async for client, _ in serve(make_settings()):
        post = client.post(
            "/v1/chat/completions",
            content=raw,
            headers={"x-compaction": "off", "content-type": "application/json"},
        )
        big = asyncio.create_task(post)
        await until(started.is_set)
        assert (await client.get("/healthz")).status_code == 200
        assert not big.done()
        go.set()
        assert (await big).status_code == 200
    assert fake.forwarded[0] == body


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(
    st.dictionaries(st.text(max_size=5), json_values, max_size=5),
    st.sampled_from([None, 2]),
    st.sampled_from([(",", ":"), (", ", ": "), (" , ", " : ")]),
)
def test_incremental_parser_equals_json_loads(
    value: dict[str, Any], indent: int | None, separators: tuple[str, str]
) -> None:
    raw = json.dumps(value, indent=indent, separators=separators).encode()
    assert jsonparse.loads(raw) == json.loads(raw)


@pytest.mark.parametrize(
    "raw",
    [b'{"a":[1,]}', b'{"a":[1 2]}', b'{"a":[', b'{"a" 1}', b'{"a":1,}', b'{"a":1} x', b"{"],
)
def test_incremental_parser_refuses_what_json_loads_refuses(raw: bytes) -> None:
    with pytest.raises(json.JSONDecodeError) as ours:
        jsonparse.loads(raw)
    with pytest.raises(json.JSONDecodeError) as theirs:
        json.loads(raw)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "chunks", [[b'{"a":1}'], [b'{"a"', b"", b":1}"], [b"", b'{"a":1}', b""], [b""], []]
)
async def test_a_body_read_in_any_pieces_is_the_bytes_sent(chunks: list[bytes]) -> None:
    from starlette.requests import Request

    from proxy.validation import read_body

    messages = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    messages.append({"type": "http.request", "body": b"", "more_body": False})

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    assert await read_body(request, 100) == b"".join(chunks)
