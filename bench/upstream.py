"""A fast local OpenAI-like upstream for the benchmarks: raw asyncio + httptools, keep-alive.

Not uvicorn on purpose: the upstream must cost far less per request than anything it is used
to measure, so the "direct" row is the ceiling of this machine, not of a framework.

Any POST answers a chat completion; a body containing `"stream": true` (or `"stream":true`)
gets an SSE stream of `SSE_EVENTS` chunks plus `data: [DONE]`, written one event per write.
GET answers a small model list. Run: python -m bench.upstream --port 9000

`--pace-ms N --events M`: streams send M events N ms apart (a model generating tokens), for
bench/load.py; non-streaming answers stay immediate (so the proxy's summarizer calls are too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import typing
from typing import Any

import httptools

SSE_EVENTS = 10

_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "gpt-4o-mini",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello! How can I help you today?"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21},
    }
).encode()
_MODELS = json.dumps(
    {"object": "list", "data": [{"id": "gpt-4o-mini", "object": "model"}]}
).encode()


def _sse_event(i: int) -> bytes:
    chunk = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "gpt-4o-mini",
        "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_SSE_CHUNKS = [_chunk(_sse_event(i)) for i in range(SSE_EVENTS)] + [
    _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
]
# With stream_options.include_usage, OpenAI sends one more event: no choices, only usage.
_SSE_USAGE_CHUNK = _chunk(
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":9,'
    b'"total_tokens":21}}\n\n'
)
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def _json_response(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


_COMPLETION_RESPONSE = _json_response(_COMPLETION)
_MODELS_RESPONSE = _json_response(_MODELS)


class UpstreamProtocol(asyncio.Protocol):
    pace_s = 0.0  # > 0: streams are paced (set by main)
    events = SSE_EVENTS

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            self.transport.close()

    def on_message_begin(self) -> None:
        self.body = []

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        transport = self.transport
        assert transport is not None
        if self.parser.get_method() == b"GET":
            transport.write(_MODELS_RESPONSE)
            return
        body = b"".join(self.body)
        self.body = []
        if (b'"stream": true' in body or b'"stream":true' in body) and self.pace_s > 0:
            self.paced(transport)
        elif b'"stream": true' in body or b'"stream":true' in body:
            transport.write(_SSE_HEAD)
            for chunk in _SSE_CHUNKS[:-1]:
                transport.write(chunk)
            if b'"include_usage":true' in body or b'"include_usage": true' in body:
                transport.write(_SSE_USAGE_CHUNK)
            transport.write(_SSE_CHUNKS[-1])
        else:
            transport.write(_COMPLETION_RESPONSE)

    def paced(self, transport: asyncio.Transport) -> None:
        """One event now, then one every `pace_s`, then [DONE]; timers, not a task per stream."""
        loop = asyncio.get_running_loop()
        transport.write(_SSE_HEAD + _chunk(_sse_event(0)))
        start = loop.time()
        for i in range(1, self.events + 1):
            last = i == self.events
            data = _SSE_CHUNKS[-1] if last else _chunk(_sse_event(i))
            loop.call_at(start + i * self.pace_s, _write_open, transport, data)


def _write_open(transport: asyncio.Transport, data: bytes) -> None:
    if not transport.is_closing():
        transport.write(data)


async def asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The same answers as an ASGI app, for an HTTP/2 (h2c) upstream under hypercorn."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if b'"stream": true' in body or b'"stream":true' in body:
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for i in range(SSE_EVENTS):
            await send({"type": "http.response.body", "body": _sse_event(i), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    else:
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": _COMPLETION})


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(UpstreamProtocol, host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--pace-ms", type=float, default=0.0)
    parser.add_argument("--events", type=int, default=SSE_EVENTS)
    args = parser.parse_args()
    UpstreamProtocol.pace_s = args.pace_ms / 1000
    UpstreamProtocol.events = args.events
    import uvloop

    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
