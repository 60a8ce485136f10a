"""Upstream requests behind an egress proxy: a forward proxy on 127.0.0.1 in front of the fake
upstream, the proxy app served by uvicorn (its own transport), HTTP_PROXY / NO_PROXY set in
the environment or `upstream.proxy_url` in the settings."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from proxy.settings import Settings
from tests.integration.harness import API_KEY, WAIT_S, FakeUpstream, closed_port, proxy_settings

pytestmark = pytest.mark.integration

PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
PASSWORD = "s3cr3t-egress-pw"
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class ForwardProxy:
    """An HTTP forward proxy: absolute-URI requests (`GET http://host:port/path HTTP/1.1`)
    relayed to their host, one request per connection; what it was asked is kept."""

    seen: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, URL, auth
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *lines = head.decode("latin-1").split("\r\n")
            method, target, version = request_line.split(" ")
            headers = [tuple(part.strip() for part in line.split(":", 1)) for line in lines if line]
            named = {name.lower(): value for name, value in headers}
            self.seen.append((method, target, named.get("proxy-authorization")))
            body = await reader.readexactly(int(named.get("content-length", "0")))
            url = httpx.URL(target)
            up_reader, up_writer = await asyncio.open_connection(url.host, url.port)
            kept = [
                f"{name}: {value}"
                for name, value in headers
                if not name.lower().startswith("proxy-") and name.lower() != "connection"
            ]
            path = url.raw_path.decode("ascii")
            out = "\r\n".join([f"{method} {path} {version}", *kept, "Connection: close", "", ""])
            up_writer.write(out.encode("latin-1") + body)
            await up_writer.drain()
            reply = await up_reader.read()  # the upstream closes after one reply
            up_writer.close()
            reply_head, _, reply_body = reply.partition(b"\r\n\r\n")
            status, *reply_lines = reply_head.split(b"\r\n")
            reply_lines = [h for h in reply_lines if not h.lower().startswith(b"connection:")]
            writer.write(b"\r\n".join([status, *reply_lines, b"Connection: close", b"", b""]))
            writer.write(reply_body)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()


@pytest.fixture
def forward_proxy() -> Iterator[ForwardProxy]:
    proxy = ForwardProxy()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="forward-proxy", daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(
        asyncio.start_server(proxy.handle, "127.0.0.1", 0), loop
    ).result(WAIT_S)
    proxy.port = server.sockets[0].getsockname()[1]
    try:
        yield proxy
    finally:
        server.close()
        asyncio.run_coroutine_threadsafe(server.wait_closed(), loop).result(WAIT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT_S)
        loop.close()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return monkeypatch


def client(base_url: str) -> httpx.Client:
    """The test's own client reaches the proxy app directly, whatever the environment says."""
    return httpx.Client(
        base_url=base_url,
        trust_env=False,
        timeout=WAIT_S,
        headers={"authorization": f"Bearer {API_KEY}"},
    )


def chat_and_list(base_url: str) -> None:
    with client(base_url) as http:
        reply = http.post("/chat/completions", json=CHAT)
        assert reply.status_code == 200, reply.text
        assert reply.json()["object"] == "chat.completion"
        models = http.get("/models")
        assert models.status_code == 200, models.text
        assert models.json()["object"] == "list"


def test_http_proxy_from_the_environment_carries_chat_and_passthrough(
    clean_env: pytest.MonkeyPatch,
    forward_proxy: ForwardProxy,
    fake_upstream: FakeUpstream,
    upstream_url: str,
    start_proxy: Callable[[Settings], str],
) -> None:
    clean_env.setenv("HTTP_PROXY", forward_proxy.url)
    chat_and_list(start_proxy(proxy_settings(upstream_url)))
    # Only the two requests: no start-up connection or rehearsal went through (or around) it.
    assert [(method, url) for method, url, _ in forward_proxy.seen] == [
        ("POST", f"{upstream_url}/chat/completions"),
        ("GET", f"{upstream_url}/models"),
    ]
    assert [(r.method, r.path) for r in fake_upstream.requests] == [
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
    ]
    assert fake_upstream.requests[0].header("authorization") == f"Bearer {API_KEY}"


