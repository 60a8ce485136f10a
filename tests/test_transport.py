"""The upstream client (proxy/transport.py: httpx's API over aiohttp) against a real local
server, and under respx."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import socket
import warnings
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import respx
import uvicorn

from proxy.app import create_app
from proxy.settings import Settings, UpstreamSettings
from proxy.transport import UpstreamTransport, create_upstream_client

LOOPS = ("asyncio", "uvloop")  # the served proxy runs on uvloop

Scope = dict[str, Any]
Receive = Any
Send = Any


@dataclass
class Upstream:
    """A real HTTP/1.1 server (uvicorn, in this event loop) whose handlers tests can steer."""

    url: str = ""
    release: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    received_headers: list[list[tuple[str, str]]] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"]]
        self.received_headers.append(headers)
        digest, size = hashlib.sha256(), 0
        while True:
            message = await receive()
            digest.update(message.get("body", b""))
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        if path == "/echo":
            body = json.dumps({"size": size, "sha256": digest.hexdigest(), "headers": headers})
            await self._send(send, 200, [(b"content-type", b"application/json")], body.encode())
        elif path == "/cookie":
            await self._send(send, 200, [(b"set-cookie", b"session=user-a; Path=/")], b"{}")
        elif path == "/stream":  # one chunk, then the next only once the test says so
            await self._start(send, [(b"content-type", b"text/event-stream")])
            await send({"type": "http.response.body", "body": b"data: one\n\n", "more_body": True})
            await self._wait_release_or_disconnect(receive)
            if not self.disconnected.is_set():
                await send({"type": "http.response.body", "body": b"data: two\n\n"})
        elif path == "/hang":  # never answers
            await self._wait_release_or_disconnect(receive)
        elif path == "/big":
            await self._start(send, [(b"content-length", b"%d" % (32 * 2**20))])
            for _ in range(32):
                await send({"type": "http.response.body", "body": b"x" * 2**20, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        else:
            await self._send(send, 404, [], b"")

    async def _start(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": headers})

    async def _send(self, send: Send, status: int, headers: list[Any], body: bytes) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _wait_release_or_disconnect(self, receive: Receive) -> None:
        async def disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()

        watcher = asyncio.create_task(disconnect())
        release = asyncio.create_task(self.release.wait())
        await asyncio.wait([watcher, release], return_when=asyncio.FIRST_COMPLETED)
        release.cancel()
        if not self.disconnected.is_set():
            watcher.cancel()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    async with serving() as app:
        yield app


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[Upstream]:
    app = Upstream()
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # listening before uvicorn runs: early connections wait in the backlog
    app.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    task = asyncio.create_task(server.serve(sockets=[sock]))
    yield app
    app.release.set()
    server.should_exit = True
    await task
    sock.close()


def client_for(url: str, **overrides: Any) -> httpx.AsyncClient:
    return create_upstream_client(UpstreamSettings(base_url=url, **overrides))


def respx_client_for(url: str) -> httpx.AsyncClient:
    """The client an app given httpx's own transport has (what respx's default mode patches)."""
    return create_upstream_client(UpstreamSettings(base_url=url), httpx.AsyncHTTPTransport())


@pytest.fixture
def free_port() -> Iterator[int]:
    """A port nothing listens on (connect is refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    yield port


def test_one_client_works_across_event_loops() -> None:
    client = client_for("http://127.0.0.1:1")

    async def roundtrip() -> int:
        async with serving() as upstream:
            reply = await client.post(f"{upstream.url}/echo", content=b"abc")
            return int(reply.json()["size"])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert asyncio.run(roundtrip()) == 3
        assert asyncio.run(roundtrip()) == 3  # a new loop: a new pool
        asyncio.run(client.aclose())
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


async def test_bytes_and_streamed_bodies_arrive_intact(upstream: Upstream) -> None:
    payload = bytes(range(256)) * (40 * 4096)  # 40 MiB
    async with client_for(upstream.url) as client:
        reply = await client.post(f"{upstream.url}/echo", content=payload)
        assert reply.json()["size"] == len(payload)
        assert reply.json()["sha256"] == hashlib.sha256(payload).hexdigest()

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(50):
                yield bytes([i]) * 10_000

        reply = await client.post(f"{upstream.url}/echo", content=chunks())
        expected = b"".join(bytes([i]) * 10_000 for i in range(50))
        assert reply.json()["sha256"] == hashlib.sha256(expected).hexdigest()
        headers = dict(reply.json()["headers"])
        assert headers["transfer-encoding"] == "chunked"


async def test_only_the_callers_headers_are_sent(upstream: Upstream) -> None:
    async with client_for(upstream.url) as client:
        request = client.build_request(
            "POST", f"{upstream.url}/echo", content=b"{}", headers={"x-trace": "abc"}
        )
        reply = await client.send(request)
    sent = [(k.lower(), v) for k, v in request.headers.multi_items()]
    received = [tuple(pair) for pair in reply.json()["headers"]]
    assert sorted(received) == sorted(sent)  # no User-Agent, Content-Type, ... of a client library


async def test_head_and_empty_bodies(upstream: Upstream) -> None:
    async with client_for(upstream.url) as client:
        head = await client.head(f"{upstream.url}/echo")
        empty = await client.post(f"{upstream.url}/echo")
    assert head.status_code == 200
    assert head.content == b""
    assert empty.json()["size"] == 0


async def test_upstream_cookies_are_not_replayed_to_the_next_request(upstream: Upstream) -> None:
    async with client_for(upstream.url) as client:
        first = await client.get(f"{upstream.url}/cookie")
        assert first.headers["set-cookie"].startswith("session=user-a")
        second = await client.post(f"{upstream.url}/echo", content=b"")
    assert "cookie" not in dict(second.json()["headers"])


async def test_streams_are_relayed_as_they_arrive(upstream: Upstream) -> None:
    async with client_for(upstream.url) as client:
        request = client.build_request("GET", f"{upstream.url}/stream")
        response = await client.send(request, stream=True)
        chunks = response.aiter_raw()
        async with asyncio.timeout(5):  # a buffering transport would wait for the end: hang
            assert await anext(chunks) == b"data: one\n\n"
        upstream.release.set()
        assert b"".join([c async for c in chunks]) == b"data: two\n\n"
        await response.aclose()


async def test_closing_a_response_early_drops_the_upstream_connection(upstream: Upstream) -> None:
    async with client_for(upstream.url) as client:
        request = client.build_request("GET", f"{upstream.url}/stream")
        response = await client.send(request, stream=True)
        assert await anext(response.aiter_raw()) == b"data: one\n\n"
        await response.aclose()
        async with asyncio.timeout(5):
            await upstream.disconnected.wait()


async def test_big_responses_stream_in_pieces(upstream: Upstream) -> None:
    async with (
        client_for(upstream.url) as client,
        client.stream("GET", f"{upstream.url}/big") as response,
    ):
        sizes = [len(chunk) async for chunk in response.aiter_raw()]
    assert sum(sizes) == 32 * 2**20
    assert max(sizes) <= 4 * 2**20  # never the whole body at once


async def test_connection_refused_is_connect_error(free_port: int) -> None:
    async with client_for(f"http://127.0.0.1:{free_port}") as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{free_port}/")


async def test_per_request_read_timeout_is_honoured(upstream: Upstream) -> None:
    async with client_for(upstream.url, timeout_s=600) as client:
        request = client.build_request(
            "GET", f"{upstream.url}/hang", timeout=httpx.Timeout(600, read=0.2)
        )
        async with asyncio.timeout(10):
            with pytest.raises(httpx.ReadTimeout):
                await client.send(request)


async def test_read_timeout_mid_stream_is_read_timeout(upstream: Upstream) -> None:
    async with client_for(upstream.url) as client:
        request = client.build_request(
            "GET", f"{upstream.url}/stream", timeout=httpx.Timeout(600, read=0.2)
        )
        response = await client.send(request, stream=True)
        chunks = response.aiter_raw()
        assert await anext(chunks) == b"data: one\n\n"
        async with asyncio.timeout(10):
            with pytest.raises(httpx.ReadTimeout):
                await anext(chunks)
        await response.aclose()


async def test_connect_timeout_is_connect_timeout() -> None:
    # A listener that never accepts, its accept queue filled: further SYNs go unanswered.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(8):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    try:
        async with client_for(f"http://127.0.0.1:{port}") as client:
            request = client.build_request(
                "GET", f"http://127.0.0.1:{port}/", timeout=httpx.Timeout(600, connect=0.3)
            )
            async with asyncio.timeout(10):
                with pytest.raises(httpx.ConnectTimeout):
                    await client.send(request)
    finally:
        for sock in [*fillers, listener]:
            sock.close()


async def test_pool_timeout_is_pool_timeout(upstream: Upstream) -> None:
    async with client_for(upstream.url, max_connections=1) as client:
        held = await client.send(client.build_request("GET", f"{upstream.url}/stream"), stream=True)
        request = client.build_request(
            "GET", f"{upstream.url}/echo", timeout=httpx.Timeout(600, pool=0.2)
        )
        with pytest.raises(httpx.PoolTimeout):
            await client.send(request)
        await held.aclose()  # frees the only connection: the next request goes through
        reply = await client.send(request)
        assert reply.status_code == 200


async def test_respx_default_mode_intercepts_with_no_setup() -> None:
    async with respx_client_for("http://upstream.test/v1") as client:
        with respx.mock(base_url="http://upstream.test/v1") as router:
            route = router.post("/chat/completions").respond(json={"ok": True})
            response = await client.send(
                client.build_request("POST", "http://upstream.test/v1/chat/completions", json={}),
                stream=True,
            )
            assert (await response.aread()) == b'{"ok":true}'
        assert route.call_count == 1


async def test_respx_fixture_intercepts(respx_mock: respx.MockRouter) -> None:
    route = respx_mock.get("http://upstream.test/v1/models").respond(json={"data": []})
    async with respx_client_for("http://upstream.test/v1") as client:
        reply = await client.get("http://upstream.test/v1/models")
    assert reply.json() == {"data": []}
    assert route.called


async def test_respx_using_httpx_intercepts() -> None:
    async with respx_client_for("http://upstream.test/v1") as client:
        with respx.mock(using="httpx") as router:
            route = router.get("http://upstream.test/v1/models").respond(status_code=418)
            reply = await client.get("http://upstream.test/v1/models")
    assert reply.status_code == 418
    assert route.called


async def test_a_patched_httpx_transport_sees_the_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What pytest-httpx and hand-written mocks do: patch httpx's own transport class.
    async def fake(self: httpx.AsyncHTTPTransport, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=f"mocked {request.url.path}")

    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", fake)
    async with respx_client_for("http://upstream.test/v1") as client:
        reply = await client.get("http://upstream.test/v1/models")
    assert reply.text == "mocked /v1/models"


async def test_respx_pass_through_reaches_the_real_upstream(upstream: Upstream) -> None:
    async with respx_client_for(upstream.url) as client:
        with respx.mock() as router:
            router.route(host="127.0.0.1").pass_through()
            reply = await client.post(f"{upstream.url}/echo", content=b"abc")
    assert reply.json()["size"] == 3


async def test_the_app_given_httpxs_transport_is_intercepted_by_respx() -> None:
    settings = Settings.model_validate({"upstream": {"base_url": "http://upstream.test/v1"}})
    app = create_app(settings, transport=httpx.AsyncHTTPTransport())
    reply_json = {"id": "x", "object": "list", "data": []}
    with respx.mock(base_url="http://upstream.test/v1") as router:
        route = router.get("/models").respond(json=reply_json)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://proxy.test"
        ) as proxy:
            reply = await proxy.get("/v1/models", headers={"authorization": "Bearer sk-test"})
    assert reply.status_code == 200
    assert reply.json() == reply_json
    assert route.called


