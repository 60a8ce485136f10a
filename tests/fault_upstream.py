"""A misbehaving upstream on 127.0.0.1 (raw asyncio, no HTTP library), and a raw client.

The upstream reads each request byte for byte (so tests see exactly what the proxy sent) and
answers according to its `x-fault` header, or, for summarizer calls, to the model named:
slow first byte, a stall or a reset mid-stream, 429 with Retry-After, 5xx, non-JSON and
truncated bodies, reply headers that are not latin-1, a summarizer that hangs or fails.
It counts what tests assert on afterwards: replies in progress, connections the proxy cut.
Nothing waits on the clock: holds end when the peer goes away or the test releases them
(bounded by HOLD_S so an abandoned handler still ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from proxy.compaction.prompt import SYSTEM_PROMPT

HOLD_S = 10.0
WAIT_S = 10.0

REPLY = {
    "id": "chatcmpl-fault",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "fine"}}],
}
REPLY_BYTES = json.dumps(REPLY).encode()
SUMMARY = {
    "choices": [{"message": {"role": "assistant", "content": "SUMMARY: earlier talk."}}],
    "usage": {"prompt_tokens": 50, "completion_tokens": 5},
}
# Reply headers that are valid HTTP (obs-text) but not latin-1 text: UTF-8 (the whole set
# decodes as UTF-8, which is what httpx then does), or a lone latin-1 byte.
ODD_HEADERS = {
    "utf8-headers": [(b"x-note", "Café ☕ naïve".encode()), (b"x-title", "Équipe".encode())],
    "latin1-headers": [(b"x-latin", b"caf\xe9")],
}

# A streamed reply as OpenAI sends it: deltas, a finish, the usage event (only when the
# request asked for it with stream_options.include_usage), [DONE].
SSE_EVENTS = [
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":'
    b'{"content":"%s"},"finish_reason":null}]}\n\n' % word
    for word in (b"Hello", b" there", b"!")
] + [b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},'
     b'"finish_reason":"stop"}]}\n\n']  # fmt: skip
SSE_USAGE_EVENT = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[],'
    b'"usage":{"prompt_tokens":11,"completion_tokens":3,"total_tokens":14}}\n\n'
)
SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class Seen:
    """One request as it reached the upstream."""

    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    connection: int = 0  # which upstream connection carried it (1, 2, ...)

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)

    @property
    def is_summary(self) -> bool:
        """A summarizer call (its first message is the compaction system prompt)."""
        try:
            messages = json.loads(self.body).get("messages") or []
            return bool(messages) and messages[0].get("content") == SYSTEM_PROMPT
        except (ValueError, AttributeError):
            return False

    @property
    def path(self) -> bytes:
        return self.target.partition(b"?")[0]

    @property
    def query(self) -> bytes:
        return self.target.partition(b"?")[2]


@dataclass
class FaultUpstream:
    url: str = ""
    seen: list[Seen] = field(default_factory=list)
    active: int = 0  # replies being written or held
    cut_by_peer: int = 0  # holds that ended because the proxy closed the connection
    headers_out: int = 0  # replies whose status and headers went out before a hold
    heads_in: int = 0  # request heads read (a body may still be on its way)
    cut_mid_request: int = 0  # connections closed while a request's body was still coming
    connections: int = 0  # accepted so far
    connected: asyncio.Event = field(default_factory=asyncio.Event)  # one was accepted
    release: asyncio.Event = field(default_factory=asyncio.Event)
    gate: asyncio.Event = field(default_factory=asyncio.Event)  # opens "summarizer-gated"
    summaries_answered: int = 0  # of "summarizer-then-hang"
    _server: asyncio.Server | None = None

    def requests_for(self, path_end: bytes) -> list[Seen]:
        return [s for s in self.seen if s.path.endswith(path_end)]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self.release.set()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                self._server.close_clients()  # type: ignore[attr-defined]
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            task.set_name("fault-upstream")
        self.connections += 1
        self.connected.set()
        connection = self.connections
        try:
            while True:
                try:
                    seen = await _read_request(reader, self._head_in)
                except asyncio.IncompleteReadError:
                    self.cut_mid_request += 1
                    return
                if seen is None:
                    return
                seen.connection = connection
                self.seen.append(seen)
                self.active += 1
                try:
                    keep = await self._answer(seen, reader, writer)
                finally:
                    self.active -= 1
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        except asyncio.CancelledError:  # the server is stopping
            return
        finally:
            writer.close()

    def _head_in(self) -> None:
        self.heads_in += 1

    async def _hold(self, reader: asyncio.StreamReader) -> None:
        """Until the peer closes the connection or the test releases (bounded)."""
        peer = asyncio.ensure_future(reader.read(1))
        released = asyncio.ensure_future(self.release.wait())
        done, pending = await asyncio.wait(
            {peer, released}, timeout=HOLD_S, return_when=asyncio.FIRST_COMPLETED
        )
        for task in pending:
            task.cancel()
        if peer in done and not peer.exception() and peer.result() == b"":
            self.cut_by_peer += 1

    def _fault_of(self, seen: Seen) -> str:
        if seen.is_summary:
            model = str(json.loads(seen.body).get("model", ""))
            return model if model.startswith("summarizer-") else "summary"
        return (seen.header(b"x-fault") or b"ok").decode()

    async def _answer(
        self, seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Write the reply the fault asks for; False when the connection must end."""
        fault = self._fault_of(seen)
        if fault == "ok" and seen.method == b"HEAD":  # the headers a GET gets, no body
            length = b"%d" % len(REPLY_BYTES)
            headers = [(b"content-type", b"application/json"), (b"content-length", length)]
            writer.write(_head(200, headers))
        elif fault == "ok":
            writer.write(_reply(200, [(b"content-type", b"application/json")], REPLY_BYTES))
        elif fault == "reject-upload":  # answered from the head alone, the body left unread
            body = json.dumps({"error": {"message": "too large", "type": "invalid"}}).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            writer.write(_reply(413, headers, body))
            await writer.drain()
            return False
        elif fault == "summary":
            body = json.dumps(SUMMARY).encode()
            writer.write(_reply(200, [(b"content-type", b"application/json")], body))
        elif fault == "summarizer-then-hang":  # the first call answered, every later one held
            self.summaries_answered += 1
            if self.summaries_answered > 1:
                await self._hold(reader)
                return False
            body = json.dumps(SUMMARY).encode()
            writer.write(_reply(200, [(b"content-type", b"application/json")], body))
        elif fault == "summarizer-gated":  # answered once the test opens the gate (bounded)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HOLD_S):
                    await self.gate.wait()
            body = json.dumps(SUMMARY).encode()
            writer.write(_reply(200, [(b"content-type", b"application/json")], body))
        elif fault in ODD_HEADERS:
            headers = [(b"content-type", b"application/json"), *ODD_HEADERS[fault]]
            writer.write(_reply(200, headers, REPLY_BYTES))
        elif fault == "rate-limited":
            body = json.dumps({"error": {"message": "slow down", "type": "rate_limit"}}).encode()
            headers = [(b"content-type", b"application/json"), (b"retry-after", b"7")]
            writer.write(_reply(429, headers, body))
        elif fault in ("server-error", "summarizer-fail"):
            body = json.dumps({"error": {"message": "upstream down", "type": "server"}}).encode()
            writer.write(_reply(503, [(b"content-type", b"application/json")], body))
        elif fault == "non-json":
            writer.write(_reply(200, [(b"content-type", b"text/html")], b"<html>oops</html>"))
        elif fault == "truncated":
            head = _head(200, [(b"content-type", b"application/json"), (b"content-length", b"100")])
            writer.write(head + REPLY_BYTES[:20])
            await writer.drain()
            return False
        elif fault in ("slow-first-byte", "summarizer-hang"):
            await self._hold(reader)
            return False
        elif fault == "stall-after-headers":
            length = str(len(REPLY_BYTES)).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", length)]
            writer.write(_head(200, headers))
            await writer.drain()
            self.headers_out += 1
            await self._hold(reader)
            return False
        elif fault in ("stall-mid-stream", "reset-mid-stream"):
            headers = [(b"content-type", b"text/event-stream"), (b"transfer-encoding", b"chunked")]
            writer.write(_head(200, headers) + chunk(b'data: {"choices":[]}\n\n'))
            await writer.drain()
            self.headers_out += 1
            if fault == "stall-mid-stream":
                await self._hold(reader)
            else:
                _reset(writer)
            return False
        elif fault in ("sse", "sse-gated", "sse-first-then-gated"):
            # "sse": the whole reply in one write; "sse-gated": the head, then the events
            # once the test opens the gate; "sse-first-then-gated": the first event with the
            # head, the rest once the gate opens.
            headers = [(b"content-type", b"text/event-stream"), (b"transfer-encoding", b"chunked")]
            events = [*SSE_EVENTS]
            if b'"include_usage":true' in seen.body.replace(b" ", b""):
                events.append(SSE_USAGE_EVENT)
            events.append(SSE_DONE)
            body = [chunk(event) for event in events] + [b"0\r\n\r\n"]
            split = {"sse": len(body), "sse-gated": 0, "sse-first-then-gated": 1}[fault]
            writer.write(_head(200, headers) + b"".join(body[:split]))
            if fault != "sse":
                await writer.drain()
                self.headers_out += 1
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(HOLD_S):
                        await self.gate.wait()
                writer.write(b"".join(body[split:]))
        elif fault == "drop":  # read the request, then close without a word
            return False
        else:
            raise AssertionError(f"unknown fault {fault!r}")
        await writer.drain()
        return True


