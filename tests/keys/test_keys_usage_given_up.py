"""Usage of keyed requests given up after their quota charge was made (served: uvicorn on
127.0.0.1, raw sockets; memory and a real Redis).

A charge once made is settled as the ledger decides, whether or not the request still waits
for the verdict: Redis runs a charge it was sent, and the proxy still reads its answer. Usage
counts such a request too, as one that never reached the upstream (no tokens), so a key's
usage and its quota count the same requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from proxy.app import create_app
from tests.conftest import until
from tests.fault_upstream import FaultUpstream, fault_upstream, http_request, serving
from tests.keys.conftest import KEY_A, key_entry, keyed_settings

ADMIN = {"authorization": "Bearer admin-token"}
RPM = 50
NOW = 1_800_000_030.0  # a fixed clock for the quota and the meter: no minute turns mid-test
BODY = json.dumps(
    {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Weather in Lisbon?"}]}
).encode()
LEFT = "client disconnected before the upstream answered"


@pytest.fixture(autouse=True)
def admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADMIN_TOKEN", "admin-token")


class HoldingRelay:
    """A TCP relay in front of the shared Redis whose replies can be held back: with `hold`
    set, what Redis answers waits in the relay (`held` counts its bytes) until `release`."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.hold = False
        self.held = 0
        self._waiting: list[tuple[asyncio.StreamWriter, bytes]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    def release(self) -> None:
        self.hold = False
        waiting, self._waiting = self._waiting, []
        for writer, data in waiting:
            writer.write(data)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", 6379)

        async def to_redis() -> None:
            while data := await reader.read(65536):
                up_writer.write(data)

        async def to_client() -> None:
            while data := await up_reader.read(65536):
                if self.hold or self._waiting:
                    self._waiting.append((writer, data))
                    self.held += len(data)
                else:
                    writer.write(data)

        tasks = [asyncio.create_task(to_redis()), asyncio.create_task(to_client())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            writer.close()
            up_writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


class Served:
    def __init__(self, upstream: FaultUpstream, port: int, app: Any) -> None:
        self.upstream = upstream
        self.port = port
        self.app = app
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30)
        self.charges = 0  # charges asked of the quota
        self.verdicts = 0  # and answered to their request
        quotas = app.state.proxy.quotas
        charge = quotas.charge

        async def counted(*args: Any, **kwargs: Any) -> Any:  # the quota's own charge
            self.charges += 1
            verdict = await charge(*args, **kwargs)
            self.verdicts += 1
            return verdict

        quotas.charge = counted

    async def chat(self, fault: str = "ok") -> httpx.Response:
        headers = {"authorization": f"Bearer {KEY_A}", "x-fault": fault}
        return await self.http.post("/v1/chat/completions", content=BODY, headers=headers)

    async def open_chat(
        self,
        body: bytes = BODY,
        extra: list[tuple[bytes, bytes]] = (),  # type: ignore[assignment]
    ) -> asyncio.StreamWriter:
        """A keyed chat request on a raw connection, left open."""
        headers = [
            (b"authorization", b"Bearer " + KEY_A.encode()),
            (b"content-type", b"application/json"),
            *extra,
        ]
        request = http_request("POST", b"/v1/chat/completions", headers=headers, body=body)
        _, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(request)
        await writer.drain()
        return writer

    async def usage(self, requests: int, model: str = "gpt-4o-mini") -> dict[str, Any]:
        """The key's usage row once it counts `requests`, or as it is after 10 s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while True:
            await self.app.state.proxy.meter.join()
            reply = await self.http.get("/admin/usage", headers=ADMIN)
            rows = {row["model"]: row for row in reply.json()["data"]}
            row = rows.get(model, {"requests": 0})
            if row["requests"] >= requests or loop.time() > deadline:
                return dict(row)
            await asyncio.sleep(0.005)  # polls what the proxy records after it answered


@contextlib.asynccontextmanager
async def served(
    quota: dict[str, Any], compaction: dict[str, Any] | None = None, **upstream: Any
) -> AsyncIterator[Served]:
    async with fault_upstream() as faults:
        settings = keyed_settings(
            key_entry("team-a", KEY_A, requests_per_minute=RPM),
            upstream={"base_url": faults.url + "/v1", "timeout_s": 30, **upstream},
            admin={"token_env": "ADMIN_TOKEN"},
            quota=quota,
            compaction=compaction or {},
        )
        app = create_app(settings)
        state = app.state.proxy
        state.quotas.clock = state.meter.clock = lambda: NOW
        try:
            async with serving(app) as port:
                s = Served(faults, port, app)
                try:
                    yield s
                finally:
                    faults.release.set()
                    await s.http.aclose()
        finally:
            await state.upstream.client.aclose()


def charged(reply: httpx.Response) -> int:
    """Requests the key's quota has counted this minute, as a reply tells them."""
    return RPM - int(reply.headers["x-compaction-ratelimit-remaining-requests"])


def left(caplog: pytest.LogCaptureFixture) -> int:
    return sum(LEFT in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_request_given_up_while_waiting_for_a_connection_counts_in_quota_and_usage(
    backend: str, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Its quota counted it and it was let go upstream, where it waited for the one
    connection (busy); the client left meanwhile. Nothing says whether any byte of it was
    written, so usage has it as a request the upstream may bill: its prompt as counted,
    marked estimated, as for any request let go that got no reply."""
    caplog.set_level(logging.INFO, logger="proxy.exchange")
    quota = {"backend": backend, "key_prefix": redis_prefix, "socket_timeout_s": 10}
    async with served(quota, max_connections=1) as s:
        busy = asyncio.create_task(s.chat("slow-first-byte"))  # holds the only connection
        await until(lambda: len(s.upstream.seen) == 1)
        writer = await s.open_chat()
        await until(lambda: s.verdicts == 2)  # charged and let go: waiting for the connection
        writer.close()
        await until(lambda: left(caplog) == 1)
        s.upstream.release.set()
        assert (await busy).status_code == 502  # the upstream closed without a reply
        last = await s.chat()
        assert last.status_code == 200
        assert charged(last) == 3  # the request given up counted, on either backend
        row = await s.usage(3)
        assert row["requests"] == 3
        assert row["estimated_requests"] == 3  # none had the upstream's usage
        prompt = int(last.headers["x-compaction-tokens-after"])
        assert row["prompt_tokens_forwarded"] == 3 * prompt
        assert len(s.upstream.seen) == 2  # the one given up never reached it


async def test_a_request_given_up_while_its_redis_verdict_is_on_its_way_counts_in_usage(
    redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis ran the charge script (its reply is held in a relay) when the client left: the
    charge's own task goes on waiting, reads the verdict once it comes, and usage counts
    the request (no tokens: it never went upstream)."""
    caplog.set_level(logging.INFO, logger="proxy.exchange")
    relay = HoldingRelay()
    url = await relay.start()
    quota = {"backend": "redis", "redis_url": url, "key_prefix": redis_prefix}
    try:
        async with served({**quota, "socket_timeout_s": 10}) as s:
            assert (await s.chat()).status_code == 200
            relay.hold = True
            writer = await s.open_chat()
            await until(lambda: relay.held > 0)  # Redis has counted it
            writer.close()
            await until(lambda: left(caplog) == 1)
            relay.release()
            last = await s.chat()
            assert charged(last) == 3
            row = await s.usage(3)
            assert row["requests"] == 3
            assert row["estimated_requests"] == 2
            assert len(s.upstream.seen) == 2  # the one given up never went upstream
    finally:
        relay.close()


def history(model: str) -> bytes:
    """Old turns to summarize, one summarizer call each (see SUMMARIZED_ONE_BY_ONE)."""
    old = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "word " * 300}
        for i in range(4)
    ]
    now = [{"role": "user", "content": "next"}, {"role": "assistant", "content": "ok"}]
    return json.dumps(
        {"model": model, "messages": [*old, *now, {"role": "user", "content": "go"}]}
    ).encode()


# A summarizer context too small for two messages: each old message is a call of its own.
SUMMARIZED_ONE_BY_ONE = {
    "max_preserved_messages": 1,
    "summarizer": {"context_tokens": 1001, "timeout_s": 30, "retries": 0},
}
FORCE = [(b"x-compaction", b"force")]


def summary_calls(s: Served) -> int:
    return sum(seen.is_summary for seen in s.upstream.seen)


async def test_a_client_that_leaves_mid_compaction_is_billed_the_summaries_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first summarizer call answered (50 + 5 tokens, which the upstream bills), the
    second was in flight when the client left: usage has the first, and no request (the
    quota never charged one: the request never got that far)."""
    caplog.set_level(logging.INFO, logger="proxy.exchange")
    model = "summarizer-then-hang"
    async with served({"backend": "memory"}, SUMMARIZED_ONE_BY_ONE) as s:
        writer = await s.open_chat(history(model), FORCE)
        await until(lambda: summary_calls(s) == 2)
        writer.close()
        await until(lambda: left(caplog) == 1)
        row = await s.usage(0, model)
        assert (row["summarizer_prompt_tokens"], row["summarizer_completion_tokens"]) == (50, 5)
        assert row["requests"] == row["prompt_tokens_forwarded"] == 0
        assert row["cost_usd"] >= 0
        assert s.charges == 0
        assert summary_calls(s) == len(s.upstream.seen)  # nothing else went upstream


async def test_a_summary_shared_with_a_request_that_stayed_is_billed_to_the_one_that_asked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two requests need the same summary: the first asks for it, the second waits on the
    same call. The first leaves; the call goes on for the second and answers: the summary's
    tokens are the first's (the second reused it), once."""
    caplog.set_level(logging.INFO, logger="proxy.exchange")
    model = "summarizer-gated"
    body = history(model)
    compaction = {"max_preserved_messages": 1, "summarizer": {"timeout_s": 30, "retries": 0}}
    async with served({"backend": "memory"}, compaction) as s:
        first = await s.open_chat(body, FORCE)
        await until(lambda: summary_calls(s) == 1)
        headers = {"authorization": f"Bearer {KEY_A}", "x-compaction": "force"}
        second = asyncio.create_task(
            s.http.post("/v1/chat/completions", content=body, headers=headers)
        )
        flight = s.app.state.proxy.compactor.planner.flight.local
        await until(lambda: flight.waiting() == 2)
        first.close()
        await until(lambda: left(caplog) == 1)
        s.upstream.gate.set()
        reply = await second
        assert reply.status_code == 200
        assert reply.headers["x-compaction-status"] == "reused"  # made for the first
        row = await s.usage(1, model)
        assert row["requests"] == 1  # the second; the first never reached the quota
        assert (row["summarizer_prompt_tokens"], row["summarizer_completion_tokens"]) == (50, 5)
        assert summary_calls(s) == 1


@pytest.mark.parametrize("fault", ["stall-mid-stream", "reset-mid-stream"])
async def test_a_stream_cut_mid_body_is_one_request_in_usage_as_in_quota(fault: str) -> None:
    """The client leaves after the first event (stall), or the upstream resets the stream
    after it: the request went upstream, its quota counted it, and usage counts it once."""
    stream = json.dumps({**json.loads(BODY), "stream": True}).encode()
    async with served({"backend": "memory"}) as s:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        head = [(b"authorization", b"Bearer " + KEY_A.encode()), (b"x-fault", fault.encode())]
        writer.write(http_request("POST", b"/v1/chat/completions", headers=head, body=stream))
        async with asyncio.timeout(10):
            seen = b""
            while b"data: " not in seen:
                got = await reader.read(65536)
                assert got, seen
                seen += got
        writer.close()
        if fault == "stall-mid-stream":
            await until(lambda: s.upstream.cut_by_peer == 1)  # the proxy let go upstream too
        last = await s.chat()
        assert charged(last) == 2
        row = await s.usage(2)
        assert row["requests"] == 2
        assert row["estimated_requests"] == 2  # neither carried the upstream's usage
