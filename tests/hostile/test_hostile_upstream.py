"""The served proxy against an upstream that writes exact bytes from raw sockets (plain and
TLS): what its client sees for each way a reply can be malformed, cut or smuggled.

A reply the proxy cannot vouch for is never relayed as complete: before its head goes out
the client gets a 502 in OpenAI's envelope, after it an aborted relay (a chunked body with
no last chunk, then the connection closed).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import trustme

from tests.conftest import until
from tests.fault_upstream import (
    RawReply,
    assert_envelope,
    http_request,
    parse_reply,
    raw_request,
)
from tests.hostile.raw_upstream import (
    WAIT_S,
    Conn,
    proxy_for,
    raw_upstream,
    tls_server_context,
    trust,
)

LOOPS = ("asyncio", "uvloop")  # the served proxy runs on uvloop

CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
STREAM = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
JSON_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
REPLY = b'{"id":"chatcmpl-1","object":"chat.completion","choices":[]}'
EVENT = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"
OK = JSON_HEAD + b"content-length: %d\r\n\r\n%s" % (len(REPLY), REPLY)


def chat(body: bytes = CHAT, headers: list[tuple[bytes, bytes]] | None = None) -> bytes:
    head = [(b"content-type", b"application/json"), (b"authorization", b"Bearer sk-test")]
    return http_request("POST", b"/v1/chat/completions", headers=head + (headers or []), body=body)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@pytest.fixture(params=["plain", "tls"])
def tls(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    """None (plain http), or the upstream's TLS context, its authority trusted by the proxy."""
    if request.param == "plain":
        return None
    authority = trustme.CA()
    monkeypatch.setenv("SSL_CERT_FILE", trust(authority, tmp_path))
    return tls_server_context(authority)


async def read_until(port: int, request: bytes, seen: bytes, then: threading.Event) -> RawReply:
    """Send `request`, read until `seen` is in the reply, set `then`, read to the close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = b""
    try:
        writer.write(request)
        async with asyncio.timeout(WAIT_S):
            while True:
                if seen in data:
                    then.set()
                try:
                    piece = await reader.read(65536)
                except ConnectionResetError:
                    break
                if not piece:
                    break
                data += piece
    finally:
        then.set()
        writer.close()
    return parse_reply(data)


# -- 1: replies cut by a reset, or over TLS closed without close_notify --------------------


@pytest.mark.parametrize("ending", ["reset", "no-close-notify", "clean close"])
async def test_a_reply_delimited_by_the_close_is_a_502_never_a_complete_reply(
    tls: object, ending: str
) -> None:
    """A body ended by the connection's close: a reset or (TLS) a close without close_notify
    cannot be told from its end by asyncio's transports, so none is relayed as complete."""

    def script(conn: Conn) -> None:
        conn.send(JSON_HEAD + b"connection: close\r\n\r\n" + b'{"id":"chatcmpl-1","obj')
        if ending == "reset":
            conn.reset()
        elif ending == "no-close-notify":
            conn.close_without_notify()
        else:
            conn.close()

    with raw_upstream(script, tls) as upstream:  # type: ignore[arg-type]
        async with proxy_for(upstream) as proxy:
            reply = await raw_request(proxy.port, chat())
            error = assert_envelope(reply, 502)
            if error["code"] == "upstream_invalid_reply":
                assert "Content-Length" in error["message"]
            else:  # the reset came before its head was read: a request with no reply
                assert (ending, error["code"]) == ("reset", "upstream_unreachable")
            await until(lambda: proxy.in_use() == 0)
    assert len(upstream.requests) == 1  # sent once


@pytest.mark.parametrize("ending", ["reset", "no-close-notify"])
async def test_a_stream_cut_after_its_head_is_an_aborted_relay(tls: object, ending: str) -> None:
    head_out = threading.Event()

    def script(conn: Conn) -> None:
        conn.send(SSE_HEAD + b"transfer-encoding: chunked\r\n\r\n" + chunk(EVENT))
        head_out.wait(WAIT_S)  # the client has the head and the first event
        conn.send(chunk(EVENT[:20]))
        if ending == "reset":
            conn.reset()
        else:
            conn.close_without_notify()

    with raw_upstream(script, tls) as upstream:  # type: ignore[arg-type]
        async with proxy_for(upstream) as proxy:
            reply = await read_until(proxy.port, chat(STREAM), EVENT, head_out)
            assert reply.status == 200
            assert reply.body.startswith(EVENT)
            assert not reply.complete  # no last chunk: the client can tell it was cut
            await until(lambda: proxy.in_use() == 0)


