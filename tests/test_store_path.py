"""The summary store in the request path (issue 5): reuse, extend, isolation, single flight."""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import respx
from starlette.applications import Starlette

from tests.agent_sim import TOOLS, agent_turns
from tests.conftest import make_settings, respx_app, until
from tests.upstream_fakes import FakeUpstream, summary_of

BUDGET = 2000


def settings_for(compaction: dict[str, Any] | None = None, **cache: Any) -> Any:
    """The summary store's tests: the summarizing strategy (by default masking comes first)."""
    compaction = {"budget_tokens": BUDGET, "strategy": "simple", **(compaction or {})}
    return make_settings(compaction=compaction, cache=cache)


async def open_client(app: Starlette) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p")


@pytest.fixture
def fake(upstream: respx.MockRouter) -> FakeUpstream:
    return FakeUpstream(numbered=True).install(upstream)


@pytest.fixture
async def memory_client() -> AsyncIterator[httpx.AsyncClient]:
    app = respx_app(settings_for(backend="memory"))
    async with await open_client(app) as client:
        yield client


async def send(
    client: httpx.AsyncClient, messages: list[dict[str, Any]], key: str = "sk-a"
) -> httpx.Response:
    response = await client.post(
        "/v1/chat/completions",
        json={"model": "gpt-4o-mini", "messages": messages, "tools": TOOLS},
        headers={"authorization": f"Bearer {key}"},
    )
    assert response.status_code == 200
    return response


async def test_agent_loop_pays_for_few_summaries_and_keeps_the_prefix_stable(
    memory_client: httpx.AsyncClient, fake: FakeUpstream
) -> None:
    statuses: list[str] = []
    for history in agent_turns(100):
        response = await send(memory_client, history)
        statuses.append(response.headers["x-compaction-status"])
        if statuses[-1] in ("compacted", "extended", "reused"):
            assert int(response.headers["x-compaction-tokens-after"]) <= BUDGET

    over = [s for s in statuses if s != "passthrough"]
    assert len(over) > 60, statuses
    assert "skipped" not in over and "failed" not in over
    assert len(fake.summary_calls) == statuses.count("compacted") + statuses.count("extended")
    assert len(fake.summary_calls) <= len(over) // 4, (len(fake.summary_calls), len(over))
    assert statuses.count("reused") >= len(over) * 3 // 4
    assert statuses.count("compacted") == 1  # every later summary extends a stored one

    # Between two summarizer calls, each forwarded request extends the previous one:
    # identical bytes through the summary, and the tail only grows.
    compacted_turns = [i for i, s in enumerate(statuses) if s != "passthrough"]
    forwarded = fake.forwarded
    stable_pairs = 0
    for a, b in itertools.pairwise(compacted_turns):
        if statuses[b] != "reused":
            continue
        first, second = forwarded[a]["messages"], forwarded[b]["messages"]
        assert summary_of(first) == summary_of(second)
        assert second[: len(first)] == first
        stable_pairs += 1
    assert stable_pairs >= len(over) * 3 // 4


async def test_reuse_reports_zero_summary_cost_and_cache_hit(
    memory_client: httpx.AsyncClient, fake: FakeUpstream
) -> None:
    history = agent_turns(40)[-1]
    first = await send(memory_client, history)
    assert first.headers["x-compaction-status"] == "compacted"
    assert first.headers["x-compaction-cache"] == "miss"
    again = await send(memory_client, history)
    assert again.headers["x-compaction-status"] == "reused"
    assert again.headers["x-compaction-cache"] == "hit"
    assert again.headers["x-compaction-summary-input-tokens"] == "0"
    assert again.headers["x-compaction-summary-output-tokens"] == "0"
    assert len(fake.summary_calls) == 1
    assert fake.forwarded_raw[0] == fake.forwarded_raw[1]  # identical bytes upstream


async def test_edited_history_misses_and_resummarizes(
    memory_client: httpx.AsyncClient, fake: FakeUpstream
) -> None:
    history = agent_turns(40)[-1]
    await send(memory_client, history)
    edited = [dict(m) for m in history]
    edited[3] = {**edited[3], "content": "an edited tool output"}
    response = await send(memory_client, edited)
    assert response.headers["x-compaction-status"] == "compacted"
    assert response.headers["x-compaction-cache"] == "miss"
    assert len(fake.summary_calls) == 2


async def test_credentials_never_share_summaries(
    memory_client: httpx.AsyncClient, fake: FakeUpstream
) -> None:
    history = agent_turns(40)[-1]
    await send(memory_client, history, key="sk-tenant-a")
    other = await send(memory_client, history, key="sk-tenant-b")
    assert other.headers["x-compaction-status"] == "compacted"
    assert other.headers["x-compaction-cache"] == "miss"
    assert len(fake.summary_calls) == 2


