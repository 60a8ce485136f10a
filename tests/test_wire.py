"""The small HTTP/1.1 client (proxy/wire.py) against a raw upstream that answers as scripted:
replies framed every way HTTP allows, cut short, oversized, unsolicited bytes, closes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import pytest

from proxy import wire
from proxy.settings import UpstreamSettings
from proxy.transport import UpstreamTransport, create_upstream_client
from tests.conftest import until

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
        self.cleared_at = 0.0
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


# -- HEAD ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "framing",
    [b"content-length: 1234", b"transfer-encoding: chunked", b"content-length: 0"],
    ids=["sized", "chunked", "empty"],
)
async def test_a_head_reply_has_no_body_and_keeps_the_connection(framing: bytes) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%s\r\n\r\n" % framing
    async with scripted(lambda n: head if n % 2 else OK) as (upstream, client):
        for _ in range(2):
            reply = await client.head("/files/f1")
            assert reply.status_code == 200 and reply.content == b""
            assert reply.headers["content-type"] == "application/json"
            assert (await client.post("/chat", content=b"{}")).content == b"{}"
    assert upstream.connections == 1
    assert [r.split(b" ", 1)[0] for r in upstream.requests] == [b"HEAD", b"POST"] * 2


async def test_bytes_after_a_head_reply_retire_the_connection() -> None:
    with_body = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"  # a body HEAD must not get
    async with scripted(lambda n: with_body if n == 1 else OK) as (upstream, client):
        reply = await client.head("/files/f1")
        assert reply.status_code == 200 and reply.content == b""
        assert (await client.post("/chat", content=b"{}")).content == b"{}"
    assert upstream.connections == 2


# -- streamed request bodies --------------------------------------------------------------


@dataclass
class Receiving:
    """An upstream that reads one request's body piece by piece as it comes (chunked or by
    Content-Length), and answers `reply` once the body has ended (or at once with `early`)."""

    reply: bytes = OK
    early: bool = False  # answer after the head, without reading the body
    read: bool = True  # False: read nothing past the head until `go` is set
    go: asyncio.Event = field(default_factory=asyncio.Event)
    head: bytes = b""
    pieces: list[bytes] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # a piece came
    ended: bool = False  # the body came to its end
    cut: bool = False  # the connection closed before the body's end
    connections: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        in_body = False
        try:
            while True:
                self.head = await reader.readuntil(b"\r\n\r\n")
                if self.early:
                    writer.write(self.reply)
                    await writer.drain()
                    break
                if not self.read:
                    await self.go.wait()
                in_body = True
                await self._body(reader)
                in_body = False
                self.ended = True
                writer.write(self.reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.cut = in_body
        finally:
            writer.close()

    async def _body(self, reader: asyncio.StreamReader) -> None:
        lines = self.head.lower().split(b"\r\n")
        length = next((int(ln[15:]) for ln in lines if ln.startswith(b"content-length:")), None)
        if length is not None:
            while length:
                piece = await reader.read(min(length, 65536))
                if not piece:
                    raise asyncio.IncompleteReadError(b"", length)
                length -= len(piece)
                self._got(piece)
            return
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            self._got(await reader.readexactly(size))
            await reader.readexactly(2)
        await reader.readexactly(2)

    def _got(self, piece: bytes) -> None:
        self.pieces.append(piece)
        self.arrived.set()


@contextlib.asynccontextmanager
async def receiving(
    upstream: Receiving, **settings: float
) -> AsyncIterator[tuple[UpstreamTransport, httpx.AsyncClient]]:
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = create_upstream_client(UpstreamSettings(base_url=url, **settings))  # type: ignore[arg-type]
    client.base_url = httpx.URL(url)
    transport = client._transport
    assert isinstance(transport, UpstreamTransport)
    try:
        async with client:
            yield transport, client
    finally:
        server.close()


async def test_a_streamed_body_goes_up_chunked_as_it_arrives() -> None:
    upstream = Receiving()
    async with receiving(upstream) as (transport, client):

        async def body() -> AsyncIterator[bytes]:
            for i in range(3):
                upstream.arrived.clear()
                yield b"piece %d;" % i
                async with asyncio.timeout(5):  # the piece is upstream before the next exists
                    await upstream.arrived.wait()

        reply = await client.post("/v1/files", content=body())
        assert reply.status_code == 200 and reply.content == b"{}"
        assert b"transfer-encoding: chunked" in upstream.head.lower()
        assert b"content-length" not in upstream.head.lower()
        assert upstream.pieces == [b"piece 0;", b"piece 1;", b"piece 2;"]
        assert (await client.post("/chat", content=b"{}")).content == b"{}"  # kept alive
        assert transport.slots.in_use == 0
    assert upstream.connections == 1


async def test_a_streamed_body_with_a_content_length_goes_up_as_is() -> None:
    upstream = Receiving()
    async with receiving(upstream) as (_, client):

        async def body() -> AsyncIterator[bytes]:
            yield b"abc"
            yield b""
            yield b"defg"

        reply = await client.post("/v1/files", content=body(), headers={"content-length": "7"})
        assert reply.status_code == 200
        assert b"content-length: 7" in upstream.head.lower()
        assert b"transfer-encoding" not in upstream.head.lower()
        assert b"".join(upstream.pieces) == b"abcdefg"
        assert (await client.post("/chat", content=b"{}")).content == b"{}"
    assert upstream.connections == 1


@pytest.mark.parametrize("pieces", [[b"abc"], [b"abcdefgh"]], ids=["short", "long"])
async def test_a_body_unlike_its_content_length_aborts_the_request(pieces: list[bytes]) -> None:
    upstream = Receiving()
    async with receiving(upstream) as (transport, client):

        async def body() -> AsyncIterator[bytes]:
            for piece in pieces:
                yield piece

        with pytest.raises(httpx.LocalProtocolError, match="Content-Length"):
            await client.post("/v1/files", content=body(), headers={"content-length": "7"})
        async with asyncio.timeout(5):
            while not upstream.cut:  # noqa: ASYNC110 - the upstream's own state
                await asyncio.sleep(0.005)
        assert not upstream.ended
        assert transport.slots.in_use == 0


async def test_a_body_that_fails_mid_upload_aborts_the_upstream_request() -> None:
    upstream = Receiving()
    async with receiving(upstream) as (transport, client):

        async def body() -> AsyncIterator[bytes]:
            yield b"first piece"
            async with asyncio.timeout(5):
                await upstream.arrived.wait()
            raise ConnectionResetError("the client left")  # as a departing client's body does

        with pytest.raises(httpx.WriteError, match="broke off"):
            await client.post("/v1/files", content=body())
        async with asyncio.timeout(5):
            while not upstream.cut:  # noqa: ASYNC110 - the upstream's own state
                await asyncio.sleep(0.005)
        assert not upstream.ended  # no last chunk: the upstream knows the body is incomplete
        assert upstream.pieces == [b"first piece"]
        assert transport.slots.in_use == 0
        upstream.cut = False
        assert (await client.post("/chat", content=b"{}")).content == b"{}"  # a new connection
    assert upstream.connections == 2


async def test_a_reply_before_the_body_has_gone_is_read_and_the_upload_stopped() -> None:
    refusal = b"HTTP/1.1 413 Payload Too Large\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}"
    upstream = Receiving(reply=refusal, early=True)
    stopped = asyncio.Event()
    async with receiving(upstream) as (transport, client):

        async def body() -> AsyncIterator[bytes]:
            try:
                yield b"first piece"
                await asyncio.Event().wait()  # the rest never comes
                yield b"never"
            finally:
                stopped.set()

        async with asyncio.timeout(5):
            reply = await client.post("/v1/files", content=body())
            assert (reply.status_code, reply.content) == (413, b"{}")
            await stopped.wait()  # closing the reply ended the upload
        assert transport.slots.in_use == 0


async def test_an_upstream_that_reads_nothing_holds_a_bounded_part_of_the_body() -> None:
    upstream = Receiving(read=False)
    total, piece = 64 * 2**20, b"z" * 65536
    produced = 0
    async with receiving(upstream, timeout_s=60) as (transport, client):

        async def body() -> AsyncIterator[bytes]:
            nonlocal produced
            while produced < total:
                produced += len(piece)
                yield piece

        sending = asyncio.ensure_future(client.post("/v1/files", content=body()))

        def paused() -> bool:
            return any(connection._write_paused for connection in transport._wire._open)

        async with asyncio.timeout(10):
            while not paused():  # noqa: ASYNC110 - the socket's own state
                await asyncio.sleep(0.005)
        for _ in range(50):  # the loop runs on: nothing more is asked of the body
            await asyncio.sleep(0)
        held = produced
        assert held < total // 4  # socket buffers and one piece, not the whole body
        upstream.go.set()
        async with asyncio.timeout(30):
            reply = await sending
        assert reply.status_code == 200
        assert sum(map(len, upstream.pieces)) == total


async def test_the_read_timeout_starts_once_the_body_has_gone() -> None:
    upstream = Receiving()
    async with receiving(upstream, timeout_s=0.3) as (_, client):

        async def slow_body() -> AsyncIterator[bytes]:
            for i in range(3):  # a client sending slower than the read timeout
                yield b"piece %d;" % i
                await asyncio.sleep(0.2)

        reply = await client.post("/v1/files", content=slow_body())
        assert reply.status_code == 200
        assert len(upstream.pieces) == 3
        upstream.reply = b""  # now the reply never comes

        async def body() -> AsyncIterator[bytes]:
            yield b"x"

        async with asyncio.timeout(5):
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/files", content=body())


async def test_bytes_already_in_when_the_read_timeout_falls_due_are_not_a_timeout() -> None:
    """The loop was busy past the read timeout while the reply's first bytes were already
    in the socket. asyncio then runs the socket's callback before the timer due in the same
    turn: the bytes are read, the wait is over, and the reply goes on (before, the due timer
    failed it a moment later, and its body read raised ReadTimeout). uvloop runs due timers
    first, so there the loop being late is a timeout, as for any client."""
    loop = asyncio.get_running_loop()
    if "uvloop" in type(loop).__module__:
        pytest.skip("uvloop runs due timers before reading sockets")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    received, go, sent, rest = (threading.Event() for _ in range(4))

    def upstream() -> None:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while not data.endswith(b"{}"):
                data += conn.recv(65536)
            received.set()
            go.wait(10)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n{}")  # half the body
            sent.set()
            rest.wait(10)
            conn.sendall(b"{}")

    thread = threading.Thread(target=upstream, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    client = create_upstream_client(UpstreamSettings(base_url=url, timeout_s=0.2))
    try:
        request = client.build_request("POST", url + "/chat", content=b"{}")
        sending = asyncio.ensure_future(client.send(request, stream=True))
        await until(received.is_set)  # the request is in; the wire waits, its timer armed
        go.set()
        assert sent.wait(10)
        time.sleep(0.3)  # noqa: ASYNC251 - the busy loop under test: past the 0.2 s timeout
        reply = await sending
        rest.set()
        assert reply.status_code == 200
        assert await reply.aread() == b"{}{}"
    finally:
        rest.set()
        await client.aclose()
        thread.join(10)
        listener.close()