@pytest.mark.parametrize("streaming", [False, True], ids=["json", "sse"])
async def test_a_content_length_reply_cut_short_is_never_relayed_as_complete(
    tls: object, streaming: bool
) -> None:
    head_out = threading.Event()

    def script(conn: Conn) -> None:
        if streaming:
            conn.send(SSE_HEAD + b"content-length: 10000\r\n\r\n" + EVENT)
            head_out.wait(WAIT_S)
        else:
            conn.send(JSON_HEAD + b"content-length: 1000\r\n\r\n" + REPLY)
        conn.close()

    with raw_upstream(script, tls) as upstream:  # type: ignore[arg-type]
        async with proxy_for(upstream) as proxy:
            if streaming:
                reply = await read_until(proxy.port, chat(STREAM), EVENT, head_out)
                assert reply.status == 200 and reply.body.startswith(EVENT)
                assert not reply.complete
            else:  # read whole before answering: nothing of it went out
                reply = await raw_request(proxy.port, chat())
                assert_envelope(reply, 502, "upstream_broke_off")
            await until(lambda: proxy.in_use() == 0)


# -- 3: a keyed stream framed by Content-Length, its usage event taken out -----------------


async def test_a_keyed_stream_with_a_content_length_is_relayed_with_consistent_framing() -> None:
    usage = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1}}\n\n'
    body = EVENT + usage + DONE
    asked: list[bool] = []

    def script(conn: Conn) -> None:
        options = json.loads(conn.body).get("stream_options") or {}
        asked.append(options.get("include_usage") is True)
        conn.send(SSE_HEAD + b"content-length: %d\r\n\r\n%s" % (len(body), body))
        conn.next_request()

    key = {"id": "team", "key_sha256": hashlib.sha256(b"sk-t").hexdigest()}
    keyed = {"auth": {"keys": [key]}, "quota": {"backend": "memory"}}
    with raw_upstream(script) as upstream:
        async with proxy_for(upstream, **keyed) as proxy:
            headers = [
                (b"content-type", b"application/json"),
                (b"authorization", b"Bearer sk-t"),
            ]
            request = http_request("POST", b"/v1/chat/completions", headers=headers, body=STREAM)
            reply = await raw_request(proxy.port, request)
    assert asked == [True]  # the proxy asked for the usage event, to count the stream
    assert reply.status == 200 and reply.complete
    assert reply.body == EVENT + DONE  # ... and took it out again, as the client did not ask
    length = reply.header(b"content-length")
    assert length is None or int(length) == len(reply.body)  # never the upstream's 611 for 455


# -- 5: chunked trailers -------------------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True], ids=["json", "sse"])
async def test_chunked_trailers_never_become_reply_headers(tls: object, streaming: bool) -> None:
    payload = EVENT + DONE if streaming else REPLY
    trailers = b"set-cookie: session=other-tenant\r\nx-ratelimit-remaining-requests: 0\r\n"

    def script(conn: Conn) -> None:
        head = SSE_HEAD if streaming else JSON_HEAD
        conn.send(head + b"transfer-encoding: chunked\r\ntrailer: set-cookie\r\n\r\n")
        conn.send(chunk(payload) + b"0\r\n" + trailers + b"\r\n")
        conn.next_request()

    with raw_upstream(script, tls) as upstream:  # type: ignore[arg-type]
        async with proxy_for(upstream) as proxy:
            reply = await raw_request(proxy.port, chat(STREAM if streaming else CHAT))
    assert reply.status == 200 and reply.complete
    assert reply.body == payload
    names = {name for name, _ in reply.headers}
    assert not names & {b"set-cookie", b"x-ratelimit-remaining-requests", b"trailer"}