async def test_global_scope_shares_summaries(fake: FakeUpstream) -> None:
    app = respx_app(settings_for(backend="memory", scope="global"))
    async with await open_client(app) as client:
        history = agent_turns(40)[-1]
        await send(client, history, key="sk-tenant-a")
        other = await send(client, history, key="sk-tenant-b")
    assert other.headers["x-compaction-status"] == "reused"
    assert len(fake.summary_calls) == 1


@pytest.mark.parametrize("backend", ["none", "memory"])
async def test_concurrent_identical_requests_make_one_summary(
    upstream: respx.MockRouter, backend: str
) -> None:
    fake = FakeUpstream(gate=asyncio.Event()).install(upstream)
    app = respx_app(settings_for(backend=backend))
    flight = app.state.proxy.compactor.planner.flight.local
    history = agent_turns(40)[-1]
    async with await open_client(app) as client:
        tasks = [asyncio.create_task(send(client, history)) for _ in range(20)]
        await until(lambda: flight.waiting() == 20)  # every request joined the flight
        assert fake.gate is not None
        fake.gate.set()
        responses = await asyncio.gather(*tasks)
    assert len(fake.summary_calls) == 1
    statuses = sorted(r.headers["x-compaction-status"] for r in responses)
    assert statuses == ["compacted"] + ["reused"] * 19
    assert len({json.dumps(f["messages"]) for f in fake.forwarded}) == 1


async def test_disconnected_waiter_does_not_cancel_the_shared_summary(
    upstream: respx.MockRouter,
) -> None:
    fake = FakeUpstream(gate=asyncio.Event()).install(upstream)
    app = respx_app(settings_for(backend="memory"))
    flight = app.state.proxy.compactor.planner.flight.local
    history = agent_turns(40)[-1]
    async with await open_client(app) as client:
        leaving = asyncio.create_task(send(client, history))
        staying = asyncio.create_task(send(client, history))
        await until(lambda: flight.waiting() == 2)
        leaving.cancel()
        await until(lambda: flight.waiting() == 1)
        assert fake.gate is not None
        fake.gate.set()
        response = await staying
    # The call the leaving request started went on for the one still waiting.
    assert response.headers["x-compaction-status"] in ("compacted", "reused")
    assert len(fake.summary_calls) == 1
    summary = summary_of(fake.forwarded[-1]["messages"])
    assert summary is not None and fake.summary_text in summary["content"]


# -- Redis --------------------------------------------------------------------------------


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    import redis

    prefix = f"test-path-{secrets.token_hex(6)}:"
    yield prefix
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


async def test_two_instances_share_summaries_through_redis(
    fake: FakeUpstream, redis_prefix: str
) -> None:
    settings = settings_for(backend="redis", key_prefix=redis_prefix)
    history = agent_turns(40)[-1]
    first_app, second_app = respx_app(settings), respx_app(settings)
    async with await open_client(first_app) as first, await open_client(second_app) as second:
        made = await send(first, history)
        found = await send(second, history)
    assert made.headers["x-compaction-status"] == "compacted"
    assert found.headers["x-compaction-status"] == "reused"
    assert found.headers["x-compaction-cache"] == "hit"
    assert len(fake.summary_calls) == 1
    assert fake.forwarded_raw[0] == fake.forwarded_raw[1]
    await first_app.state.proxy.compactor.store.close()
    await second_app.state.proxy.compactor.store.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def private_redis() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A Redis of our own, so the test can stop it without touching the shared one."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = _free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    import redis

    probe = redis.Redis(port=port)
    for _ in range(200):  # bounded wait for the server to accept connections
        try:
            probe.ping()
            break
        except redis.ConnectionError:
            if process.poll() is not None:
                pytest.fail("redis-server exited at start")
            import time

            time.sleep(0.02)
    probe.close()
    yield f"redis://127.0.0.1:{port}/0", process
    process.kill()
    process.wait()


async def test_redis_outage_degrades_to_no_store(
    fake: FakeUpstream, private_redis: tuple[str, subprocess.Popen[bytes]]
) -> None:
    url, process = private_redis
    app = respx_app(settings_for(backend="redis", redis_url=url))
    sessions = agent_turns(40)
    async with await open_client(app) as client:
        made = await send(client, sessions[-2])
        assert made.headers["x-compaction-cache"] == "miss"
        process.kill()
        process.wait()
        after = await send(client, sessions[-1])
        metrics = (await client.get("/metrics")).text
    assert after.headers["x-compaction-status"] == "compacted"
    assert after.headers["x-compaction-cache"] == "none"
    assert len(fake.forwarded) == 2
    assert "compaction_proxy_store_errors_total" in metrics
    name = "compaction_proxy_store_errors_total"
    errors = [line for line in metrics.splitlines() if line.startswith(name)]
    assert float(errors[0].split()[-1]) >= 1


