"""Streaming and disconnects through real sockets: the proxy relays each SSE chunk as it comes,
and a client going away reaches the upstream as a closed connection.

Incremental delivery is proven by ordering, not timing: the fake upstream withholds the next
chunk until the client has received the previous one, so a proxy that buffered would deadlock
(and the client's bounded read timeout would fail the test).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import openai
import pytest

from tests.integration.harness import PIECES, REPLY_TEXT, WAIT_S, FakeUpstream

pytestmark = pytest.mark.integration

MESSAGES: list[dict[str, str]] = [{"role": "user", "content": "Say hello."}]


def test_sync_stream_delivers_each_chunk_before_the_upstream_sends_the_next(
    sdk: openai.OpenAI, fake_upstream: FakeUpstream
) -> None:
    received: list[str] = []
    with sdk.chat.completions.create(model="lockstep", messages=MESSAGES, stream=True) as stream:
        for chunk in stream:
            if not chunk.choices or not chunk.choices[0].delta.content:
                continue
            index = len(received)
            received.append(chunk.choices[0].delta.content)
            # The upstream has not sent the next piece: it is waiting for us to ask for it.
            assert not fake_upstream.signal(f"sent-{index + 1}").is_set()
            fake_upstream.signal(f"next-{index + 1}").set()
    assert received == PIECES
    assert fake_upstream.state.holds == ["released"] * (len(PIECES) - 1)


async def test_async_first_chunk_arrives_while_the_upstream_is_still_waiting(
    async_sdk: openai.AsyncOpenAI, fake_upstream: FakeUpstream
) -> None:
    """Time to first byte through the proxy tracks the upstream's."""
    raw = await async_sdk.chat.completions.with_raw_response.create(
        model="lockstep", messages=MESSAGES, stream=True
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.headers["cache-control"] == "no-cache"
    assert raw.headers["x-compaction-status"] == "passthrough"
    stream = raw.parse()
    chunks = stream.__aiter__()
    first = await chunks.__anext__()
    assert first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content == PIECES[0]
    # The first chunk is here, and the upstream is provably still holding the rest.
    assert fake_upstream.signal("sent-0").is_set()
    assert not fake_upstream.signal("sent-1").is_set()
    assert not fake_upstream.state.holds
    for index in range(1, len(PIECES)):
        fake_upstream.signal(f"next-{index}").set()
    rest = [c.choices[0].delta.content or "" async for c in chunks if c.choices]
    assert PIECES[0] + "".join(rest) == REPLY_TEXT


def test_closing_a_sync_stream_mid_way_closes_the_upstream_connection(
    sdk: openai.OpenAI, fake_upstream: FakeUpstream
) -> None:
    stream = sdk.chat.completions.create(model="hang", messages=MESSAGES, stream=True)
    first = next(iter(stream))
    assert first.choices[0].delta.content == PIECES[0]
    stream.close()
    assert fake_upstream.signal("disconnected").wait(WAIT_S), "upstream never saw the close"
    assert fake_upstream.state.holds == ["disconnected"]
    assert not fake_upstream.signal("release").is_set()


async def test_closing_an_async_stream_mid_way_closes_the_upstream_connection(
    async_sdk: openai.AsyncOpenAI, fake_upstream: FakeUpstream
) -> None:
    stream = await async_sdk.chat.completions.create(model="hang", messages=MESSAGES, stream=True)
    async with stream:
        async for chunk in stream:
            assert chunk.choices[0].delta.content == PIECES[0]
            break
    assert await fake_upstream.signal("disconnected").wait_async(WAIT_S)
    assert fake_upstream.state.holds == ["disconnected"]


async def test_client_disconnect_while_upstream_thinks_cancels_the_upstream_request(
    async_sdk: openai.AsyncOpenAI, fake_upstream: FakeUpstream
) -> None:
    """Non-streaming: the upstream has not even sent headers when the client gives up."""
    call = asyncio.ensure_future(
        async_sdk.chat.completions.create(model="think", messages=MESSAGES)
    )
    assert await fake_upstream.signal("received").wait_async(WAIT_S)
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await call
    assert await fake_upstream.signal("disconnected").wait_async(WAIT_S), (
        "the proxy kept the upstream request open after its client left"
    )
    assert fake_upstream.state.holds == ["disconnected"]


def test_client_disconnect_while_upstream_thinks_cancels_passthrough_request(
    proxy_url: str, fake_upstream: FakeUpstream
) -> None:
    """Same on a passthrough route, with a bare socket as the client that hangs up."""
    host_port = proxy_url.removeprefix("http://").removesuffix("/v1")
    host, port = host_port.split(":")
    body = json.dumps({"model": "think", "input": "hello"}).encode()
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: {host_port}\r\n"
        "Content-Type: application/json\r\nAuthorization: Bearer sk-test\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as client:
        client.sendall(head + body)
        assert fake_upstream.signal("received").wait(WAIT_S)
    assert fake_upstream.signal("disconnected").wait(WAIT_S), (
        "the proxy kept the upstream request open after its client left"
    )
    assert fake_upstream.state.holds == ["disconnected"]


def test_echo_stream_with_usage_arrives_whole(
    sdk: openai.OpenAI, fake_upstream: FakeUpstream
) -> None:
    stream = sdk.chat.completions.create(
        model="echo", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY_TEXT
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 16
    assert fake_upstream.requests[-1].json()["stream_options"] == {"include_usage": True}