def test_no_proxy_naming_the_upstream_host_goes_direct(
    clean_env: pytest.MonkeyPatch,
    forward_proxy: ForwardProxy,
    fake_upstream: FakeUpstream,
    upstream_url: str,
    start_proxy: Callable[[Settings], str],
) -> None:
    clean_env.setenv("HTTP_PROXY", forward_proxy.url)
    clean_env.setenv("NO_PROXY", "example.invalid,127.0.0.1")
    chat_and_list(start_proxy(proxy_settings(upstream_url)))
    assert forward_proxy.seen == []
    assert len(fake_upstream.requests) == 2


def test_proxy_from_env_off_ignores_the_environment(
    clean_env: pytest.MonkeyPatch,
    fake_upstream: FakeUpstream,
    upstream_url: str,
    start_proxy: Callable[[Settings], str],
) -> None:
    clean_env.setenv("HTTP_PROXY", f"http://127.0.0.1:{closed_port()}")
    settings = proxy_settings(upstream_url, upstream={"proxy_from_env": False})
    chat_and_list(start_proxy(settings))
    assert len(fake_upstream.requests) == 2


def test_proxy_url_setting_wins_over_the_environment_and_hides_its_password(
    clean_env: pytest.MonkeyPatch,
    forward_proxy: ForwardProxy,
    fake_upstream: FakeUpstream,
    upstream_url: str,
    start_proxy: Callable[[Settings], str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    clean_env.setenv("HTTP_PROXY", f"http://127.0.0.1:{closed_port()}")  # would refuse
    clean_env.setenv("NO_PROXY", "127.0.0.1")  # not read with proxy_url set
    proxy_url = f"http://egress:{PASSWORD}@127.0.0.1:{forward_proxy.port}"
    chat_and_list(start_proxy(proxy_settings(upstream_url, upstream={"proxy_url": proxy_url})))
    assert [method for method, _, _ in forward_proxy.seen] == ["POST", "GET"]
    assert {auth for _, _, auth in forward_proxy.seen} == {"Basic ZWdyZXNzOnMzY3IzdC1lZ3Jlc3MtcHc="}
    assert fake_upstream.requests[0].header("proxy-authorization") is None
    text = caplog.text
    assert f"through the proxy http://***@127.0.0.1:{forward_proxy.port}" in text
    assert PASSWORD not in text


def test_an_unreachable_proxy_fails_the_request_without_printing_its_password(
    clean_env: pytest.MonkeyPatch,
    fake_upstream: FakeUpstream,
    upstream_url: str,
    start_proxy: Callable[[Settings], str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    proxy_url = f"http://egress:{PASSWORD}@127.0.0.1:{closed_port()}"
    base_url = start_proxy(proxy_settings(upstream_url, upstream={"proxy_url": proxy_url}))
    with client(base_url) as http:
        reply = http.post("/chat/completions", json=CHAT)
        models = http.get("/models")
    assert reply.status_code >= 500 and models.status_code >= 500
    assert fake_upstream.requests == []
    for text in (reply.text, models.text, caplog.text):
        assert PASSWORD not in text


def test_the_summarizer_call_goes_through_the_proxy_too(
    clean_env: pytest.MonkeyPatch,
    forward_proxy: ForwardProxy,
    fake_upstream: FakeUpstream,
    upstream_url: str,
    start_proxy: Callable[[Settings], str],
) -> None:
    clean_env.setenv("HTTP_PROXY", forward_proxy.url)
    settings = proxy_settings(upstream_url, compaction={"budget_tokens": 1000})
    words = " ".join(f"word{i}" for i in range(150))
    history = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: {words}"}
        for i in range(30)
    ]
    with client(start_proxy(settings)) as http:
        reply = http.post("/chat/completions", json={**CHAT, "messages": history})
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-compaction-status"] == "compacted"
    posts = [url for method, url, _ in forward_proxy.seen if method == "POST"]
    assert len(posts) >= 2  # summarizer call(s), then the compacted request
    assert set(posts) == {f"{upstream_url}/chat/completions"}
    assert len(fake_upstream.requests) == len(forward_proxy.seen)
