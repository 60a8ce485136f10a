"""The passthrough routes through real sockets, driven by the SDK: what the SDK sends is what
the upstream gets (bodies and end-to-end headers), and what the upstream answers is what the
SDK reads."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from proxy.settings import Settings
from tests.integration.harness import (
    API_KEY,
    MODELS,
    WAIT_S,
    FakeUpstream,
    Recorded,
    SentRequests,
    embedding_vector,
    parse_multipart,
    proxy_settings,
)

pytestmark = pytest.mark.integration

# Per connection, or rewritten by whoever writes the next hop; everything else must cross.
NOT_RELAYED = {"host", "connection", "keep-alive", "transfer-encoding", "te", "upgrade"}

PAYLOAD = bytes(range(256)) * 64  # every byte value, CR/LF and NUL included (16 KiB)


def assert_headers_relayed(sdk_request: Any, got: Recorded) -> None:
    """Every end-to-end header the SDK sent arrives with the same value."""
    for name, value in sdk_request.headers.items():
        if name.lower() not in NOT_RELAYED:
            assert got.header(name) == value, name
    assert got.header("x-request-id") is not None


def test_models_list(sdk: openai.OpenAI, fake_upstream: FakeUpstream, sent: SentRequests) -> None:
    page = sdk.models.list()
    assert [model.id for model in page.data] == MODELS
    assert page.data[0].owned_by == "fake"
    [got] = fake_upstream.requests
    assert (got.method, got.path, got.body) == ("GET", "/v1/models", b"")
    assert got.header("authorization") == f"Bearer {API_KEY}"
    assert_headers_relayed(sent.last, got)


def test_embeddings(sdk: openai.OpenAI, fake_upstream: FakeUpstream, sent: SentRequests) -> None:
    reply = sdk.embeddings.create(model="text-embedding-3-small", input=["one", "two"])
    assert [item.embedding for item in reply.data] == [embedding_vector(0), embedding_vector(1)]
    [got] = fake_upstream.requests
    assert (got.method, got.path) == ("POST", "/v1/embeddings")
    assert got.body == sent.last.content
    assert got.json()["input"] == ["one", "two"]
    assert_headers_relayed(sent.last, got)


async def test_embeddings_async(
    async_sdk: openai.AsyncOpenAI, fake_upstream: FakeUpstream, sent: SentRequests
) -> None:
    reply = await async_sdk.embeddings.create(
        model="text-embedding-3-small", input="one", encoding_format="float"
    )
    assert reply.data[0].embedding == embedding_vector(0)
    assert fake_upstream.requests[0].body == sent.last.content


def check_upload(got: Recorded, sdk_request: Any) -> None:
    assert (got.method, got.path) == ("POST", "/v1/files")
    assert got.header("content-length") == str(len(got.body))
    assert got.header("content-type") == sdk_request.headers["content-type"]
    parts = parse_multipart(got.header("content-type") or "", got.body)
    assert parts["file"] == ("payload.bin", PAYLOAD)
    assert parts["purpose"] == (None, b"batch")
    assert_headers_relayed(sdk_request, got)


def test_file_upload(sdk: openai.OpenAI, fake_upstream: FakeUpstream, sent: SentRequests) -> None:
    uploaded = sdk.files.create(file=("payload.bin", PAYLOAD), purpose="batch")
    assert (uploaded.id, uploaded.bytes, uploaded.filename) == (
        "file-upstream1",
        len(PAYLOAD),
        "payload.bin",
    )
    [got] = fake_upstream.requests
    check_upload(got, sent.last)


def test_file_upload_larger_than_the_read_limit_is_streamed_through(
    start_proxy: Callable[[Settings], str],
    upstream_url: str,
    fake_upstream: FakeUpstream,
    sent: SentRequests,
) -> None:
    """Above server.max_body_bytes the proxy streams the upload instead of reading it."""
    settings = proxy_settings(upstream_url, server={"max_body_bytes": 1024})
    http_client = openai.DefaultHttpxClient(event_hooks={"request": [sent.hook]})
    with openai.OpenAI(
        base_url=start_proxy(settings),
        api_key=API_KEY,
        max_retries=0,
        timeout=WAIT_S,
        http_client=http_client,
    ) as client:
        uploaded = client.files.create(file=("payload.bin", PAYLOAD), purpose="batch")
    assert uploaded.bytes == len(PAYLOAD)
    [got] = fake_upstream.requests
    check_upload(got, sent.last)


def test_head_gets_the_headers_without_a_body(proxy_url: str, fake_upstream: FakeUpstream) -> None:
    auth = {"authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=WAIT_S) as client:
        for _ in range(3):
            head = client.head(f"{proxy_url}/models", headers=auth)
            assert (head.status_code, head.content) == (200, b"")
            assert head.headers["content-type"] == "application/json"
            listed = client.get(f"{proxy_url}/models", headers=auth)  # the proxy still serves
            assert [model["id"] for model in listed.json()["data"]] == MODELS
    assert [got.method for got in fake_upstream.requests] == ["HEAD", "GET"] * 3


def test_a_chunked_upload_is_streamed_through_as_sent(
    proxy_url: str, fake_upstream: FakeUpstream
) -> None:
    form = httpx.Request(
        "POST", proxy_url, files={"file": ("payload.bin", PAYLOAD)}, data={"purpose": "batch"}
    )
    body = form.read()

    def pieces() -> Iterator[bytes]:  # no length known: the client sends it chunked
        for start in range(0, len(body), 1000):
            yield body[start : start + 1000]

    headers = {"authorization": f"Bearer {API_KEY}", "content-type": form.headers["content-type"]}
    with httpx.Client(timeout=WAIT_S) as client:
        reply = client.post(f"{proxy_url}/files", content=pieces(), headers=headers)
    assert reply.status_code == 200, reply.text
    assert reply.json()["bytes"] == len(PAYLOAD)
    [got] = fake_upstream.requests
    assert got.header("transfer-encoding") == "chunked"
    assert got.body == body
    assert parse_multipart(got.header("content-type") or "", got.body)["file"] == (
        "payload.bin",
        PAYLOAD,
    )