async def _read_request(reader: asyncio.StreamReader, head_in: Callable[[], None]) -> Seen | None:
    """One request (None: the peer closed between requests); IncompleteReadError when it
    closes mid-body. `head_in` is called once the head has been read."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    head_in()
    lines = head[:-4].split(b"\r\n")
    method, target, _ = lines[0].split(b" ", 2)
    headers = [tuple(line.split(b":", 1)) for line in lines[1:]]
    pairs = [(k.strip(), v.strip()) for k, v in headers]  # type: ignore[misc]
    found = dict((k.lower(), v) for k, v in pairs)
    body = b""
    if found.get(b"x-fault") == b"reject-upload":
        pass
    elif b"content-length" in found:
        body = await reader.readexactly(int(found[b"content-length"]))
    elif found.get(b"transfer-encoding", b"").lower() == b"chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
            if size == 0:
                break
        body = b"".join(parts)
    return Seen(method, target, pairs, body)


def _head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    lines = [b"HTTP/1.1 %d X" % status, *(k + b": " + v for k, v in headers)]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _reply(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    return _head(status, [*headers, (b"content-length", b"%d" % len(body))]) + body


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset, as a crashed upstream does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@contextlib.asynccontextmanager
async def fault_upstream() -> AsyncIterator[FaultUpstream]:
    upstream = FaultUpstream()
    await upstream.start()
    try:
        yield upstream
    finally:
        await upstream.stop()


@contextlib.asynccontextmanager
async def serving(app: ASGIApp, *, access_log: bool = False) -> AsyncIterator[int]:
    """`app` under uvicorn on 127.0.0.1 in this event loop, lifespan and all (so the proxy
    runs on its served transport); yields the port."""
    # As `compaction-proxy serve` runs it: no uvicorn access line (the proxy writes its own),
    # unless asked (as plain `uvicorn proxy.app:create_app` runs it).
    # No log config of uvicorn's: its records reach the root logger, where tests capture them.
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, lifespan="on", access_log=access_log, log_config=None
    )
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="proxy-server")
    async with asyncio.timeout(WAIT_S):
        while not server.started:  # noqa: ASYNC110 - uvicorn offers no event for it
            await asyncio.sleep(0.005)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task
        sock.close()


@dataclass
class RawReply:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    complete: bool  # the body ended as its framing says (not cut off)

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)

    def json(self) -> Any:
        return json.loads(self.body)


async def raw_request(port: int, request: bytes, *, close_after: int | None = None) -> RawReply:
    """Send `request` as is on a fresh connection and read the reply until the proxy closes.

    `close_after`: hang up as soon as this many bytes of the reply arrived (0: right after
    sending) and return what was read.
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = b""
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(WAIT_S):
            while close_after is None or len(data) < close_after:
                try:
                    piece = await reader.read(65536)
                except ConnectionResetError:
                    break
                if not piece:
                    break
                data += piece
    finally:
        writer.close()
    return parse_reply(data)


