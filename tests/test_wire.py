"""The small HTTP/1.1 client (proxy/wire.py) against a raw upstream that answers as scripted:
replies framed every way HTTP allows, cut short, oversized, unsolicited bytes, closes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import pytest

from proxy import wire
from proxy.settings import UpstreamSettings
from proxy.transport import UpstreamTransport, create_upstream_client

LOOPS = ("asyncio", "uvloop")  # the served proxy runs on uvloop

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


@dataclass
class Scripted:
    """Answers each request with `reply(n)` (n counts requests from 1), then, if `close`
    says so, closes the connection. Counts connections and requests."""

    reply: Callable[[int], bytes]
    close: Callable[[int], bool] = lambda n: False
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                self.requests.append(head + await reader.readexactly(length))
                count = len(self.requests)
                writer.write(self.reply(count))
                await writer.drain()
                if self.close(count):
                    break
        writer.close()


@contextlib.asynccontextmanager
async def scripted(
    reply: Callable[[int], bytes], close: Callable[[int], bool] = lambda n: False, **settings: float
) -> AsyncIterator[tuple[Scripted, httpx.AsyncClient]]:
    upstream = Scripted(reply, close)
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    client = create_upstream_client(UpstreamSettings(base_url=url, **settings))  # type: ignore[arg-type]
    client.base_url = httpx.URL(url)
    try:
        async with client:
            yield upstream, client
    finally:
        for writer in upstream.writers:
            writer.close()
        server.close()


async def test_keep_alive_connections_are_reused() -> None:
    async with scripted(lambda n: OK) as (upstream, client):
        for _ in range(3):
            reply = await client.post("/chat", content=b"{}")
            assert reply.status_code == 200 and reply.content == b"{}"
    assert upstream.connections == 1
    assert len(upstream.requests) == 3


async def test_a_reply_saying_connection_close_is_not_reused() -> None:
    closing = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}"
    async with scripted(lambda n: closing, close=lambda n: True) as (upstream, client):
        for _ in range(2):
            assert (await client.post("/chat", content=b"{}")).content == b"{}"
    assert upstream.connections == 2


async def test_a_body_ended_by_the_close_arrives_whole() -> None:
    unsized = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + b"x" * 100_000
    async with scripted(lambda n: unsized, close=lambda n: True) as (_, client):
        reply = await client.post("/chat", content=b"{}")
    assert reply.content == b"x" * 100_000


async def test_chunked_replies_arrive_decoded_piece_by_piece() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        b"b\r\ndata: one\n\n\r\nb\r\ndata: two\n\n\r\n0\r\n\r\n"
    )
    async with scripted(lambda n: chunked if n == 1 else OK) as (upstream, client):
        async with client.stream("POST", "/chat", content=b"{}") as reply:
            pieces = [chunk async for chunk in reply.aiter_raw()]
        # What one socket read brought (here the whole reply) goes on as one piece.
        assert pieces == [b"data: one\n\ndata: two\n\n"]
        assert (await client.post("/chat", content=b"{}")).content == b"{}"
    assert upstream.connections == 1  # a chunked reply read to its end keeps the connection


async def test_an_informational_reply_is_skipped() -> None:
    async with scripted(lambda n: b"HTTP/1.1 100 Continue\r\n\r\n" + OK) as (_, client):
        reply = await client.post("/chat", content=b"{}")
    assert reply.status_code == 200 and reply.content == b"{}"


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}",  # cut short
        b"",  # no reply at all
        b"NOT HTTP\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * (wire.MAX_HEAD_BYTES + 1) + b"\r\n\r\n",
    ],
    ids=["truncated", "nothing", "garbage", "huge-headers"],
)
async def test_broken_replies_are_remote_protocol_errors(reply: bytes) -> None:
    async with scripted(lambda n: reply, close=lambda n: True) as (upstream, client):
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/chat", content=b"{}")
        upstream.reply = lambda n: OK
        upstream.close = lambda n: False
        assert (await client.post("/chat", content=b"{}")).content == b"{}"  # a new connection


async def test_a_request_is_sent_once_when_a_reused_connection_drops() -> None:
    async with scripted(lambda n: OK if n == 1 else b"", close=lambda n: n > 1) as (up, client):
        assert (await client.post("/chat", content=b"{}")).status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/chat", content=b"{}")
    assert len(up.requests) == 2


async def test_a_second_reply_to_one_request_is_not_read_as_its_body() -> None:
    async with scripted(lambda n: OK + OK if n == 1 else OK) as (upstream, client):
        assert (await client.post("/chat", content=b"{}")).content == b"{}"
        assert (await client.post("/chat", content=b"{}")).content == b"{}"
    assert upstream.connections == 2  # the connection that said too much was dropped


async def test_bytes_sent_to_an_idle_connection_retire_it() -> None:
    async with scripted(lambda n: OK) as (upstream, client):
        assert (await client.post("/chat", content=b"{}")).status_code == 200
        upstream.writers[0].write(OK)  # a reply nobody asked for
        await upstream.writers[0].drain()
        for _ in range(100):  # the client closes it once the bytes arrive
            if upstream.writers[0].is_closing() or upstream.connections > 1:
                break
            await asyncio.sleep(0.01)
        assert (await client.post("/chat", content=b"{}")).content == b"{}"
    assert upstream.connections == 2


async def test_idle_connections_expire_and_are_bounded() -> None:
    async with scripted(lambda n: OK, keepalive_expiry_s=1e-6) as (upstream, client):
        for _ in range(2):
            assert (await client.post("/chat", content=b"{}")).status_code == 200
    assert upstream.connections == 2
    async with scripted(lambda n: OK, max_keepalive_connections=0) as (upstream, client):
        for _ in range(2):
            assert (await client.post("/chat", content=b"{}")).status_code == 200
    assert upstream.connections == 2


async def test_a_slow_reader_holds_a_bounded_buffer() -> None:
    size = 8 * wire.HIGH_WATER
    big = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size + b"y" * size
    async with scripted(lambda n: big) as (_, client):
        transport = client._transport
        assert isinstance(transport, UpstreamTransport)
        url = client.base_url.join("/chat")
        reply = await transport.send_bytes("POST", url, [], b"{}", {})
        stream = reply.stream
        assert isinstance(stream, wire.WireStream)
        received, peak = 0, 0
        async for chunk in reply.aiter_raw():
            received += len(chunk)
            await asyncio.sleep(0)  # let the socket deliver more meanwhile
            peak = max(peak, stream.buffered)
        await reply.aclose()
        assert received == size
    assert peak <= wire.HIGH_WATER + 256 * 1024  # one socket read past the mark at most


class Verdict:
    """A clearance that answers when told to: `refuse` is raised, else it clears."""

    def __init__(self, refuse: Exception | None = None) -> None:
        self.refuse = refuse
        self.go = asyncio.Event()
        self.waiting = asyncio.Event()

    async def cleared(self) -> None:
        self.waiting.set()
        await self.go.wait()
        if self.refuse is not None:
            raise self.refuse

    def abandon(self) -> None:
        raise AssertionError("not abandoned here")


async def test_nothing_is_written_before_the_clearance_and_a_refusal_keeps_the_connection() -> None:
    async with scripted(lambda n: OK) as (upstream, client):
        transport = client._transport
        assert isinstance(transport, UpstreamTransport)
        url = client.base_url.join("/chat")
        assert (await client.post("/chat", content=b"{}")).status_code == 200  # one idle
        refused = Verdict(PermissionError("over quota"))
        sending = asyncio.ensure_future(
            transport.send_bytes("POST", url, [], b"{}", {}, clearance=refused)
        )
        await refused.waiting.wait()  # the connection is in hand, the request made
        refused.go.set()
        with pytest.raises(PermissionError):
            await sending
        allowed = Verdict()
        allowed.go.set()
        reply = await transport.send_bytes("POST", url, [], b"{}", {}, clearance=allowed)
        assert reply.status_code == 200 and await reply.aread() == b"{}"
        await reply.aclose()
    # One connection, read in order: a refused request written on it would be counted
    # before the one that got the reply.
    assert upstream.connections == 1
    assert len(upstream.requests) == 2


def test_headers_that_would_break_the_framing_are_not_written() -> None:
    url = httpx.URL("http://up.test/v1/chat")
    assert wire.request_bytes("POST", url, [(b"x-a", b"1")], b"{}") is not None
    for name, value in ((b"x-a", b"1\r\nx-b: 2"), (b"x-a", b"1\n"), (b"x\rb", b"1")):
        assert wire.request_bytes("POST", url, [(name, value)], b"{}") is None