# -- 6, 7: statuses and transfer codings the proxy does not relay --------------------------


@pytest.mark.parametrize("status", [b"600", b"999", b"101"])
async def test_a_status_outside_200_599_is_a_502_and_logged_as_one(
    status: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)

    def script(conn: Conn) -> None:
        conn.send(b"HTTP/1.1 " + status + b" Odd\r\ncontent-length: 2\r\n\r\n{}")
        conn.next_request()

    with raw_upstream(script) as upstream:
        async with proxy_for(upstream) as proxy:
            reply = await raw_request(proxy.port, chat())
            error = assert_envelope(reply, 502, "upstream_invalid_reply")
            assert status.decode() in error["message"]
            await until(lambda: proxy.in_use() == 0)
    lines = [r.getMessage() for r in caplog.records if "/v1/chat/completions" in r.getMessage()]
    assert any("502" in line for line in lines), lines
    assert not any(status.decode() in line.split() for line in lines), lines


@pytest.mark.parametrize(
    "framing",
    [b"transfer-encoding: gzip\r\nconnection: close", b"transfer-encoding: gzip, chunked"],
    ids=["gzip", "gzip-chunked"],
)
async def test_a_transfer_coding_other_than_chunked_is_a_502(tls: object, framing: bytes) -> None:
    def script(conn: Conn) -> None:
        body = b"\x1f\x8b\x08\x00" + b"\x00" * 12  # (a gzip stream's first bytes)
        if b"chunked" in framing:
            body = chunk(body) + b"0\r\n\r\n"
        conn.send(JSON_HEAD + framing + b"\r\n\r\n" + body)
        conn.close()

    with raw_upstream(script, tls) as upstream:  # type: ignore[arg-type]
        async with proxy_for(upstream) as proxy:
            reply = await raw_request(proxy.port, chat())
            error = assert_envelope(reply, 502, "upstream_invalid_reply")
            assert "gzip" in error["message"]
            await until(lambda: proxy.in_use() == 0)


# -- 8: idle connections ---------------------------------------------------------------------


async def test_an_idle_connection_is_closed_at_its_expiry_without_waiting_for_a_request(
    tls: object,
) -> None:
    expiry = 0.5
    closed_at: list[float | None] = []
    answered_at: list[float] = []

    def script(conn: Conn) -> None:
        conn.send(OK)
        answered_at.append(time.monotonic())
        closed_at.append(conn.wait_closed())  # bytes instead (a request) would be None

    with raw_upstream(script, tls) as upstream:  # type: ignore[arg-type]
        async with proxy_for(upstream, upstream={"keepalive_expiry_s": expiry}) as proxy:
            reply = await raw_request(proxy.port, chat())
            assert (reply.status, reply.body) == (200, REPLY)
            await until(lambda: bool(closed_at))
    assert closed_at[0] is not None
    idle = closed_at[0] - answered_at[0]
    # aiohttp's clean-up runs every `expiry`: closed between one and two expiries idle.
    assert expiry * 0.9 <= idle <= 2 * expiry + 1.0, idle
    assert len(upstream.requests) == 1


# -- 10: a late body after a HEAD reply ------------------------------------------------------


async def test_a_late_body_after_a_head_reply_never_becomes_another_requests_reply(
    tls: object,
) -> None:
    forged = b'{"forged":"another tenant reads this"}'
    late = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(forged), forged)
    head_relayed = threading.Event()

    def script(conn: Conn) -> None:
        while True:
            if conn.method == b"HEAD":  # announces a body it must not send, then sends one
                conn.send(JSON_HEAD + b"content-length: %d\r\n\r\n" % len(late))
                head_relayed.wait(WAIT_S)
                conn.send(late)
            else:
                conn.send(OK)
            if not conn.next_request():
                return

    with raw_upstream(script, tls) as upstream:  # type: ignore[arg-type]
        async with proxy_for(upstream) as proxy:
            for _ in range(3):
                head_relayed.clear()
                request = http_request("HEAD", b"/v1/files/f1", headers=[(b"x-a", b"1")])
                head = await raw_request(proxy.port, request)
                assert (head.status, head.body) == (200, b"")
                head_relayed.set()
                for _ in range(3):  # whatever connection the pool hands out next
                    reply = await raw_request(proxy.port, chat())
                    assert (reply.status, reply.body) == (200, REPLY)
            await until(lambda: proxy.in_use() == 0)


