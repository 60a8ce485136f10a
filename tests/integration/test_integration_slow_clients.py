"""Slow and departing clients on raw sockets, against uvicorn configured as `serve` does it:
header and body read timeouts (408 in the envelope), the connection limit (503 on accept),
and a client leaving mid-upload (one INFO line, no traceback)."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from proxy.app import create_app
from proxy.connections import server_options
from tests.integration.conftest import PROXY_UVICORN
from tests.integration.harness import WAIT_S, FakeUpstream, ServerThread, proxy_settings

pytestmark = pytest.mark.integration

CHAT = b'{"model":"echo","messages":[{"role":"user","content":"hi"}]}'


@pytest.fixture
def serve(upstream_url: str) -> Iterator[Callable[..., ServerThread]]:
    """A proxy with these server settings, uvicorn options from `server_options` as in serve."""
    servers: list[ServerThread] = []

    def start(**server: Any) -> ServerThread:
        settings = proxy_settings(upstream_url, server=server)
        options = {**PROXY_UVICORN, **server_options(settings.server)}
        servers.append(ServerThread(create_app(settings), "slow-proxy", **options).start())
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def connect(server: ServerThread) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S * 2)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the proxy closes the connection (bounded by the socket timeout)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def envelope(raw: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, json.loads(body)


def post_head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n\r\n"
    ).encode()


def test_headers_that_stall_get_408_and_the_connection_closes(
    serve: Callable[..., ServerThread],
) -> None:
    server = serve(header_timeout_s=0.5)
    with connect(server) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\ncontent-le")
        status, headers, body = envelope(read_all(sock))
    assert status == 408
    assert headers["connection"] == "close"
    assert body["error"]["code"] == "request_timeout" and "headers" in body["error"]["message"]


def test_a_connection_that_sends_nothing_is_closed_silently(
    serve: Callable[..., ServerThread],
) -> None:
    server = serve(header_timeout_s=0.5)
    with connect(server) as sock:
        assert read_all(sock) == b""


# /v1/files over max_body_bytes: the upload is streamed to the upstream as it comes.
PATHS = [("/v1/chat/completions", {}), ("/v1/files", {}), ("/v1/files", {"max_body_bytes": 50})]


@pytest.mark.parametrize(("path", "server"), PATHS)
def test_a_lying_content_length_gets_408(
    serve: Callable[..., ServerThread], path: str, server: dict[str, Any]
) -> None:
    proxy = serve(body_timeout_s=0.5, **server)
    with connect(proxy) as sock:
        sock.sendall(post_head(path, len(CHAT) + 100) + CHAT)  # 100 bytes never come
        status, headers, body = envelope(read_all(sock))
    assert status == 408
    assert headers["connection"] == "close"
    assert body["error"]["code"] == "request_timeout" and "body" in body["error"]["message"]


def test_a_slow_but_steady_body_is_not_cut(
    serve: Callable[..., ServerThread], fake_upstream: FakeUpstream
) -> None:
    server = serve(body_timeout_s=5.0)
    with connect(server) as sock:
        sock.sendall(post_head("/v1/chat/completions", len(CHAT)))
        for i in range(0, len(CHAT), 16):
            sock.sendall(CHAT[i : i + 16])
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 200")


def test_over_the_connection_limit_a_client_gets_503_and_a_slot_frees_on_close(
    serve: Callable[..., ServerThread],
) -> None:
    server = serve(max_connections=3, header_timeout_s=60.0)
    held = [connect(server) for _ in range(3)]
    try:
        for sock in held:  # each is registered by the proxy before the next one connects
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: p\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        with connect(server) as extra:
            status, headers, body = envelope(read_all(extra))
        assert status == 503
        assert headers["retry-after"] == "1"
        assert body["error"]["code"] == "too_many_connections"
        assert body["error"]["type"] == "server_error"
    finally:
        held.pop().close()
        for sock in held:
            sock.close()
    deadline = time.monotonic() + WAIT_S
    while True:  # bounded: the freed slots are seen once the proxy notices the closes
        with connect(server) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: p\r\nconnection: close\r\n\r\n")
            answer = read_all(sock)
        if answer.startswith(b"HTTP/1.1 200") or time.monotonic() > deadline:
            break
    assert answer.startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize(("path", "server"), PATHS)
def test_a_client_leaving_mid_upload_is_one_info_line_without_traceback(
    serve: Callable[..., ServerThread],
    fake_upstream: FakeUpstream,
    caplog: pytest.LogCaptureFixture,
    path: str,
    server: dict[str, Any],
) -> None:
    proxy = serve(**server)
    caplog.set_level(logging.INFO)
    with connect(proxy) as sock:
        sock.sendall(post_head(path, 10_000) + CHAT)
    deadline = time.monotonic() + WAIT_S
    while not any("disconnected" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "the proxy never noticed the client leaving"
        time.sleep(0.01)
    # once more after the line: the app may still be unwinding
    with connect(proxy) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: p\r\nconnection: close\r\n\r\n")
        assert read_all(sock).startswith(b"HTTP/1.1 200")
    ours = [r for r in caplog.records if r.name.startswith(("proxy", "uvicorn"))]
    assert [r for r in ours if r.exc_info or r.levelno >= logging.WARNING] == []
    assert [r.levelno for r in ours if "disconnected" in r.getMessage()] == [logging.INFO]


def get_head(path: str, header_bytes: int, *, close: bool = True) -> bytes:
    """A GET whose head is exactly `header_bytes` long (one padding header fills it)."""
    start = f"GET {path} HTTP/1.1\r\nhost: p\r\n" + ("connection: close\r\n" if close else "")
    pad = header_bytes - len(start) - len("x-pad: \r\n\r\n")
    return f"{start}x-pad: {'a' * pad}\r\n\r\n".encode()


def test_a_head_over_max_header_bytes_gets_431_and_one_at_the_limit_is_served(
    serve: Callable[..., ServerThread],
) -> None:
    server = serve(max_header_bytes=4096)
    with connect(server) as sock:
        sock.sendall(get_head("/healthz", 4096))
        assert read_all(sock).startswith(b"HTTP/1.1 200")
    with connect(server) as sock:
        sock.sendall(get_head("/healthz", 4097))
        status, headers, body = envelope(read_all(sock))
    assert status == 431
    assert headers["connection"] == "close"
    assert body["error"]["code"] == "request_header_fields_too_large"
    assert "server.max_header_bytes = 4096" in body["error"]["message"]


def test_a_head_arriving_in_pieces_is_counted_across_them(
    serve: Callable[..., ServerThread],
) -> None:
    server = serve(max_header_bytes=4096)
    head = get_head("/healthz", 6000)
    with connect(server) as sock:
        for i in range(0, len(head), 1000):
            sock.sendall(head[i : i + 1000])
            if i + 1000 > 4096:  # refused once over: the rest may meet a closed socket
                break
        status, _, _ = envelope(read_all(sock))
    assert status == 431


def test_a_body_sent_with_its_head_is_not_counted_as_head(
    serve: Callable[..., ServerThread], fake_upstream: FakeUpstream
) -> None:
    """A small head and a body many times the limit, in one write: the body passes."""
    server = serve(max_header_bytes=1024)
    chat = CHAT[:-1] + b', "user": "' + b"u" * 200_000 + b'"}'
    with connect(server) as sock:
        sock.sendall(post_head("/v1/chat/completions", len(chat)) + chat)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")


def test_each_request_on_a_kept_alive_connection_has_the_whole_limit(
    serve: Callable[..., ServerThread],
) -> None:
    server = serve(max_header_bytes=2048)
    with connect(server) as sock:
        for _ in range(3):  # 6000 bytes of heads in all, each under the limit
            sock.sendall(get_head("/healthz", 2000, close=False))
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(get_head("/healthz", 3000))
        status, _, _ = envelope(read_all(sock))
    assert status == 431