async def test_long_tool_loop_after_one_user_message_still_compacts(fake: FakeUpstream) -> None:
    """Coding agents run dozens of tool calls per user message. The cut cannot stop at that
    message, so it is carried verbatim right after the summary instead (with the task
    protection off: otherwise that first message goes before the summary)."""
    app = respx_app(settings_for({"protect_task": False}, backend="memory"))
    memory_client = await open_client(app)
    sessions = agent_turns(60, user_every=1000)  # one user message, then only tool calls
    ask = sessions[-1][1]
    assert ask["role"] == "user"
    statuses = []
    for history in sessions:
        response = await send(memory_client, history)
        status = response.headers["x-compaction-status"]
        statuses.append(status)
        if status == "passthrough":
            continue
        assert status in ("compacted", "extended", "reused"), response.headers
        assert int(response.headers["x-compaction-tokens-after"]) <= BUDGET
        sent = fake.forwarded[-1]["messages"]
        assert sent[0] == history[0]  # pinned system prompt
        assert summary_of([sent[1]]) is not None
        assert sent[2] == ask  # the latest ask, verbatim, right after the summary
        assert sent[3]["role"] == "assistant"  # the tail starts at a tool call, not a result
        calls = {c["id"] for m in sent if m.get("tool_calls") for c in m["tool_calls"]}
        results = {m["tool_call_id"] for m in sent if m["role"] == "tool"}
        assert results <= calls and calls <= results
    await memory_client.aclose()
    assert statuses.count("reused") > len(fake.summary_calls)


async def test_a_client_that_re_serialises_its_history_misses_once_and_is_served(
    memory_client: httpx.AsyncClient, fake: FakeUpstream
) -> None:
    """Keys hash the client's own bytes of each message: other bytes for the same messages
    (key order, spacing, escapes) cost a store miss, never a wrong or broken request."""
    history = agent_turns(40)[-1]
    await send(memory_client, history)  # compact JSON, as httpx writes it
    reordered = [dict(reversed(list(m.items()))) for m in history]
    body = {"model": "gpt-4o-mini", "messages": reordered, "tools": TOOLS}
    for expected in ("compacted", "reused"):
        response = await memory_client.post(
            "/v1/chat/completions",
            content=json.dumps(body, indent=1, ensure_ascii=True),
            headers={"authorization": "Bearer sk-a", "content-type": "application/json"},
        )
        assert response.status_code == 200
        assert response.headers["x-compaction-status"] == expected
    assert len(fake.summary_calls) == 2  # the re-serialised history paid once, then reused
    first, second, third = (json.loads(raw) for raw in fake.forwarded_raw)
    assert second == third
    assert first["messages"][-3:] == history[-3:] == second["messages"][-3:]


async def test_summaries_stored_under_the_old_key_format_are_missed_not_misread(
    fake: FakeUpstream,
) -> None:
    """Before message bytes were hashed, keys chained canonical JSON under a namespace
    without a chain version: such entries must never be found."""
    import hashlib
    import time

    from proxy.compaction.protocol import Usage
    from proxy.store import StoredSummary, canonical, namespace_for, scope_for

    app = respx_app(settings_for(backend="memory"))
    state = app.state.proxy
    compactor = state.compactor
    history = agent_turns(40)[-1]
    model = "gpt-4o-mini"
    (stage,) = compactor.stages_for(model)
    old_namespace = namespace_for(
        model=model,
        base_url=state.settings.upstream.base_url,
        strategy=stage.fingerprint,
    )
    assert old_namespace != stage.namespace
    scope = scope_for("sk-a", "credential")
    assert scope is not None

    def digest(data: bytes, person: bytes) -> bytes:
        return hashlib.blake2b(data, digest_size=32, person=person).digest()

    rest = [m for i, m in enumerate(history) if i > 0 or m["role"] not in ("system", "developer")]
    current = digest(canonical([scope, old_namespace]), b"cp-chain-root")
    for length, message in enumerate(rest, start=1):
        current = digest(current + canonical(message), b"cp-chain")
        old = StoredSummary("OLD SUMMARY", length, 3, Usage(), time.time())
        await compactor.store.put(current.hex(), old)
    async with await open_client(app) as client:
        response = await send(client, history)
    assert response.headers["x-compaction-status"] == "compacted"
    assert response.headers["x-compaction-cache"] == "miss"
    assert b"OLD SUMMARY" not in fake.forwarded_raw[0]
