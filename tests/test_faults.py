"""A live proxy (uvicorn, 127.0.0.1) against an upstream that misbehaves in every way we know.

For each fault: what the client sees, and that afterwards every pool slot is free, the
upstream has no reply in progress and no proxy task is left. Each fault is repeated more
times than the pool has slots, so a slot leaked per faulted reply would turn the last ones
into pool timeouts. Every request carries credentials (headers, query string); the
module's log check asserts none of them reached any log record.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator

import pytest

from tests.conftest import until
from tests.fault_rig import (
    CHAT,
    CREDENTIALS,
    QUERY,
    SECRETS,
    SLOTS,
    TIMES,
    assert_no_secrets,
    rig,
    upload_request,
)
from tests.fault_upstream import (
    ODD_HEADERS,
    REPLY_BYTES,
    RawReply,
    assert_envelope,
    http_request,
    raw_request,
    read_one_reply,
)

LOOPS = ("asyncio", "uvloop")  # the served proxy runs on uvloop


@pytest.fixture(autouse=True)
def no_secret_in_logs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Every record at every level, from every logger (the log-capture check of the suite)."""
    caplog.set_level(logging.DEBUG)
    yield
    records = caplog.get_records("setup") + caplog.get_records("call")
    assert records  # the capture works (the proxy logs its faults)
    assert_no_secrets(records)


def _sse_started(reply: RawReply) -> None:
    assert reply.status == 200
    assert reply.header(b"content-type") == b"text/event-stream"
    assert reply.body.startswith(b'data: {"choices":[]}')
    assert not reply.complete  # cut off, not passed off as a finished stream


async def test_slow_first_byte_answers_504_and_aborts_the_upstream() -> None:
    async with rig() as r:
        for _ in range(TIMES):
            assert_envelope(await r.chat("slow-first-byte"), 504, "upstream_timeout")
        await r.settled()
        assert r.upstream.cut_by_peer == TIMES


async def test_a_body_that_stalls_after_the_headers_answers_504() -> None:
    async with rig() as r:
        for _ in range(TIMES):
            assert_envelope(await r.chat("stall-after-headers"), 504, "upstream_timeout")
        assert_envelope(await r.get(b"/v1/models", "stall-after-headers"), 504)
        await r.settled()
        assert r.upstream.cut_by_peer == TIMES + 1


async def test_a_stream_that_stalls_is_cut_off_for_the_client() -> None:
    async with rig() as r:
        for _ in range(TIMES):
            _sse_started(await r.chat("stall-mid-stream"))
        await r.settled()
        assert r.upstream.cut_by_peer == TIMES


async def test_a_stream_reset_by_the_upstream_is_cut_off_for_the_client() -> None:
    async with rig() as r:
        for _ in range(TIMES):
            _sse_started(await r.chat("reset-mid-stream"))
            _sse_started(await r.get(b"/v1/models" + QUERY, "reset-mid-stream"))
        await r.settled()


async def test_rate_limits_and_server_errors_are_relayed_as_sent() -> None:
    async with rig() as r:
        for _ in range(TIMES):
            limited = await r.chat("rate-limited")
            assert limited.status == 429
            assert limited.header(b"retry-after") == b"7"
            assert limited.json()["error"]["message"] == "slow down"
            down = await r.get(b"/v1/models", "server-error")
            assert down.status == 503
            assert down.json()["error"]["message"] == "upstream down"
        await r.settled()


async def test_non_json_and_truncated_bodies() -> None:
    async with rig() as r:
        for _ in range(TIMES):
            html = await r.chat("non-json")
            assert (html.status, html.body) == (200, b"<html>oops</html>")
            assert html.header(b"content-type") == b"text/html"
            assert_envelope(await r.chat("truncated"), 502, "upstream_broke_off")
        await r.settled()


@pytest.mark.parametrize("fault", sorted(ODD_HEADERS))
async def test_reply_headers_that_are_not_latin1_text_cross_byte_for_byte(fault: str) -> None:
    async with rig() as r:
        for _ in range(TIMES):
            for reply in (await r.chat(fault), await r.get(b"/v1/models", fault)):
                assert (reply.status, reply.body) == (200, REPLY_BYTES)
                for name, value in ODD_HEADERS[fault]:
                    assert reply.header(name) == value
        await r.settled()


@pytest.mark.parametrize("model", ["summarizer-hang", "summarizer-fail"])
async def test_a_summarizer_that_hangs_or_fails_still_forwards_the_request(model: str) -> None:
    body = json.dumps(
        {
            "model": model,
            "messages": [
                {"role": "user", "content": "old question " * 50},
                {"role": "assistant", "content": "old answer " * 50},
                {"role": "user", "content": "next"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "now"},
            ],
        }
    ).encode()
    async with rig(max_preserved_messages=1) as r:
        for _ in range(TIMES):
            reply = await r.chat("", body=body, extra=[(b"x-compaction", b"force")])
            assert (reply.status, reply.body) == (200, REPLY_BYTES)
            assert reply.header(b"x-compaction-status") == b"failed"
        await r.settled()
        summarizer_calls = [s for s in r.upstream.seen if s.is_summary]
        forwarded = [s for s in r.upstream.seen if not s.is_summary]
        assert [s.body for s in forwarded] == [body] * TIMES  # each went out as sent
        assert len(summarizer_calls) == TIMES
        assert all(s.header(b"authorization") == b"Bearer " + SECRETS[3] for s in summarizer_calls)
        if model == "summarizer-hang":
            assert r.upstream.cut_by_peer == len(summarizer_calls)


