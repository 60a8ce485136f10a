"""The upstream client (proxy/transport.py) against a raw upstream that answers as scripted:
replies framed every way the proxy relays, cut short, oversized, unsolicited bytes, closes,
and request bodies streamed up as they arrive."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import pytest

from proxy.settings import UpstreamSettings
from proxy.transport import UnsendableHeader, UpstreamTransport, create_upstream_client

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


async def test_a_body_ended_only_by_the_close_is_refused() -> None:
    """Its end cannot be told from a reset or a TLS close without close_notify (see the
    hostile-upstream tests): refused before the head, never relayed as complete."""
    unsized = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + b"x" * 100_000
    async with scripted(lambda n: unsized, close=lambda n: True) as (_, client):
        with pytest.raises(httpx.RemoteProtocolError, match="neither a Content-Length"):
            await client.post("/chat", content=b"{}")


async def test_chunked_replies_arrive_decoded_piece_by_piece() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        b"b\r\ndata: one\n\n\r\nb\r\ndata: two\n\n\r\n0\r\n\r\n"
    )
    async with scripted(lambda n: chunked if n == 1 else OK) as (upstream, client):
        async with client.stream("POST", "/chat", content=b"{}") as reply:
            pieces = [chunk async for chunk in reply.aiter_raw()]
        assert b"".join(pieces) == b"data: one\n\ndata: two\n\n"
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
        b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * (1 << 20) + b"\r\n\r\n",
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
        upstream.writers[0].write(b"{}")  # bytes nobody asked for
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


@pytest.mark.parametrize(
    ("name", "value"),
    [(b"x-a", b"1\r\nx-b: 2"), (b"x-a", b"1\n"), (b"x\xe9", b"1"), (b"x-title", b"caf\xe9")],
    ids=["crlf", "lf", "latin1-name", "latin1-value"],
)
async def test_headers_that_cannot_go_out_as_given_are_not_written(
    name: bytes, value: bytes
) -> None:
    async with scripted(lambda n: OK) as (upstream, client):
        request = httpx.Request(
            "POST", client.base_url.join("/chat"), headers=[(name, value)], content=b"{}"
        )
        with pytest.raises(UnsendableHeader):
            await client.send(request)
        assert (await client.post("/chat", content=b"{}")).content == b"{}"
    assert len(upstream.requests) == 1  # only the second request went out


async def test_utf8_header_values_go_out_byte_for_byte() -> None:
    async with scripted(lambda n: OK) as (upstream, client):
        title = "Café ☕".encode()
        await client.post("/chat", content=b"{}", headers=[(b"X-Title", title)])
    assert b"\r\nX-Title: " + title + b"\r\n" in upstream.requests[0]


# -- HEAD ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "framing",
    [b"content-length: 1234", b"transfer-encoding: chunked", b"content-length: 0"],
    ids=["sized", "chunked", "empty"],
)
async def test_a_head_reply_has_no_body_and_its_connection_is_its_own(framing: bytes) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%s\r\n\r\n" % framing
    async with scripted(lambda n: head if n % 2 else OK) as (upstream, client):
        for _ in range(2):
            reply = await client.head("/files/f1")
            assert reply.status_code == 200 and reply.content == b""
            assert reply.headers["content-type"] == "application/json"
            assert (await client.post("/chat", content=b"{}")).content == b"{}"
    assert upstream.connections == 3  # one per HEAD, one kept for the POSTs
    assert [r.split(b" ", 1)[0] for r in upstream.requests] == [b"HEAD", b"POST"] * 2
    assert all(b"\r\nConnection: close\r\n" in r for r in upstream.requests[::2])


async def test_bytes_after_a_head_reply_never_reach_another_request() -> None:
    with_body = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"  # a body HEAD must not get
    async with scripted(lambda n: with_body if n == 1 else OK) as (upstream, client):
        try:  # (aiohttp refuses the reply when the bytes come with it, as here on loopback)
            reply = await client.head("/files/f1")
            assert reply.status_code == 200 and reply.content == b""
        except httpx.RemoteProtocolError:
            pass
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
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # a connection ended

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
            self.closed.set()
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
    upstream_settings = UpstreamSettings(base_url=url, **settings)  # type: ignore[arg-type]
    transport = UpstreamTransport.for_settings(upstream_settings)
    client = create_upstream_client(upstream_settings, transport)
    client.base_url = httpx.URL(url)
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
            await upstream.closed.wait()
        assert not upstream.ended  # cut mid-body, or (too long at once) not even its head
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
    async with receiving(upstream, timeout_s=60) as (_, client):

        async def body() -> AsyncIterator[bytes]:
            nonlocal produced
            while produced < total:
                produced += len(piece)
                yield piece

        sending = asyncio.ensure_future(client.post("/v1/files", content=body()))
        held = -1
        async with asyncio.timeout(10):
            while produced != held:  # until the writer stops asking for more
                held = produced
                await asyncio.sleep(0.1)
        assert held < total // 4  # socket buffers and a few pieces, not the whole body
        upstream.go.set()
        async with asyncio.timeout(30):
            reply = await sending
        assert reply.status_code == 200
        assert sum(map(len, upstream.pieces)) == total


async def test_an_upstream_that_takes_no_body_bytes_for_the_read_timeout_is_a_write_timeout() -> (
    None
):
    upstream = Receiving(read=False)
    async with receiving(upstream, timeout_s=0.5) as (transport, client):

        async def body() -> AsyncIterator[bytes]:
            while True:
                yield b"z" * 65536

        async with asyncio.timeout(10):
            with pytest.raises(httpx.WriteTimeout):
                await client.post("/v1/files", content=body())
        assert transport.slots.in_use == 0
        upstream.go.set()


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
