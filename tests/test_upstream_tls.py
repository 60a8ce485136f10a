"""The upstream client over TLS against a real TLS upstream on 127.0.0.1 (a certificate
authority made in the test by trustme, trusted through SSL_CERT_FILE as httpx's context reads
it): certificates and host names verified, SNI sent, ALPN http/1.1, keep-alive, timeouts, and
a refused certificate answered 502 with why."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import trustme

from proxy.app import create_app
from proxy.settings import Settings, UpstreamSettings
from proxy.transport import UpstreamTransport, create_upstream_client

LOOPS = ("asyncio", "uvloop")  # the served proxy runs on uvloop

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
STREAM = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"b\r\ndata: one\n\n\r\nb\r\ndata: two\n\n\r\n0\r\n\r\n"
)


@dataclass
class TlsUpstream:
    """Answers OK to each request (reading a Content-Length or chunked body); records the
    server name each handshake asked for and the protocol ALPN chose."""

    url: str = ""
    names: list[str | None] = field(default_factory=list)
    protocols: list[str | None] = field(default_factory=list)
    requests: list[bytes] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tls = writer.get_extra_info("ssl_object")
        self.protocols.append(tls.selected_alpn_protocol() if tls is not None else None)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.lower().split(b"\r\n")
                if b"transfer-encoding: chunked" in lines:
                    while size := int(await reader.readuntil(b"\r\n"), 16):
                        await reader.readexactly(size + 2)
                    await reader.readexactly(2)
                for line in lines:
                    if line.startswith(b"content-length:"):
                        await reader.readexactly(int(line[15:]))
                self.requests.append(head)
                if b"/hang" in head.split(b"\r\n")[0]:  # never answers
                    await reader.read()
                    break
                if b"/stream" in head.split(b"\r\n")[0]:
                    writer.write(STREAM)
                else:
                    writer.write(OK if not head.startswith(b"HEAD") else OK[:-2])
                await writer.drain()
        writer.close()


@pytest.fixture(scope="module")
def authority() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def trusted(authority: trustme.CA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test's authority is the one httpx's default context trusts (SSL_CERT_FILE)."""
    bundle = tmp_path / "ca.pem"
    authority.cert_pem.write_to_path(str(bundle))
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))


@contextlib.asynccontextmanager
async def tls_upstream(authority: trustme.CA, *names: str) -> AsyncIterator[TlsUpstream]:
    upstream = TlsUpstream()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert(*names).configure_cert(context)
    context.set_alpn_protocols(["http/1.1"])

    def sni(tls: ssl.SSLObject, name: str | None, _: ssl.SSLContext) -> None:
        upstream.names.append(name)

    context.sni_callback = sni  # type: ignore[assignment]
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0, ssl=context)
    upstream.url = f"https://localhost:{server.sockets[0].getsockname()[1]}"
    try:
        yield upstream
    finally:
        server.close()


def client_for(url: str, **settings: float) -> httpx.AsyncClient:
    return create_upstream_client(UpstreamSettings(base_url=url, **settings))  # type: ignore[arg-type]


def transport_and_client(
    url: str, **settings: float
) -> tuple[UpstreamTransport, httpx.AsyncClient]:
    upstream_settings = UpstreamSettings(base_url=url, **settings)  # type: ignore[arg-type]
    transport = UpstreamTransport.for_settings(upstream_settings)
    return transport, create_upstream_client(upstream_settings, transport)


async def test_https_requests_are_verified_with_sni_and_alpn_and_kept_alive(
    authority: trustme.CA, trusted: None
) -> None:
    async def upload() -> AsyncIterator[bytes]:
        yield b"piece one "
        yield b"piece two"

    async with tls_upstream(authority, "localhost") as upstream:
        url = upstream.url
        transport, client = transport_and_client(url)
        async with client:
            assert (await client.post(f"{url}/v1/chat", content=b"{}")).content == b"{}"
            assert (await client.post(f"{url}/v1/files", content=upload())).content == b"{}"
            head = await client.head(f"{url}/v1/files/f1")
            assert (head.status_code, head.content) == (200, b"")
            assert (await client.get(f"{url}/v1/models")).content == b"{}"
            assert transport.slots.in_use == 0
    assert len(upstream.requests) == 4
    assert upstream.names == ["localhost"] * 2  # one connection kept alive, one for HEAD; SNI
    assert upstream.protocols == ["http/1.1"] * 2


@pytest.mark.parametrize(
    ("names", "trust", "why"),
    [
        (("other.test",), True, "Hostname mismatch"),
        (("localhost",), False, "certificate"),
    ],
    ids=["wrong-hostname", "untrusted"],
)
async def test_a_refused_certificate_is_a_502_saying_why(
    authority: trustme.CA,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    names: tuple[str, ...],
    trust: bool,
    why: str,
) -> None:
    if trust:
        bundle = tmp_path / "ca.pem"
        authority.cert_pem.write_to_path(str(bundle))
        monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    async with tls_upstream(authority, *names) as upstream:
        async with client_for(upstream.url) as client:
            with pytest.raises(httpx.ConnectError, match=why):
                await client.post(f"{upstream.url}/v1/chat", content=b"{}")
        settings = Settings.model_validate({"upstream": {"base_url": f"{upstream.url}/v1"}})
        app = create_app(settings)
        proxy = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p")
        async with app.router.lifespan_context(app), proxy:
            reply = await proxy.get("/v1/models")
        assert upstream.requests == []
    assert reply.status_code == 502
    error = reply.json()["error"]
    assert error["code"] == "upstream_unreachable"
    assert "TLS certificate" in error["message"] and why in error["message"]


async def test_streams_and_timeouts_over_tls(authority: trustme.CA, trusted: None) -> None:
    async with tls_upstream(authority, "localhost") as upstream:
        transport, client = transport_and_client(upstream.url, timeout_s=0.3)
        async with client:
            async with client.stream("POST", f"{upstream.url}/stream", content=b"{}") as reply:
                body = b"".join([chunk async for chunk in reply.aiter_raw()])
            assert body == b"data: one\n\ndata: two\n\n"
            with pytest.raises(httpx.ReadTimeout):
                await client.post(f"{upstream.url}/hang", content=b"{}")
            assert transport.slots.in_use == 0
