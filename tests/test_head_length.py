"""A HEAD request relayed through the proxy gets the upstream's headers as sent, its
Content-Length included (RFC 9110 9.3.2: the length a GET would have, with no body), on
every relay path: a small reply read whole, a large one streamed, none given. Served
(uvicorn on 127.0.0.1, which writes a HEAD response's Content-Length as given and no
body) and in-process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
import respx

from proxy.app import create_app
from tests.conftest import make_settings
from tests.fault_upstream import http_request, parse_reply, serving

# path -> the upstream's reply head to a HEAD (no body follows any of them)
HEADS = {
    b"/v1/small": [(b"content-type", b"application/json"), (b"content-length", b"133")],
    b"/v1/large": [(b"content-type", b"application/json"), (b"content-length", b"9999999")],
    b"/v1/stream": [(b"content-type", b"text/event-stream"), (b"content-length", b"50")],
    b"/v1/chunked": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
    b"/v1/empty": [(b"content-type", b"application/json"), (b"content-length", b"0")],
}


def length_of(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    return next((v for k, v in headers if k.lower() == b"content-length"), None)


async def _answer_heads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HEAD ")
            headers = HEADS[head.split(b" ")[1]]
            lines = [b"HTTP/1.1 200 OK", *(k + b": " + v for k, v in headers)]
            writer.write(b"\r\n".join(lines) + b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        pass
    finally:
        writer.close()


@pytest.fixture
async def head_upstream() -> AsyncIterator[str]:
    server = await asyncio.start_server(_answer_heads, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    finally:
        server.close()


async def test_served_head_replies_carry_the_upstreams_content_length(head_upstream: str) -> None:
    app = create_app(make_settings(upstream={"base_url": head_upstream}))
    try:
        async with serving(app) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                for path, headers in HEADS.items():  # one kept connection: each reply ends
                    writer.write(http_request("HEAD", path, keep_alive=True))
                    async with asyncio.timeout(10):  # the head alone: a HEAD has no body
                        reply = parse_reply(await reader.readuntil(b"\r\n\r\n"))
                    assert reply.status == 200
                    assert reply.header(b"content-length") == length_of(headers), path
                    assert reply.header(b"content-type") == headers[0][1]
                    assert reply.header(b"transfer-encoding") is None  # no body to frame
            finally:
                writer.close()
    finally:
        await app.state.proxy.upstream.client.aclose()


async def test_in_process_head_replies_carry_the_upstreams_content_length(
    client: httpx.AsyncClient, upstream: respx.MockRouter
) -> None:
    for path, headers in HEADS.items():
        route = path.removeprefix(b"/v1").decode()
        upstream.head(route).respond(200, headers=[(k.decode(), v.decode()) for k, v in headers])
        reply = await client.head("/v1" + route)
        assert reply.status_code == 200
        length = length_of(headers)
        assert reply.headers.get("content-length") == (length and length.decode()), path
        assert reply.content == b""
