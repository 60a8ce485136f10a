"""Strategies in a row, a user's `compact(messages, llm)`, fingerprints, per-key strategies,
and the compaction step's answer as a value."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from proxy.compaction.mask import STUB
from proxy.compaction.strategies import StrategyOptions, fingerprint_for, load_strategy
from proxy.compactor import Compactor, Control, compaction_error
from proxy.settings import Settings
from proxy.store import NullStore
from proxy.tokens import TokenCounter
from tests.conftest import make_settings, respx_app
from tests.upstream_fakes import FakeUpstream, summary_of

MODEL = "gpt-4o-mini"
TASK = {"role": "user", "content": "Fix the CSV importer: amounts like 1.234,56 are dropped."}
STUB_START = STUB.split("{", 1)[0]

MINE = '''
from proxy.compaction import SummarizerError


class AskTheModel:
    """Replaces everything between the task and the last two messages with the model's
    one-line account of it."""

    async def compact(self, messages, llm):
        task, *middle, one, two = messages
        text = await llm.complete(
            [{"role": "user", "content": f"{len(middle)} messages: say what happened"}]
        )
        return [task, {"role": "user", "content": "Earlier: " + text}, one, two]


class Plain:
    async def compact(self, messages, llm):
        return messages


class Versioned:
    fingerprint = "versioned-7"

    async def compact(self, messages, llm):
        return messages
'''


@pytest.fixture
def mine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "mine_strategies.py"
    path.write_text(MINE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield path
    sys.modules.pop("mine_strategies", None)


def tool_turn(i: int, words: int) -> list[dict[str, Any]]:
    call = {"id": f"c{i}", "type": "function", "function": {"name": "run", "arguments": "{}"}}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"c{i}", "content": f"out {i} " + "log line " * words},
    ]


def agent(turns: int, words: int = 150) -> list[dict[str, Any]]:
    messages = [TASK]
    for i in range(turns):
        messages += tool_turn(i, words)
    return messages


@pytest.fixture
def fake(upstream: respx.MockRouter) -> FakeUpstream:
    return FakeUpstream().install(upstream)


async def post(
    compaction: dict[str, Any], messages: list[dict[str, Any]], **headers: str
) -> httpx.Response:
    settings = make_settings(compaction=compaction, cache={"backend": "memory"})
    app = respx_app(settings)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://p") as client:
        response = await client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": messages},
            headers={"authorization": "Bearer sk-strategies", **headers},
        )
    await app.state.proxy.upstream.client.aclose()
    return response


# -- a row of strategies ----------------------------------------------------------------------


async def test_a_later_stage_runs_only_while_the_request_is_still_over_budget(
    fake: FakeUpstream,
) -> None:
    messages = agent(30)  # ~9k tokens: masking 25 old results brings it to ~2.5k
    row = {"strategy": "hybrid", "mask": {"clear_at_least": 0}}
    loose = await post({**row, "budget_tokens": 4000}, messages)
    assert loose.headers["x-compaction-status"] == "compacted"
    assert loose.headers["x-compaction-messages-masked"] == "25"
    assert loose.headers["x-compaction-messages-summarized"] == "0"
    assert fake.summary_calls == []  # under budget after masking: simple never ran
    tight = await post({**row, "budget_tokens": 1500}, messages)
    assert tight.headers["x-compaction-status"] == "compacted"
    assert int(tight.headers["x-compaction-messages-summarized"]) > 0
    assert int(tight.headers["x-compaction-tokens-after"]) <= 1500
    (summary_request,) = fake.summary_calls
    read = summary_request["messages"][1]["content"]
    assert STUB_START not in read and "log line log line" in read  # what the client sent
    sent = fake.forwarded[-1]["messages"]
    assert sent[0] == TASK and summary_of(sent) is not None


async def test_a_failing_stage_forwards_what_the_stages_before_it_made(
    upstream: respx.MockRouter,
) -> None:
    fake = FakeUpstream(summary_status=400).install(upstream)
    messages = agent(30)
    response = await post(
        {"strategy": "hybrid", "mask": {"clear_at_least": 0}, "budget_tokens": 1500}, messages
    )
    headers = response.headers
    assert headers["x-compaction-status"] == "failed"
    assert headers["x-compaction-reason"] == "summarizer_http_400"
    assert headers["x-compaction-messages-masked"] == "25"
    sent = fake.forwarded[-1]["messages"]
    assert len(sent) == len(messages) and sent != messages  # masked, not summarized
    assert int(headers["x-compaction-tokens-after"]) < int(headers["x-compaction-tokens-before"])


# -- a user's compact(messages, llm) ----------------------------------------------------------


async def test_a_compact_strategy_calls_the_model_through_llm_and_is_billed_for_it(
    mine: Path, fake: FakeUpstream
) -> None:
    messages = agent(10)
    response = await post(
        {"strategy": "mine_strategies:AskTheModel", "budget_tokens": 1000}, messages
    )
    headers = response.headers
    assert headers["x-compaction-status"] == "compacted"
    assert headers["x-compaction-summary-input-tokens"] == "1234"  # the fake's usage
    (call,) = fake.summary_calls
    assert call["model"] == MODEL and call["max_tokens"] == 2000 and "tools" not in call
    assert call["messages"][0]["role"] == "system"
    assert call["messages"][1] == {"role": "user", "content": "18 messages: say what happened"}
    sent = fake.forwarded[-1]["messages"]
    assert sent == [
        TASK,
        {"role": "user", "content": "Earlier: " + fake.summary_text},
        *messages[-2:],
    ]


async def test_a_compact_strategy_whose_llm_call_fails_says_why(
    mine: Path, upstream: respx.MockRouter
) -> None:
    fake = FakeUpstream(summary_status=401).install(upstream)
    messages = agent(10)
    response = await post(
        {"strategy": "mine_strategies:AskTheModel", "budget_tokens": 1000}, messages
    )
    assert response.headers["x-compaction-status"] == "failed"
    assert response.headers["x-compaction-reason"] == "summarizer_http_401"
    assert fake.forwarded[-1]["messages"] == messages


def test_a_compact_strategys_fingerprint_is_configured_given_or_derived(mine: Path) -> None:
    (plain,) = load_strategy("mine_strategies:Plain")
    (versioned,) = load_strategy("mine_strategies:Versioned")
    assert (plain.kind, versioned.kind) == ("compact", "compact")
    made = plain.factory(StrategyOptions())
    derived = fingerprint_for(plain.name, made, {})
    assert derived == fingerprint_for(plain.name, made, {})
    assert fingerprint_for(plain.name, made, {plain.name: "mine-3"}) == "mine-3"
    given = versioned.factory(StrategyOptions())
    assert fingerprint_for(versioned.name, given, {}) == "versioned-7"
    mine.write_text(MINE + "\n# edited\n", encoding="utf-8")
    assert fingerprint_for(plain.name, made, {}) != derived  # its source changed


# -- per-key strategies -----------------------------------------------------------------------


async def test_a_key_runs_its_own_strategy(fake: FakeUpstream) -> None:
    keys = [
        {"id": "masked", "key_sha256": _sha("sk-masked"), "strategy": "mask"},
        {"id": "summarized", "key_sha256": _sha("sk-summarized")},
    ]
    settings = make_settings(
        compaction={"budget_tokens": 3000, "strategy": "simple", "mask": {"clear_at_least": 0}},
        cache={"backend": "memory"},
        auth={"keys": keys},
    )
    app = respx_app(settings)
    transport = httpx.ASGITransport(app=app)
    statuses = {}
    async with httpx.AsyncClient(transport=transport, base_url="http://p") as client:
        for key in ("masked", "summarized"):
            response = await client.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": agent(20)},
                headers={"authorization": f"Bearer sk-{key}"},
            )
            statuses[key] = response.headers
    await app.state.proxy.upstream.client.aclose()
    assert int(statuses["masked"]["x-compaction-messages-masked"]) > 0
    assert statuses["masked"]["x-compaction-messages-summarized"] == "0"
    assert "x-compaction-messages-masked" not in statuses["summarized"]
    assert int(statuses["summarized"]["x-compaction-messages-summarized"]) > 0
    assert len(fake.summary_calls) == 1


def _sha(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()


# -- the answer is a value --------------------------------------------------------------------


async def test_a_failed_compaction_under_reject_is_a_value_the_handler_maps(
    upstream: respx.MockRouter,
) -> None:
    """The compactor never raises for a failed compaction: the outcome says `rejected`,
    and `compaction_error` is the envelope the handler answers."""
    FakeUpstream(summary_status=500).install(upstream)
    settings = make_settings(
        compaction={"budget_tokens": 1000, "on_error": "reject", "summarizer": {"retries": 0}}
    )
    counter = TokenCounter(Settings())
    counter.load()
    observed: list[str] = []

    class Observer:
        def observe(self, outcome: Any, seconds: float) -> None:
            observed.append(outcome.status)

        def summarizer_call(self, seconds: float | None, failure: str | None) -> None:
            observed.append(f"call {failure}")

        def breaker_changed(self, state: str) -> None:
            observed.append(state)

    async with httpx.AsyncClient() as http:
        compactor = Compactor(settings, counter, http, NullStore(), Observer())
        outcome = await compactor.run(
            {"model": MODEL, "messages": agent(10)},
            Control(),
            client_headers={"authorization": "Bearer sk-x"},
            scope=None,
        )
    counter.close()
    assert (outcome.status, outcome.reason, outcome.rejected) == (
        "failed",
        "summarizer_http_500",
        True,
    )
    assert outcome.messages is None and outcome.seconds > 0
    assert observed == ["call summarizer_http_500", "failed"]
    error = compaction_error(outcome)
    assert error.status == 502 and error.code == "compaction_failed"
    assert error.headers["x-compaction-status"] == "failed"
    body = json.loads(error.response().body)
    assert body["error"]["type"] == "upstream_error"