@pytest.mark.parametrize("lifespan", [False, True], ids=["in-process", "served"])
async def test_the_apps_own_transport_is_the_same_in_process_and_served(
    upstream: Upstream, lifespan: bool
) -> None:
    """What tests see is what production runs: respx's default mode patches httpx's own
    transport, not the app's, whether or not the lifespan ran."""
    settings = Settings.model_validate({"upstream": {"base_url": upstream.url}})
    app = create_app(settings)
    with respx.mock(assert_all_called=False) as router:
        route = router.post(f"{upstream.url}/echo").respond(418)
        proxy = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p")
        async with contextlib.AsyncExitStack() as stack:
            if lifespan:  # what uvicorn runs at start
                await stack.enter_async_context(app.router.lifespan_context(app))
            await stack.enter_async_context(proxy)
            reply = await proxy.post("/v1/echo", content=b"abcd")
    await app.state.proxy.upstream.client.aclose()
    assert reply.status_code == 200
    assert reply.json()["size"] == 4  # the real upstream answered, not the mock
    assert not route.called


async def test_an_injected_transport_carries_every_upstream_request() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(200, json={"object": "list", "data": []})

    settings = Settings.model_validate({"upstream": {"base_url": "http://upstream.test/v1"}})
    app = create_app(settings, transport=httpx.MockTransport(handler))
    proxy = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p")
    async with app.router.lifespan_context(app), proxy:
        reply = await proxy.get("/v1/models")
    assert reply.json() == {"object": "list", "data": []}
    assert seen == ["/v1/models"]


