"""Usage of keyed requests that got no reply (served: uvicorn on 127.0.0.1, raw sockets).

A request the proxy let go upstream is one request in the key's usage however it ends: the
client hanging up before the first byte (streamed or not), the upstream timing out (504) or
breaking off (502), or the body of a reply never arriving whole. The quota counted it when
its charge cleared, so usage and quota count the same requests. The prompt is recorded as we
counted it, marked estimated, when the upstream may have it; a request that never reached
the upstream (connection refused) records no tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import respx

from proxy.app import create_app
from tests.conftest import until
from tests.fault_upstream import FaultUpstream, fault_upstream, http_request, serving
from tests.keys.conftest import KEY_A, free_port, key_entry, keyed_settings

ADMIN = {"authorization": "Bearer admin-token"}
RPM = 50
NOW = 1_800_000_030.0  # a fixed clock for the quota and the meter: no minute turns mid-test
MESSAGES = [{"role": "user", "content": "Tell me about the weather in Lisbon in spring."}]


@pytest.fixture(autouse=True)
def admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADMIN_TOKEN", "admin-token")


class Served:
    def __init__(self, upstream: FaultUpstream, port: int, app: Any) -> None:
        self.upstream = upstream
        self.port = port
        self.app = app
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10)

    def body(self, *, stream: bool) -> bytes:
        return json.dumps({"model": "gpt-4o-mini", "messages": MESSAGES, "stream": stream}).encode()

    async def chat(self, fault: str, *, stream: bool = False) -> httpx.Response:
        headers = {"authorization": f"Bearer {KEY_A}", "x-fault": fault}
        return await self.http.post(
            "/v1/chat/completions", content=self.body(stream=stream), headers=headers
        )

    async def leave_once_upstream_has_it(self, fault: str, *, stream: bool) -> None:
        """Send a chat request, hang up once the upstream has read it (and, for a fault that
        sends headers first, once they went out), before any byte of the reply came back."""
        headers = [
            (b"authorization", b"Bearer " + KEY_A.encode()),
            (b"content-type", b"application/json"),
            (b"x-fault", fault.encode()),
        ]
        request = http_request(
            "POST", b"/v1/chat/completions", headers=headers, body=self.body(stream=stream)
        )
        seen, out = len(self.upstream.seen), self.upstream.headers_out
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(request)
        await writer.drain()
        await until(lambda: len(self.upstream.seen) > seen)
        if fault == "stall-after-headers":
            await until(lambda: self.upstream.headers_out > out)
        cut = self.upstream.cut_by_peer
        writer.close()
        await until(lambda: self.upstream.cut_by_peer > cut)  # the proxy let go upstream too
        assert await reader.read() == b""  # nothing of a reply reached the client

    async def usage(self, requests: int, model: str = "gpt-4o-mini") -> dict[str, Any]:
        """The key's usage row of `model` once it counts `requests` (recording follows the
        reply), or as it is after 10 s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while True:
            await self.app.state.proxy.meter.join()
            reply = await self.http.get("/admin/usage", headers=ADMIN)
            rows = {row["model"]: row for row in reply.json()["data"]}
            row = rows.get(model, {"requests": 0})
            if row["requests"] >= requests or loop.time() > deadline:
                assert set(rows) <= {model}
                return dict(row)
            await asyncio.sleep(0.005)  # polls what the proxy records after it answered


@contextlib.asynccontextmanager
async def served(base_url: str | None = None) -> AsyncIterator[Served]:
    async with fault_upstream() as upstream:
        settings = keyed_settings(
            key_entry("team-a", KEY_A, requests_per_minute=RPM),
            upstream={
                "base_url": base_url or upstream.url + "/v1",
                "timeout_s": 0.75,
                "connect_timeout_s": 5.0,
            },
            admin={"token_env": "ADMIN_TOKEN"},
        )
        app = create_app(settings)
        state = app.state.proxy
        state.quotas.clock = state.meter.clock = lambda: NOW
        try:
            async with serving(app) as port:
                s = Served(upstream, port, app)
                try:
                    yield s
                finally:
                    upstream.release.set()
                    await s.http.aclose()
        finally:
            await state.upstream.client.aclose()


