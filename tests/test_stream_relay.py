"""Streamed replies through the served proxy (uvicorn on 127.0.0.1, the wire transport).

The client gets the upstream's stream byte for byte whether it had all arrived by the time
the proxy relayed it or came a piece at a time: the head is never held back for a body
still to come, nor what has come for what has not. With a proxy key and a client that did
not ask for usage, the same holds minus the one usage event the proxy asked for, whose
counts are the key's usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from proxy.app import create_app
from tests.conftest import make_settings
from tests.fault_upstream import (
    SSE_DONE,
    SSE_EVENTS,
    SSE_USAGE_EVENT,
    WAIT_S,
    FaultUpstream,
    RawReply,
    fault_upstream,
    http_request,
    parse_reply,
    serving,
)
from tests.keys.conftest import KEY_A, key_entry, keyed_settings

STREAM = json.dumps(
    {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "stream": True}
).encode()
EVENTS = b"".join(SSE_EVENTS) + SSE_DONE


@contextlib.asynccontextmanager
async def proxy(keyed: bool) -> AsyncIterator[tuple[FaultUpstream, int, Any]]:
    async with fault_upstream() as upstream:
        sections: dict[str, Any] = {"upstream": {"base_url": upstream.url + "/v1"}}
        key = key_entry("team-a", KEY_A, requests_per_minute=50)
        settings = keyed_settings(key, **sections) if keyed else make_settings(**sections)
        app = create_app(settings)
        try:
            async with serving(app) as port:
                try:
                    yield upstream, port, app
                finally:
                    upstream.release.set()
        finally:
            await app.state.proxy.upstream.client.aclose()


class Reading:
    """One request on a raw connection, its reply read as it comes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.data = b""

    async def until(self, done: Callable[[RawReply], bool]) -> RawReply:
        """Read until `done(reply so far)` (bounded: fails the test after WAIT_S)."""
        async with asyncio.timeout(WAIT_S):
            while not done(reply := parse_reply(self.data)):
                piece = await self.reader.read(65536)
                assert piece, f"the proxy closed the connection; got {self.data!r}"
                self.data += piece
        return reply


@contextlib.asynccontextmanager
async def request(
    port: int, fault: str, keyed: bool, body: bytes = STREAM
) -> AsyncIterator[Reading]:
    headers = [(b"content-type", b"application/json"), (b"x-fault", fault.encode())]
    if keyed:
        headers.append((b"authorization", b"Bearer " + KEY_A.encode()))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(http_request("POST", b"/v1/chat/completions", headers=headers, body=body))
        await writer.drain()
        yield Reading(reader, writer)
    finally:
        writer.close()


async def usage_of(app: Any) -> dict[str, int]:
    """The key's one usage row, once the reply's accounting has been recorded (bounded)."""
    state = app.state.proxy
    async with asyncio.timeout(WAIT_S):
        while True:
            await state.meter.join()
            rows = await state.meter.ledger.usage(None, "0000-00-00", "9999-12-31")
            if rows:
                return rows[0].counts._asdict()
            await asyncio.sleep(0.005)  # polls what the proxy records after the reply's end


@pytest.mark.parametrize("keyed", [False, True], ids=["no-keys", "keyed"])
@pytest.mark.parametrize("fault", ["sse", "sse-gated", "sse-first-then-gated"])
async def test_the_client_gets_the_stream_as_the_upstream_sent_it(fault: str, keyed: bool) -> None:
    async with proxy(keyed) as (upstream, port, app), request(port, fault, keyed) as reading:
        head = await reading.until(lambda reply: reply.status != 0)
        assert head.status == 200
        assert head.header(b"content-type") == b"text/event-stream"
        if fault != "sse":
            # The upstream holds the rest until told: what it sent is here without it.
            sent = b"" if fault == "sse-gated" else SSE_EVENTS[0]
            first = await reading.until(lambda reply: len(reply.body) >= len(sent))
            assert first.body == sent and not first.complete
            assert not upstream.gate.is_set()
            upstream.gate.set()
        reply = await reading.until(lambda reply: reply.complete)
        assert reply.body == EVENTS  # with keys: without the usage event the proxy asked for
        asked = json.loads(upstream.seen[-1].body).get("stream_options")
        assert asked == ({"include_usage": True} if keyed else None)
        assert reading.data.endswith(b"0\r\n\r\n")
        if keyed:
            counts = await usage_of(app)
            assert (counts["prompt_tokens_forwarded"], counts["completion_tokens"]) == (11, 3)
            assert counts.get("estimated_requests", 0) == 0


async def test_a_client_that_asked_for_usage_gets_it_from_a_keyed_proxy() -> None:
    body = json.dumps(json.loads(STREAM) | {"stream_options": {"include_usage": True}}).encode()
    async with proxy(keyed=True) as (_, port, _app), request(port, "sse", True, body) as reading:
        reply = await reading.until(lambda reply: reply.complete)
        assert reply.body == b"".join(SSE_EVENTS) + SSE_USAGE_EVENT + SSE_DONE