async def test_respx_using_httpx_intercepts_the_apps_own_transport_too() -> None:
    # respx's httpx mode patches the client itself, so it sees every request whatever the
    # client's transport.
    settings = Settings.model_validate({"upstream": {"base_url": "http://upstream.test/v1"}})
    app = create_app(settings)
    with respx.mock(using="httpx", base_url="http://upstream.test/v1") as router:
        route = router.get("/models").respond(json={"object": "list", "data": []})
        router.route(host="p").pass_through()  # it patches every client: the test's own too
        proxy = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p")
        async with app.router.lifespan_context(app), proxy:
            reply = await proxy.get("/v1/models")
    assert reply.json() == {"object": "list", "data": []}
    assert route.called


def _routes(upstream: dict[str, object], *urls: str) -> list[str | None]:
    settings = Settings.model_validate({"upstream": upstream}).upstream
    transport = UpstreamTransport.for_settings(settings)
    return [transport.proxy_for(url) for url in urls]


def test_egress_proxies_are_mounted_as_httpx_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "egress.corp:3128")  # no scheme: http://, as httpx
    monkeypatch.setenv("NO_PROXY", ".internal.corp")
    urls = ("https://api.openai.com/v1", "https://llm.internal.corp/v1", "http://plain.test/v1")
    assert _routes({}, *urls) == ["http://egress.corp:3128", None, None]
    # The setting replaces the environment, NO_PROXY included; the switch turns it off.
    explicit = {"proxy_url": "http://u:pw@other:8080"}
    assert _routes(explicit, *urls) == ["http://***@other:8080"] * 3
    assert _routes({"proxy_from_env": False}, *urls) == [None, None, None]
    monkeypatch.setenv("NO_PROXY", "*")
    assert _routes({}, *urls) == [None, None, None]