def remaining_requests(reply: httpx.Response) -> int:
    return int(reply.headers["x-compaction-ratelimit-remaining-requests"])


async def test_requests_without_a_reply_are_in_usage_as_the_quota_counted_them() -> None:
    async with served() as s:
        ok = await s.chat("ok")  # its reply has no usage: our count, estimated
        assert ok.status_code == 200
        prompt = int(ok.headers["x-compaction-tokens-after"])
        assert prompt > 0
        await s.leave_once_upstream_has_it("slow-first-byte", stream=True)
        await s.leave_once_upstream_has_it("slow-first-byte", stream=False)
        await s.leave_once_upstream_has_it("stall-after-headers", stream=False)
        timed_out = await s.chat("slow-first-byte", stream=True)
        assert timed_out.status_code == 504
        stalled = await s.chat("stall-after-headers")
        assert stalled.status_code == 504
        dropped = await s.chat("drop")
        assert dropped.status_code == 502
        refused = await s.chat("server-error")  # the upstream's own error reply: no tokens
        assert refused.status_code == 503
        last = await s.chat("ok")
        charged = RPM - remaining_requests(last)
        assert charged == 9
        row = await s.usage(charged)
        assert row["requests"] == charged  # every request the quota counted, no more
        # Each that reached the upstream and got no usage back: the prompt as counted.
        assert row["estimated_requests"] == 8
        assert row["prompt_tokens_forwarded"] == 8 * prompt
        assert row["prompt_tokens_sent"] == 8 * prompt
        assert row["completion_tokens"] == 0
        assert row["cost_usd"] > 0


async def test_a_request_that_never_reached_the_upstream_records_no_tokens() -> None:
    closed = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: connection refused
    async with served(closed) as s:
        for stream in (False, True):
            reply = await s.chat("ok", stream=stream)
            assert reply.status_code == 502
            assert reply.json()["error"]["code"] == "upstream_unreachable"
        row = await s.usage(2)
        assert row["requests"] == 2  # the quota counted both: failed requests count too
        assert row["estimated_requests"] == 0
        assert row["prompt_tokens_forwarded"] == row["completion_tokens"] == 0
        assert row["cost_usd"] == 0
        assert s.upstream.seen == []


async def test_other_billed_routes_count_a_request_without_a_reply_too() -> None:
    async with served() as s:
        reply = await s.http.post(
            "/v1/embeddings",
            json={"model": "text-embedding-3-small", "input": "x"},
            headers={"authorization": f"Bearer {KEY_A}", "x-fault": "slow-first-byte"},
        )
        assert reply.status_code == 504
        row = await s.usage(1, "text-embedding-3-small")
        assert (row["requests"], row["estimated_requests"]) == (1, 1)
        assert row["prompt_tokens_forwarded"] == 0  # not counted on this route


async def test_a_request_the_quota_refused_is_not_in_usage(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    upstream.post("/chat/completions").respond(json={"id": "c", "choices": []})
    app = await make_app(keyed_settings(key_entry("team-a", KEY_A, requests_per_minute=1)))
    app.state.quotas.clock = app.state.meter.clock = lambda: NOW
    body = {"model": "gpt-4o-mini", "messages": MESSAGES}
    headers = {"authorization": f"Bearer {KEY_A}"}
    codes = [
        (await app.client.post("/v1/chat/completions", json=body, headers=headers)).status_code
        for _ in range(3)
    ]
    assert codes == [200, 429, 429]
    await app.state.meter.join()
    rows = await app.state.meter.ledger.usage(None, "2000-01-01", "2100-01-01")
    assert [row.counts.requests for row in rows] == [1]