@pytest.mark.parametrize("fault", ["stall-after-headers", "stall-mid-stream"])
async def test_client_leaving_while_the_reply_body_is_pending_aborts_the_upstream(
    fault: str,
) -> None:
    # A long read timeout: only the client's leaving can end the upstream's hold in time.
    async with rig(timeout_s=60) as r:
        for route in (b"/v1/chat/completions", b"/v1/models"):
            sent, cut = r.upstream.headers_out, r.upstream.cut_by_peer
            method = "POST" if route.endswith(b"completions") else "GET"
            request = http_request(
                method,
                route,
                headers=[*CREDENTIALS, (b"x-fault", fault.encode())],
                body=CHAT if method == "POST" else None,
            )
            _, writer = await asyncio.open_connection("127.0.0.1", r.port)
            writer.write(request)
            await writer.drain()
            await until(lambda s=sent: r.upstream.headers_out == s + 1)  # type: ignore[misc]
            writer.close()
            await until(lambda c=cut: r.upstream.cut_by_peer == c + 1)  # type: ignore[misc]
        await r.settled()


async def test_a_get_is_sent_upstream_once_when_a_reused_connection_drops() -> None:
    async with rig() as r:
        assert (await r.get(b"/v1/models")).status == 200
        assert_envelope(await r.get(b"/v1/models", "drop"), 502, "upstream_unreachable")
        await r.settled()
        seen = r.upstream.requests_for(b"/models")
        assert [s.header(b"x-fault") for s in seen] == [None, b"drop"]
        assert seen[0].connection == seen[1].connection  # the pooled connection was reused


async def test_the_pool_serves_normally_after_every_fault() -> None:
    async with rig() as r:
        faults = ["slow-first-byte", "stall-after-headers", "truncated", "reset-mid-stream"]
        for fault in faults:
            await r.chat(fault)
        await r.settled()
        replies = await asyncio.gather(*(r.chat("ok") for _ in range(2 * SLOTS)))
        assert [reply.status for reply in replies] == [200] * 2 * SLOTS
        await r.settled()


async def test_the_clients_keep_alive_connection_survives_odd_reply_headers() -> None:
    async with rig() as r:
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
        try:
            for fault in ("utf8-headers", "latin1-headers", "ok"):
                head = [*CREDENTIALS, (b"x-fault", fault.encode())]
                request = http_request("GET", b"/v1/models", headers=head, keep_alive=True)
                writer.write(request)
                async with asyncio.timeout(10):
                    reply = await read_one_reply(reader)
                assert (reply.status, reply.body) == (200, REPLY_BYTES)
                assert reply.header(b"connection") != b"close"
        finally:
            writer.close()
        assert len(r.upstream.seen) == 3
        await r.settled()


async def test_head_requests_get_the_headers_and_no_body_each_on_a_connection_of_its_own() -> None:
    async with rig() as r:
        for _ in range(TIMES):
            reply = await r.get(b"/v1/models" + QUERY, method="HEAD")
            assert (reply.status, reply.body) == (200, b"")
            assert reply.header(b"content-type") == b"application/json"
        assert (await r.get(b"/v1/models", "slow-first-byte", method="HEAD")).status == 504
        assert (await r.get(b"/v1/models", "drop", method="HEAD")).status == 502
        await r.settled()
        heads = r.upstream.requests_for(b"/models")
        assert [s.method for s in heads] == [b"HEAD"] * (TIMES + 2)
        # Never pooled (bytes after a HEAD reply could be read as the next request's reply):
        # each on its own connection, which says so.
        assert len({s.connection for s in heads}) == TIMES + 2
        assert {s.header(b"connection") for s in heads} == {b"close"}


async def test_a_streamed_upload_reaches_the_upstream_whole_on_a_kept_connection() -> None:
    pieces = [bytes([i]) * 5000 for i in range(40)]
    async with rig() as r:
        for _ in range(TIMES):
            reply = await r.upload("", pieces)
            assert (reply.status, reply.body) == (200, REPLY_BYTES)
        await r.settled()
        uploads = r.upstream.requests_for(b"/files")
        assert [s.body for s in uploads] == [b"".join(pieces)] * TIMES
        assert {s.header(b"transfer-encoding") for s in uploads} == {b"chunked"}
        assert len({s.connection for s in uploads}) == 1


async def test_streamed_uploads_meet_upstream_faults_as_other_requests_do() -> None:
    async with rig() as r:
        for _ in range(TIMES):
            assert_envelope(await r.upload("slow-first-byte", [b"x"]), 504, "upstream_timeout")
            assert_envelope(await r.upload("truncated", [b"x"]), 502, "upstream_broke_off")
            assert_envelope(await r.upload("drop", [b"x"]), 502, "upstream_unreachable")
            limited = await r.upload("rate-limited", [b"x"])
            assert (limited.status, limited.header(b"retry-after")) == (429, b"7")
        await r.settled()


async def test_a_reply_before_the_upload_has_ended_is_relayed() -> None:
    async with rig() as r:
        for _ in range(TIMES):
            request = upload_request("reject-upload", [b"first"], end=False)  # never ends
            refused = await raw_request(r.port, request)
            assert refused.status == 413
            assert refused.json()["error"]["message"] == "too large"
        await r.settled()


async def test_a_client_leaving_mid_upload_aborts_the_upstream_request() -> None:
    async with rig() as r:
        for _ in range(TIMES):
            heads, cut = r.upstream.heads_in, r.upstream.cut_mid_request
            _, writer = await asyncio.open_connection("127.0.0.1", r.port)
            writer.write(upload_request("", [b"first piece"], end=False))
            await writer.drain()
            await until(lambda h=heads: r.upstream.heads_in == h + 1)  # type: ignore[misc]
            writer.close()
            await until(lambda c=cut: r.upstream.cut_mid_request == c + 1)  # type: ignore[misc]
        await r.settled()
        assert r.upstream.requests_for(b"/files") == []  # none reached the upstream whole