async def read_one_reply(reader: asyncio.StreamReader) -> RawReply:
    """One reply framed by Content-Length off a connection that stays open."""
    head = await reader.readuntil(b"\r\n\r\n")
    reply = parse_reply(head)
    length = int(reply.header(b"content-length") or b"0")
    return parse_reply(head + await reader.readexactly(length))


def parse_reply(data: bytes) -> RawReply:
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        return RawReply(0, [], data, False)
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    headers = [
        (k.strip().lower(), v.strip()) for k, _, v in (ln.partition(b":") for ln in lines[1:])
    ]
    found = dict(headers)
    if found.get(b"transfer-encoding", b"").lower() == b"chunked":
        body, complete = _dechunk(rest)
    elif b"content-length" in found:
        size = int(found[b"content-length"])
        body, complete = rest[:size], len(rest) >= size
    else:
        body, complete = rest, True
    return RawReply(status, headers, body, complete)


def _dechunk(data: bytes) -> tuple[bytes, bool]:
    parts = []
    while True:
        line, sep, data = data.partition(b"\r\n")
        if not sep:
            return b"".join(parts), False
        size = int(line.split(b";")[0] or b"0", 16)
        if size == 0:
            return b"".join(parts), True
        if len(data) < size + 2:
            return b"".join(parts) + data[:size], False
        parts.append(data[:size])
        data = data[size + 2 :]


def http_request(
    method: str,
    target: bytes,
    *,
    headers: list[tuple[bytes, bytes]] = (),  # type: ignore[assignment]
    body: bytes | None = None,
    keep_alive: bool = False,
) -> bytes:
    """A request as raw bytes, `target` sent exactly as given; the connection closes after
    unless `keep_alive`."""
    lines = [method.encode() + b" " + target + b" HTTP/1.1", b"host: proxy.test"]
    lines += [k + b": " + v for k, v in headers]
    if body is not None:
        lines.append(b"content-length: %d" % len(body))
    if not keep_alive:
        lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")


def assert_envelope(reply: RawReply, status: int, code: str | None = None) -> dict[str, Any]:
    """The reply is OpenAI's error envelope with `status` (and `code`); returns the error."""
    assert reply.status == status, (reply.status, reply.body[:300])
    assert (reply.header(b"content-type") or b"").startswith(b"application/json"), reply.headers
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return dict(error)
