"""What a client sees when the upstream misbehaves at the HTTP level, compared with what it
would see talking to the upstream directly (the proxy claims to be transparent)."""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import pytest

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
