"""Odd input on raw sockets: what the client gets, and the exact bytes that reach the upstream.

Paths are sent in the request line exactly as written here (no client library re-encodes
them); header values as the bytes given.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fault_rig import CHAT, CREDENTIALS, SECRETS, Rig, assert_no_secrets, rig
from tests.fault_upstream import REPLY_BYTES, RawReply, assert_envelope, http_request, raw_request


@pytest.fixture(autouse=True)
def no_secret_in_logs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.DEBUG)
    yield
    assert_no_secrets(caplog.get_records("setup") + caplog.get_records("call"))


def steady_rig(**compaction: Any) -> contextlib.AbstractAsyncContextManager[Rig]:
    """The rig with timeouts no test here waits for: nothing in this file tests one, and with
    the rig's sub-second ones a test process stalled that long between the proxy's request
    and the in-process upstream's reply (a busy machine, a full collection in a large run)
    turned an answer into a 504."""
    return rig(timeout_s=30.0, summarizer_timeout_s=30.0, **compaction)


async def send(
    r: Rig,
    method: str,
    target: bytes,
    headers: list[tuple[bytes, bytes]] | None = None,
    body: bytes | None = None,
) -> RawReply:
    request = http_request(method, target, headers=[*CREDENTIALS, *(headers or [])], body=body)
    return await raw_request(r.port, request)


KEPT = [
    b"/v1/models/meta-llama%2FLlama-3.1-8B",
    b"/v1/models/file%231",
    b"/v1/models/a%3Fb%3Dc",
    b"/v1/models/50%25off",
    b"/v1/files/file-abc/content",
    b"/v1/models/ft:gpt-4o:org:custom@v1",
    b"/v1/models/%e2%98%95",
]


@pytest.mark.parametrize("target", KEPT)
async def test_paths_reach_the_upstream_byte_for_byte(target: bytes) -> None:
    async with steady_rig() as r:
        reply = await send(r, "GET", target)
        assert (reply.status, reply.body) == (200, REPLY_BYTES)
        (seen,) = r.upstream.seen
        assert seen.target == target  # base path /v1 + the client's bytes after /v1/
        await r.settled()


async def test_the_query_string_is_forwarded_as_sent() -> None:
    async with steady_rig() as r:
        target = b"/v1/files?purpose=fine%20tune&after=a%26b&api-key=" + SECRETS[1]
        assert (await send(r, "GET", target)).status == 200
        assert r.upstream.seen[0].target == target


ESCAPES = [
    b"/v1/../admin",
    b"/v1/./models",
    b"/v1/%2e%2e/admin",
    b"/v1/%2E%2e/admin",
    b"/v1/.%2E/admin",
    b"/v1%2f..%2fadmin",
    b"/v1/..%2f..%2fetc/passwd",
    b"/v1/models/..%2F..%2F..%2Fadmin",
    b"/v1/a/%2e%2e%2f%2e%2e%2fadmin",
    b"/v1/%252e%252e/admin",
    b"/v1/..%5cadmin",
    b"/%76%31/models",
]


@pytest.mark.parametrize("target", ESCAPES)
@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_paths_that_could_leave_the_base_path_are_refused(method: str, target: bytes) -> None:
    async with steady_rig() as r:
        reply = await send(r, method, target, body=b"{}" if method == "POST" else None)
        assert_envelope(reply, 400, "invalid_path")
        assert r.upstream.seen == []  # nothing went upstream, with or without a key
        await r.settled()


@pytest.mark.parametrize("target", [b"/v1/x%00y", b"/v1/x%0d%0ay", b"/v1/x%0ay", b"/v1/a%7fb"])
async def test_control_characters_in_the_path_answer_400(target: bytes) -> None:
    async with steady_rig() as r:
        assert_envelope(await send(r, "GET", target), 400, "invalid_path")
        assert r.upstream.seen == []


@pytest.mark.parametrize(
    ("method", "target", "status"),
    [("TRACE", b"/v1/models", 405), ("PROPFIND", b"/healthz", 405), ("GET", b"/nowhere", 404)],
)
async def test_the_routers_own_answers_are_envelopes(
    method: str, target: bytes, status: int
) -> None:
    async with steady_rig() as r:
        assert_envelope(await send(r, method, target), status)


async def test_get_chat_completions_is_the_upstreams_to_answer() -> None:
    # OpenAI lists stored completions there; the proxy relays whatever the upstream says.
    async with steady_rig() as r:
        reply = await send(r, "GET", b"/v1/chat/completions?limit=2")
        assert (reply.status, reply.body) == (200, REPLY_BYTES)
        assert r.upstream.seen[0].target == b"/v1/chat/completions?limit=2"


@pytest.mark.parametrize("value", ["²".encode(), "٣".encode(), b"12abc", b"-5", b"0", b"\xb2"])
async def test_a_budget_header_that_is_not_a_plain_number_answers_400(value: bytes) -> None:
    async with steady_rig() as r:
        reply = await send(
            r, "POST", b"/v1/chat/completions", [(b"x-compaction-budget", value)], CHAT
        )
        error = assert_envelope(reply, 400, "invalid_header")
        assert error["param"] == "x-compaction-budget"
        assert r.upstream.seen == []


TITLES = ["Café ☕".encode(), b"plain"]


@pytest.mark.parametrize("title", TITLES)
@pytest.mark.parametrize(
    ("method", "target", "body"),
    [
        ("POST", b"/v1/chat/completions", CHAT),
        ("GET", b"/v1/models", None),
        ("POST", b"/v1/embeddings", b'{"input":"x"}'),
    ],
)
async def test_non_ascii_request_headers_cross_byte_for_byte(
    title: bytes, method: str, target: bytes, body: bytes | None
) -> None:
    async with steady_rig() as r:
        reply = await send(r, method, target, [(b"x-title", title)], body)
        assert (reply.status, reply.body) == (200, REPLY_BYTES)
        (seen,) = r.upstream.seen
        assert seen.header(b"x-title") == title
        assert seen.body == (body or b"")
        await r.settled()


@pytest.mark.parametrize(
    ("method", "target", "body"),
    [
        ("POST", b"/v1/chat/completions", CHAT),
        ("GET", b"/v1/models", None),
        ("POST", b"/v1/embeddings", b'{"input":"x"}'),
    ],
)
async def test_a_header_value_in_latin1_is_refused_rather_than_changed(
    method: str, target: bytes, body: bytes | None
) -> None:
    """The upstream client writes header text as UTF-8: a latin-1 (obs-text) value could
    only go up changed, so the request is refused, naming the header, and nothing is sent."""
    async with steady_rig() as r:
        reply = await send(r, method, target, [(b"x-title", "Café".encode("latin-1"))], body)
        error = assert_envelope(reply, 400, "invalid_header")
        assert "x-title" in error["message"] and "UTF-8" in error["message"]
        assert r.upstream.seen == []
        await r.settled()


async def test_non_ascii_billing_headers_reach_the_summarizer_too() -> None:
    body = json.dumps(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "old question " * 50},
                {"role": "assistant", "content": "old answer " * 50},
                {"role": "user", "content": "now"},
            ],
        }
    ).encode()
    project = "Équipe café".encode()
    async with steady_rig(max_preserved_messages=1) as r:
        reply = await send(
            r,
            "POST",
            b"/v1/chat/completions",
            [(b"x-compaction", b"force"), (b"openai-project", project)],
            body,
        )
        assert reply.status == 200
        assert reply.header(b"x-compaction-status") == b"compacted"
        summary, forwarded = r.upstream.seen
        assert summary.is_summary
        assert summary.header(b"openai-project") == forwarded.header(b"openai-project") == project
