"""What a client sees when the upstream misbehaves at the HTTP level, compared with what it
would see talking to the upstream directly (the proxy claims to be transparent)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import time

import httpx
import pytest

from proxy.settings import UpstreamSettings
from proxy.transport import create_upstream_client
from proxy.wire import WireStream
from tests.integration.harness import API_KEY, PIECES, WAIT_S, FakeUpstream

pytestmark = pytest.mark.integration

TRUNCATE = {"model": "truncate", "stream": True, "messages": [{"role": "user", "content": "x"}]}


def stream_until_failure(url: str) -> tuple[bytes, Exception | None]:
    """POST a streaming chat request; the body bytes received and the error that ended it."""
    received = b""
    with httpx.Client(timeout=WAIT_S) as client:
        try:
            with client.stream("POST", f"{url}/chat/completions", json=TRUNCATE) as response:
                assert response.status_code == 200
                for part in response.iter_raw():
                    received += part
        except httpx.TransportError as exc:
            return received, exc
    return received, None


def test_upstream_dying_mid_stream_directly(upstream_url: str, fake_upstream: FakeUpstream) -> None:
    """The baseline: without the proxy, the client gets piece 0 and then a protocol error."""
    received, error = stream_until_failure(upstream_url)
    assert f'"content": "{PIECES[0]}"'.encode() in received
    assert isinstance(error, httpx.RemoteProtocolError)


def test_upstream_dying_mid_stream_is_an_error_for_the_client(
    proxy_url: str, fake_upstream: FakeUpstream
) -> None:
    """Not a clean end: a truncated reply must not pass for a complete one."""
    _, error = stream_until_failure(proxy_url)
    assert isinstance(error, httpx.RemoteProtocolError)


async def test_transport_delivers_bytes_received_before_the_connection_broke(
    upstream_url: str, fake_upstream: FakeUpstream
) -> None:
    """Deterministic version of the race behind a broken-off stream losing its last chunks:
    read only once the break is known to the transport, with piece 0 still unread."""
    client = create_upstream_client(UpstreamSettings(base_url=upstream_url))
    async with client:
        request = client.build_request("POST", f"{upstream_url}/chat/completions", json=TRUNCATE)
        response = await client.send(request, stream=True)
        assert await fake_upstream.signal("crashed").wait_async(WAIT_S)
        stream = response.stream._stream  # type: ignore[attr-defined]  # (httpx wraps it)
        assert isinstance(stream, WireStream)  # plain http: proxy.wire carries it
        connection = stream._connection
        deadline = time.monotonic() + WAIT_S
        while not connection.closed:  # a bounded poll of the connection's own state
            assert time.monotonic() < deadline, "the transport never saw the connection break"
            await asyncio.sleep(0.005)
        assert connection.chunks  # piece 0 arrived before the break and is still unread
        received = b""
        with contextlib.suppress(httpx.RemoteProtocolError):
            async for part in response.aiter_raw():
                received += part
        await response.aclose()
    assert f'"content": "{PIECES[0]}"'.encode() in received


def test_client_without_accept_encoding_gets_an_uncompressed_reply(
    proxy_url: str, fake_upstream: FakeUpstream
) -> None:
    """The proxy adds no Accept-Encoding of its own, so the upstream does not compress."""
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
    command = [
        curl, "-sS", "--max-time", str(WAIT_S),
        "-H", "content-type: application/json", "-H", f"authorization: Bearer {API_KEY}",
        "-d", json.dumps(body), f"{proxy_url}/chat/completions",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, timeout=2 * WAIT_S)
    assert done.returncode == 0, done.stderr
    [got] = fake_upstream.requests
    assert (got.header("user-agent") or "").startswith("curl/")  # the client's own
    assert got.header("accept-encoding") is None
    assert got.header("accept") == "*/*"  # curl's, sent once
    assert [name for name, _ in got.headers].count("accept") == 1
    assert json.loads(done.stdout)["object"] == "chat.completion"