# -- cases that held: smuggling, slots, descriptors ------------------------------------------


@pytest.mark.parametrize(
    "framing",
    [
        b"content-length: 5\r\ntransfer-encoding: chunked",
        b"content-length: 5\r\ncontent-length: 40",
        b"transfer-encoding: chunked\r\ntransfer-encoding: identity",
        b"transfer-encoding: xchunked",
        b"content-length : 5",
    ],
    ids=["cl-te", "two-cl", "two-te", "odd-te", "space-before-colon"],
)
async def test_request_smuggling_shapes_are_refused_with_nothing_upstream(framing: bytes) -> None:
    smuggled = b"GET /v1/smuggled HTTP/1.1\r\nhost: x\r\n\r\n"
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\n"
        + framing
        + b"\r\n\r\n0\r\n\r\n"
        + smuggled
    )

    def script(conn: Conn) -> None:
        conn.send(OK)

    with raw_upstream(script) as upstream:
        async with proxy_for(upstream) as proxy:
            reply = await raw_request(proxy.port, request)
            assert 400 <= reply.status < 500, reply
            assert b"smuggled" not in reply.body
    assert upstream.requests == []


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _faulty(conn: Conn, which: int) -> None:
    """One of seven faulty replies, then the connection ends."""
    if which == 0:  # a stream reset mid-way
        conn.send(SSE_HEAD + b"transfer-encoding: chunked\r\n\r\n" + chunk(EVENT))
        conn.reset()
        return
    conn.send(
        [
            b"",  # no reply
            JSON_HEAD + b"content-length: 100\r\n\r\n{}",  # cut short
            # (Whole, so the pool may keep its connection: saying it closes avoids a race
            # with the next request, which would be lost with a 502, not resent.)
            b"HTTP/1.1 999 Odd\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}",
            JSON_HEAD + b"transfer-encoding: gzip\r\n\r\nxx",
            b"NOT HTTP AT ALL\r\n\r\n",
            JSON_HEAD + b"\r\n" + REPLY,  # delimited by the close
        ][which - 1]
    )
    if which % 2:
        conn.reset()
    else:
        conn.close()


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="counts /proc/self/fd (Linux)")
async def test_two_hundred_faulty_replies_leak_no_slot_and_no_descriptor() -> None:
    count = [0]

    def script(conn: Conn) -> None:
        while conn.target.endswith(b"/ok"):
            conn.send(OK)
            if not conn.next_request():
                return
        count[0] += 1
        _faulty(conn, count[0] % 7)

    with raw_upstream(script) as upstream:
        async with proxy_for(upstream) as proxy:
            ok = http_request("POST", b"/v1/ok", headers=[(b"x-a", b"1")], body=b"{}")
            assert (await raw_request(proxy.port, ok)).status == 200
            baseline = _open_fds()
            for _ in range(200):
                reply = await raw_request(proxy.port, chat(STREAM))
                assert reply.status in (200, 502, 504) and not (
                    reply.status == 200 and reply.complete
                )
            await until(lambda: proxy.in_use() == 0)
            replies = await asyncio.gather(*(raw_request(proxy.port, ok) for _ in range(8)))
            assert [r.status for r in replies] == [200] * 8  # 8 > the pool's 4 slots
            await until(lambda: proxy.in_use() == 0)
            # At most the pool's kept connections more (both their ends: all in this process).
            await until(lambda: _open_fds() <= baseline + 8)
    # Each sent at most once (one written on a connection the upstream had just reset is
    # lost with a 502, never sent again).
    ids = [head.split(b"x-request-id: ")[1].split(b"\r\n")[0] for _, head, _ in upstream.requests]
    assert len(ids) == len(set(ids)) and len(ids) <= 1 + 200 + 8