@pytest.mark.parametrize(
    ("no_proxy", "url", "through"),
    [
        ("corp.test", "https://corp.test/v1", None),
        ("corp.test", "https://api.corp.test/v1", None),
        ("corp.test", "https://xcorp.test/v1", "http://egress:1"),
        (".corp.test", "https://api.corp.test/v1", None),
        (".corp.test", "https://corp.test/v1", "http://egress:1"),
        ("10.0.0.1", "http://10.0.0.1:8000/v1", None),
        ("10.0.0.1", "http://10.0.0.2:8000/v1", "http://egress:2"),
        ("::1", "http://[::1]:8000/v1", None),
        ("localhost", "http://localhost:8000/v1", None),
        ("http://internal.test", "http://internal.test/v1", None),
        ("http://internal.test", "https://internal.test/v1", "http://egress:1"),
        ("", "ftp://elsewhere.test/", "http://egress:3"),
        ("localhost:8080", "http://localhost:8080/v1", None),
        ("localhost:8080", "http://localhost:9090/v1", "http://egress:2"),
    ],
)
def test_egress_routes_follow_httpxs_reading_of_no_proxy(
    monkeypatch: pytest.MonkeyPatch, no_proxy: str, url: str, through: str | None
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://egress:1")
    monkeypatch.setenv("HTTP_PROXY", "http://egress:2")
    monkeypatch.setenv("ALL_PROXY", "http://egress:3")
    monkeypatch.setenv("NO_PROXY", no_proxy)
    assert _routes({}, url) == [through]


def test_a_bad_egress_proxy_in_the_environment_stops_the_start_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from proxy.cli import main

    monkeypatch.setenv("HTTPS_PROXY", "ftp://user:hunter2@egress.corp:21")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--upstream", "https://api.openai.com/v1", "--port", "9"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "hunter2" not in err
    assert "ftp://***@egress.corp:21" in err and "HTTPS_PROXY" in err
    assert "proxy_from_env" in err  # how to ignore the environment instead
    # Ignoring the environment, the same start goes on (here to the server, stubbed).
    assert _routes({"proxy_from_env": False}, "https://api.openai.com/v1") == [None]
