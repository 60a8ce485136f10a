"""`replay` on the shipped sessions with the testing kit's fake upstream: every number exact.

The replay must be what the server does: the same statuses and forwarded token counts turn by
turn as the app answers for the same requests, the summarizer calls the fake received, and
the cost a hand computation gives on a small session.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from proxy.replay.measure import CACHE_MIN_TOKENS
from proxy.replay.session import Session, load
from proxy.settings import Settings
from proxy.testing import FakeOpenAI, Reply, make_app, make_settings
from proxy.tokens import TokenCounter
from proxy.usage.pricing import Pricing
from tests.evaluation.replaying import SHIPPED, replay, run_of, shipped


@pytest.fixture(scope="module")
def counter() -> Any:
    counter = TokenCounter(Settings())
    counter.load()
    yield counter
    counter.close()


def base_settings(budget: int = 8000) -> Settings:
    return make_settings(compaction={"budget_tokens": budget})


async def served(session: Session, settings: Settings, fake: FakeOpenAI) -> list[dict[str, str]]:
    """The session's requests through the app itself: each reply's x-compaction-* headers."""
    app = make_app(settings)
    headers = []
    with fake.mock():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy.test") as client:
            for raw in session.lines:
                response = await client.post(
                    "/v1/chat/completions",
                    content=raw,
                    headers={"content-type": "application/json", "authorization": "Bearer k"},
                )
                assert response.status_code == 200, response.text
                headers.append(dict(response.headers))
    await app.state.proxy.upstream.client.aclose()
    return headers


async def test_the_baseline_counts_every_turn_as_the_proxys_counter(counter: Any) -> None:
    sessions = load(SHIPPED)
    report = await replay(sessions, base_settings(), FakeOpenAI(), strategies=(), budgets=())
    assert [r["strategy"] for r in report["runs"]] == ["none"] * len(sessions)
    for session in sessions:
        run = run_of(report, session.name, "none", None)
        expected = [counter.count_request(json.loads(raw)) for raw in session.lines]
        assert run["forwarded_tokens"]["series"] == expected
        assert run["statuses"] == {"passthrough": session.turns}
        assert run["summarizer"] == {"calls": 0, "input_tokens": 0, "output_tokens": 0}
        assert run["prefix_stability"] == 1.0  # every request extends the one before
        assert run["recall"]["measured_turns"] == 0
        assert run["cost"]["ratio_to_none"] == 1.0


@pytest.mark.parametrize("name", ["support-chat", "research-agent"])
@pytest.mark.parametrize("strategy", ["simple", "structured"])
async def test_a_replayed_run_is_what_the_server_does(name: str, strategy: str) -> None:
    [session] = shipped(name)
    settings = make_settings(compaction={"budget_tokens": 8000, "strategy": strategy})
    replay_fake, server_fake = FakeOpenAI(summary_tokens=300), FakeOpenAI(summary_tokens=300)
    report = await replay([session], settings, replay_fake, strategies=[strategy])
    run = run_of(report, name, strategy, 8000)
    headers = await served(session, settings, server_fake)

    assert run["status"] == "ok"
    assert run["status_series"] == [h["x-compaction-status"] for h in headers]
    assert run["forwarded_tokens"]["series"] == [
        int(h["x-compaction-tokens-after"]) for h in headers
    ]
    # The forwarded counts are the fake upstream's own count of what the server forwarded.
    assert run["forwarded_tokens"]["series"] == [
        server_fake.counter.count_request(c.body) for c in server_fake.chat_calls
    ]
    calls = replay_fake.summarizer_calls
    assert run["summarizer"]["calls"] == len(calls) == len(server_fake.summarizer_calls) > 0
    assert not replay_fake.chat_calls  # the agent's model is never called
    assert run["summarizer"]["input_tokens"] == sum(
        int(h["x-compaction-summary-input-tokens"]) for h in headers
    )
    assert run["summarizer"]["output_tokens"] == sum(
        int(h["x-compaction-summary-output-tokens"]) for h in headers
    )
    over = [t for t in run["forwarded_tokens"]["series"] if t > 8000]
    assert run["over_budget"]["turns"] == len(over)
    assert run["over_budget"]["honest"] == run["over_budget"]["turns"]
    assert run["invalid_requests"]["turns"] == 0
    assert run["task_verbatim"] == 1.0 and run["ask_verbatim"] == 1.0


async def test_the_coding_agent_replays_within_its_budget_with_valid_requests() -> None:
    sessions = shipped("coding-agent")
    fake = FakeOpenAI(summary_tokens=500)
    report = await replay(sessions, base_settings(), fake, budgets=[16000])
    run = run_of(report, "coding-agent", "simple", 16000)
    assert run["turns"] == sessions[0].turns >= 200
    assert run["summarizer"]["calls"] == len(fake.summarizer_calls) > 0
    assert run["invalid_requests"]["turns"] == 0
    assert run["over_budget"]["turns"] == run["over_budget"]["honest"]
    assert run["statuses"]["reused"] > run["statuses"].get("extended", 0)  # the store works
    # A fake summary keeps no fact: what the tail lost, the recall shows.
    assert 0 < run["recall"]["mean"] < 1
    assert run["cost"]["ratio_to_none"] < 1


# -- cost by hand --------------------------------------------------------------------------

SYSTEM = "You are a terse assistant. " * 150  # ~900 tokens: the cached prefix needs 1,024
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def small_session() -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    requests = []
    for turn in range(3):
        history.append({"role": "user", "content": f"Question {turn}: " + "why? " * 60})
        requests.append({"model": "gpt-4o-mini", "tools": TOOLS, "messages": list(history)})
        history.append({"role": "assistant", "content": "Because. " * 50})
    return requests


async def test_cost_is_the_hand_computed_price_with_prompt_caching(
    tmp_path: Any, counter: Any
) -> None:
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in small_session()))
    sessions = load([str(path)])
    report = await replay(sessions, base_settings(), FakeOpenAI(), strategies=(), budgets=())
    run = run_of(report, "small", "none", None)

    price = Pricing().price_of("gpt-4o-mini")
    assert price is not None
    requests = small_session()
    tools = counter.count_tools("gpt-4o-mini", requests[0])
    total = 0.0
    cached_total = 0
    for i, request in enumerate(requests):
        prompt = counter.count_request(request)
        cached = 0
        if i:  # the previous request's messages all come again, after the same tools
            shared = tools + sum(
                counter.count_message("gpt-4o-mini", m) for m in requests[i - 1]["messages"]
            )
            cached = shared if shared >= CACHE_MIN_TOKENS else 0
        cached_total += cached
        total += ((prompt - cached) * 0.15 + cached * 0.075) / 1_000_000
    assert run["cost"]["cached_tokens"] == cached_total > 0
    assert run["cost"]["total_usd"] == pytest.approx(total, rel=1e-12)
    assert run["cost"]["summarizer_usd"] == 0.0


async def test_summarizer_calls_are_priced_as_the_pricing_table_says(tmp_path: Any) -> None:
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in small_session()))
    sessions = load([str(path)])
    usage = {"prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100}
    fake = FakeOpenAI(summaries=lambda call: Reply("a short summary", usage=usage))
    settings = make_settings(
        compaction={"budget_tokens": 1200, "keep_recent_ratio": 0, "protect_task": False},
        pricing={"small-summarizer": {"input": 1.0, "output": 2.0}},
    )
    report = await replay(
        sessions, settings, fake, budgets=[1200], summarizer_model="small-summarizer"
    )
    run = run_of(report, "small", "simple", 1200)
    calls = run["summarizer"]["calls"]
    assert calls == len(fake.summarizer_calls) > 0
    assert run["summarizer"]["input_tokens"] == 1000 * calls
    assert run["cost"]["summarizer_usd"] == pytest.approx(calls * (1000 * 1.0 + 100 * 2.0) / 1e6)
