"""Summaries made ahead of need: the turn that crosses the budget finds its summary stored.

The summarizer is a respx fake whose replies can be held back (`FakeUpstream.gate`): a
turn that needed it would hang, so "answered while the gate is closed" proves that nobody
waited on a summary. Background work is awaited by polling a condition (`until`) or
`Preparer.join`, never by sleeping.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import httpx
import pytest
import respx
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import create_app
from proxy.report import Usage
from proxy.settings import Settings
from proxy.store import StoredSummary
from proxy.tokens import TokenCounter
from tests.conftest import make_settings, respx_app, until
from tests.keys.conftest import KEY_A, KEY_B, bearer, key_entry, keyed_settings
from tests.replay import COMPACTED, Session, check, coding_agent, customer_service, turn_of
from tests.upstream_fakes import FakeUpstream

CHAT = "/v1/chat/completions"
MODEL = "gpt-4o-mini"
BUDGET = 7000  # coding_agent(60): turn 14 is at 82% of it, turn 17 the first over it


@pytest.fixture(scope="module")
def counter() -> Iterator[TokenCounter]:
    counter = TokenCounter(Settings())
    counter.load()
    yield counter
    counter.close()


@pytest.fixture
def fake(upstream: respx.MockRouter) -> FakeUpstream:
    return FakeUpstream(numbered=True).install(upstream)


class Proxy:
    """An app and an in-process client; `send` posts one turn of a session."""

    def __init__(self, settings: Settings) -> None:
        self.app = respx_app(settings)
        transport = httpx.ASGITransport(app=self.app)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://proxy.test")

    @property
    def state(self) -> Any:
        return self.app.state.proxy

    @property
    def preparer(self) -> Any:
        return self.state.compactor.preparer

    async def send(
        self, session: Session, turn: int, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        body = {"model": MODEL, "messages": session.turns[turn], "tools": session.tools}
        response = await self.client.post(CHAT, json=body, headers=headers or bearer(KEY_A))
        assert response.status_code == 200, response.text
        return response

    async def metric(self, name: str, **labels: str) -> float:
        text = (await self.client.get("/metrics")).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        return 0.0

    async def close(self) -> None:
        await self.state.compactor.aclose()
        await self.state.meter.join()
        await self.client.aclose()
        await self.state.upstream.client.aclose()
        await self.state.compactor.store.close()


@asynccontextmanager
async def proxy(settings: Settings) -> AsyncIterator[Proxy]:
    made = Proxy(settings)
    try:
        yield made
    finally:
        await made.close()


def keyed(*keys: dict[str, Any], **compaction: Any) -> Settings:
    return keyed_settings(
        *(keys or (key_entry("team-a", KEY_A),)),
        compaction={
            "budget_tokens": BUDGET,
            "strategy": "simple",  # summaries made ahead of need: the summarizing stage
            "summarizer": {"retries": 0, "timeout_s": 10},
            **compaction,
        },
        cache={"backend": "memory"},
    )


async def first_started(proxy: Proxy, session: Session, **headers: str) -> int:
    """Send turns until one starts a preparation; its number."""
    for turn in range(len(session.turns)):
        response = await proxy.send(session, turn, {**bearer(KEY_A), **headers})
        assert response.headers["x-compaction-status"] == "passthrough"
        if response.headers.get("x-compaction-prepared") == "started":
            return turn
    raise AssertionError("no turn started a preparation")


async def test_the_turn_that_crosses_the_budget_waits_on_no_summary(
    fake: FakeUpstream, counter: TokenCounter
) -> None:
    session = coding_agent(60)
    fake.gate = asyncio.Event()  # summarizer replies are held back until it is set
    async with proxy(keyed()) as p:
        started = await first_started(p, session)
        # Answered with the summarizer call still held: the request never waited on it.
        tokens = int((await p.send(session, started)).headers["x-compaction-tokens-before"])
        assert 0.8 * BUDGET <= tokens <= BUDGET
        await until(lambda: len(fake.summary_calls) == 1)
        assert p.preparer.running == 1
        fake.gate.set()
        await p.preparer.join()
        assert await p.metric("compaction_proxy_prepared_summaries_total", result="done") == 1
        fake.gate.clear()  # from here on a turn that called the summarizer would hang
        for turn in range(started + 1, len(session.turns)):
            async with asyncio.timeout(5):
                response = await p.send(session, turn)
            headers = response.headers
            if headers["x-compaction-status"] != "passthrough":
                break
        else:
            raise AssertionError("the session never crossed its budget")
        assert headers["x-compaction-status"] == "reused"
        assert headers["x-compaction-cache"] == "hit"
        assert headers["x-compaction-prepared"] == "used"
        assert headers["x-compaction-summary-input-tokens"] == "0"
        assert len(fake.summary_calls) == 1
        sent = fake.forwarded[-1]
        assert counter.count_request(sent) == int(headers["x-compaction-tokens-after"])
        assert int(headers["x-compaction-tokens-after"]) <= BUDGET
        assert any("SUMMARY: " in str(m.get("content")) and "#1" in str(m.get("content"))
                   for m in sent["messages"])  # fmt: skip
        # Its first use is counted once: the next turn reuses it without saying so again.
        assert await p.metric("compaction_proxy_prepared_summaries_total", result="used") == 1
        await p.preparer.join()
        response = await p.send(session, turn + 1)
        assert response.headers["x-compaction-cache"] == "hit"
        assert "x-compaction-prepared" not in response.headers
        assert await p.metric("compaction_proxy_prepared_summaries_total", result="used") == 1


@pytest.mark.parametrize("strategy", ["simple", "hybrid"])
@pytest.mark.parametrize("shape", ["coding agent", "customer service"])
async def test_a_long_session_never_waits_on_a_summary_when_turns_are_far_apart(
    fake: FakeUpstream, counter: TokenCounter, strategy: str, shape: str
) -> None:
    """Turns at least as far apart as a summary takes (each turn waits for the work the one
    before started): every compacted turn is served from the store, the promises hold."""
    session, budget = (coding_agent(), 8000) if shape == "coding agent" else (
        customer_service(48), 2500)  # fmt: skip
    settings = keyed(strategy=strategy, budget_tokens=budget)
    async with proxy(settings) as p:
        turns, sent = [], []
        for turn in range(len(session.turns)):
            headers = (await p.send(session, turn)).headers
            turns.append(turn_of(headers))
            sent.append(int(headers["x-compaction-tokens-before"]))
            await p.preparer.join()
        assert check(session, turns, fake.forwarded, counter, budget) == []
        compacted = [t for t in turns if t.status in COMPACTED and t.summarized]
        assert len(compacted) > 10
        # A turn waits on a summary only when its history grew by more than the last 20%
        # of the budget at once (a huge tool output): no turn fell in between to start one.
        waited = [i for i, t in enumerate(turns) if t.paid]
        assert all(sent[i] - sent[i - 1] > 0.2 * budget for i in waited), waited
        assert len(waited) <= len(compacted) // 10
        done = await p.metric("compaction_proxy_prepared_summaries_total", result="done")
        used = await p.metric("compaction_proxy_prepared_summaries_total", result="used")
        assert done + len(waited) >= len(fake.summary_calls)
        assert used >= done - 1  # the last one may be made for a crossing still to come


async def test_hybrid_prepares_only_what_masking_leaves_over(
    upstream: respx.MockRouter,
) -> None:
    """Masking alone keeps the session under its budget: the original history is past
    `prepare_at`, what masking forwards is not, so no summary is made ahead of need."""
    fake = FakeUpstream().install(upstream)
    session = coding_agent(60)
    settings = keyed(strategy="hybrid", budget_tokens=12000, mask={"clear_at_least": 0})
    async with proxy(settings) as p:
        started = 0
        for turn in range(len(session.turns)):
            response = await p.send(session, turn)
            started += response.headers.get("x-compaction-prepared") == "started"
            await p.preparer.join()
        assert started > 0  # past 80% of the budget as sent...
        assert fake.summary_calls == []  # ...but never as masking would forward it
        assert await p.metric("compaction_proxy_prepared_summaries_total", result="skipped") > 0


async def test_the_cap_drops_preparations_past_it(fake: FakeUpstream) -> None:
    fake.gate = asyncio.Event()
    settings = keyed(key_entry("team-a", KEY_A), key_entry("team-b", KEY_B),
                     prepare_max_concurrent=1)  # fmt: skip
    one, other = coding_agent(60), coding_agent(60, seed=12)
    async with proxy(settings) as p:
        await first_started(p, one)
        await until(lambda: len(fake.summary_calls) == 1)
        for turn in range(len(other.turns)):
            response = await p.send(other, turn, bearer(KEY_B))
            assert response.headers["x-compaction-status"] == "passthrough"
            if "x-compaction-prepared" in response.headers:
                break
        assert response.headers["x-compaction-prepared"] == "dropped"
        assert p.preparer.running == 1 and len(fake.summary_calls) == 1
        assert await p.metric("compaction_proxy_prepared_summaries_total", result="dropped") == 1
        assert await p.metric("compaction_proxy_prepared_summaries_running") == 1
        # Dropped, not queued: the next turn may start it once there is room.
        fake.gate.set()
        await p.preparer.join()
        assert await p.metric("compaction_proxy_prepared_summaries_running") == 0
        response = await p.send(other, turn + 1, bearer(KEY_B))
        assert response.headers["x-compaction-prepared"] == "started"


async def test_a_key_can_turn_preparing_off(fake: FakeUpstream) -> None:
    settings = keyed(key_entry("team-a", KEY_A, prepare=False), key_entry("team-b", KEY_B))
    session = coding_agent(60)
    async with proxy(settings) as p:
        for turn in range(len(session.turns)):
            response = await p.send(session, turn)
            assert "x-compaction-prepared" not in response.headers
            if response.headers["x-compaction-status"] != "passthrough":
                break
        assert response.headers["x-compaction-cache"] == "miss"  # made while it waited
        assert len(fake.summary_calls) == 1
        # The other key, same history: prepared ahead.
        assert await first_started(p, session, authorization=f"Bearer {KEY_B}") > 0


@pytest.mark.parametrize("keyless", [False, True])
async def test_keyless_clients_are_prepared_for_only_when_configured(
    fake: FakeUpstream, keyless: bool
) -> None:
    settings = make_settings(
        compaction={"budget_tokens": BUDGET, "strategy": "simple", "prepare_keyless": keyless},
        cache={"backend": "memory"},
    )
    session = coding_agent(60)
    async with proxy(settings) as p:
        said = []
        for turn in range(len(session.turns)):
            response = await p.send(session, turn, {"authorization": "Bearer sk-upstream"})
            said.append(response.headers.get("x-compaction-prepared"))
            await p.preparer.join()
            if response.headers["x-compaction-status"] != "passthrough":
                break
        assert ("started" in said) is keyless
        assert ("used" in said) is keyless
        assert response.headers["x-compaction-cache"] == ("hit" if keyless else "miss")


async def test_prepare_at_off_never_prepares(fake: FakeUpstream) -> None:
    session = coding_agent(60)
    async with proxy(keyed(prepare_at="off")) as p:
        for turn in range(40):
            response = await p.send(session, turn)
            assert "x-compaction-prepared" not in response.headers
        assert await p.metric("compaction_proxy_prepared_summaries_total", result="started") == 0


async def test_a_preparation_is_billed_to_its_key_after_its_request_is_over(
    fake: FakeUpstream,
) -> None:
    fake.gate = asyncio.Event()
    fake.summary_usage = (700, 30)
    session = coding_agent(60)
    async with proxy(keyed()) as p:
        started = await first_started(p, session)
        await p.state.meter.join()
        [row] = await p.state.meter.ledger.usage(None, "2000-01-01", "2100-01-01")
        assert row.key == "team-a"
        assert row.counts.requests == started + 1
        assert row.counts.summarizer_prompt_tokens == 0  # not answered yet
        fake.gate.set()
        await p.preparer.join()
        await p.state.meter.join()
        [row] = await p.state.meter.ledger.usage(None, "2000-01-01", "2100-01-01")
        assert (row.counts.requests, row.model) == (started + 1, MODEL)  # no request added
        assert row.counts.summarizer_prompt_tokens == 700
        assert row.counts.summarizer_completion_tokens == 30
        assert row.counts.cost_nano_usd > 0
        spent = "compaction_proxy_prepared_summary_tokens_total"
        assert await p.metric(spent, use="spent") == 730


async def test_a_failing_summarizer_in_the_background_affects_no_request(
    fake: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    fake.summary_status = 500
    sessions = [coding_agent(60, seed=seed) for seed in (1, 2, 3)]
    caplog.set_level(logging.WARNING, logger="proxy.compaction")
    async with proxy(keyed(summarizer={"retries": 0, "breaker_failures": 100})) as p:
        for session in sessions:
            turn = await first_started(p, session)
            await p.preparer.join()
            response = await p.send(session, turn + 1)  # still under budget: untouched
            assert response.headers["x-compaction-status"] == "passthrough"
            assert fake.forwarded[-1]["messages"] == session.turns[turn + 1]
        # (A later turn in the band tries again; the breaker stops a dead summarizer.)
        failed = await p.metric("compaction_proxy_prepared_summaries_total", result="failed")
        assert failed == len(fake.summary_calls) >= 3
        failures = [r for r in caplog.records if "preparation failed" in r.getMessage()]
        assert len(failures) == 1  # once per kind of failure, rate-limited
        assert "summarizer_http_500" in failures[0].getMessage()


async def test_shutdown_cancels_a_preparation_in_flight(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeUpstream(gate=asyncio.Event())  # the summarizer never answers
    app = create_app(keyed(), transport=httpx.MockTransport(fake))
    state = app.state.proxy
    session = coding_agent(60)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy.test") as client:
        async with asyncio.timeout(10), app.router.lifespan_context(app):
            for turn in range(len(session.turns)):
                body = {"model": MODEL, "messages": session.turns[turn], "tools": session.tools}
                response = await client.post(CHAT, json=body, headers=bearer(KEY_A))
                if response.headers.get("x-compaction-prepared") == "started":
                    break
            await until(lambda: len(fake.summary_calls) == 1)
            assert state.compactor.preparer.running == 1
        # The lifespan is over: the preparation was cancelled and has unwound.
        assert state.compactor.preparer.running == 0
        metrics = (await client.get("/metrics")).text
    assert 'compaction_proxy_prepared_summaries_total{result="cancelled"} 1.0' in metrics
    assert "compaction_proxy_prepared_summaries_running 0.0" in metrics
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    [row] = await state.meter.ledger.usage(None, "2000-01-01", "2100-01-01")
    assert row.counts.summarizer_prompt_tokens == 0  # never answered: nothing billed


@pytest.mark.parametrize("value", [0, 1, 1.5, -0.2, "never"])
def test_prepare_at_is_a_share_of_the_budget_or_off(value: object) -> None:
    with pytest.raises(ValueError, match="prepare_at"):
        make_settings(compaction={"prepare_at": value})
    assert make_settings(compaction={"prepare_at": "off"}).compaction.prepare_share is None
    assert make_settings(compaction={"prepare_at": 0.9}).compaction.prepare_share == 0.9


def test_a_prepared_summary_keeps_its_mark_in_the_store() -> None:
    made = StoredSummary("text", 12, 3, Usage(100, 10), 1.0, carried=4, prepared=True)
    assert StoredSummary.decode(made.encode()) == made
    plain = replace(made, prepared=False)
    assert b"prepared" not in plain.encode()
    assert StoredSummary.decode(plain.encode()) == plain
    with pytest.raises(ValueError):
        StoredSummary.decode(made.encode().replace(b"true", b"1"))
