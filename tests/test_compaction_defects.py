"""Compaction defects found by using the proxy as a new user would, one test each (each
failed before its fix), through the app as clients call it."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from proxy.app import create_app
from proxy.cli import main
from proxy.settings import ConfigError, Settings
from proxy.tokens import TokenCounter
from tests.conftest import make_settings, respx_app
from tests.upstream_fakes import FakeUpstream, summary_of

MODEL = "gpt-4o-mini"
TASK = {"role": "user", "content": "Fix the CSV importer: amounts like 1.234,56 are dropped."}
WORDS = ["amount", "locale", "decimal", "separator", "parser", "row", "ledger", "importer"]


def words(count: int, seed: int = 0) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(count))


def call(call_id: str | None, step: int) -> dict[str, Any]:
    function = {"name": "run", "arguments": f'{{"cmd": "step {step}"}}'}
    tool_call: dict[str, Any] = {"type": "function", "function": function}
    if call_id is not None:
        tool_call["id"] = call_id
    return {"role": "assistant", "content": None, "tool_calls": [tool_call]}


def result(call_id: str | None, text: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "tool", "content": text}
    if call_id is not None:
        message["tool_call_id"] = call_id
    return message


@pytest.fixture(scope="module")
def counter() -> Iterator[TokenCounter]:
    counter = TokenCounter(Settings())
    counter.load()
    yield counter
    counter.close()


@pytest.fixture
def fake(upstream: respx.MockRouter) -> FakeUpstream:
    return FakeUpstream(numbered=True).install(upstream)


async def open_client(**compaction: Any) -> httpx.AsyncClient:
    settings = make_settings(compaction=compaction, cache={"backend": "memory"})
    transport = httpx.ASGITransport(app=respx_app(settings))
    return httpx.AsyncClient(transport=transport, base_url="http://p")


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with await open_client() as c:
        yield c


async def post(
    client: httpx.AsyncClient, messages: list[dict[str, Any]], **headers: str
) -> httpx.Response:
    return await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages},
        headers={"authorization": "Bearer sk-defects", **headers},
    )


def assert_pairs_valid(sent: list[dict[str, Any]]) -> None:
    """Every tool message follows an assistant message with calls (across other results)."""
    calls_open = False
    for message in sent:
        if message["role"] == "assistant":
            calls_open = bool(message.get("tool_calls"))
        elif message["role"] == "tool":
            assert calls_open, f"a tool result with no call before it: {[m['role'] for m in sent]}"
        else:
            calls_open = False


# 1. Reused tool-call ids --------------------------------------------------------------------


async def test_reused_tool_call_ids_pair_with_the_nearest_call(
    client: httpx.AsyncClient, fake: FakeUpstream, counter: TokenCounter
) -> None:
    """Several providers number calls per turn (`call_0` every turn): each result pairs with
    the nearest earlier call of its id, so the history compacts like one with unique ids."""

    def history(ids: bool) -> list[dict[str, Any]]:
        messages = [TASK]
        for step in range(10):
            call_id = f"call_{step}" if ids else "call_0"
            messages += [call(call_id, step), result(call_id, words(400, step))]
        return messages

    reused = await post(client, history(False), **{"x-compaction-budget": "1500"})
    assert reused.headers["x-compaction-status"] == "compacted", reused.headers
    assert int(reused.headers["x-compaction-tokens-after"]) <= 1500
    assert_pairs_valid(fake.forwarded[-1]["messages"])
    async with await open_client() as other:
        unique = await post(other, history(True), **{"x-compaction-budget": "1500"})
    assert unique.headers["x-compaction-status"] == "compacted"
    assert (
        reused.headers["x-compaction-messages-summarized"]
        == (unique.headers["x-compaction-messages-summarized"])
    )


# 2. Tool results without ids ----------------------------------------------------------------


async def test_tool_results_without_ids_stay_with_their_call(
    client: httpx.AsyncClient, fake: FakeUpstream
) -> None:
    """A call without an id and a result without a `tool_call_id` pair by position: the
    cut never forwards the result without the call before it."""
    task = {"role": "user", "content": "Fix the importer. " + words(150)}
    messages = [task]
    for step in range(3):
        messages += [
            call(None, step),
            result(None, words(160, step)),
            {"role": "assistant", "content": f"step {step}"},
        ]
    messages.append({"role": "user", "content": "next?"})
    response = await post(client, messages, **{"x-compaction-budget": "600"})
    assert response.headers["x-compaction-status"] in ("compacted", "over_budget")
    sent = fake.forwarded[-1]["messages"]
    assert_pairs_valid(sent)
    assert sent[0] == task and sent[-1] == messages[-1]


# 3. A user strategy that cannot work, or that raises ----------------------------------------

BROKEN = '''
class NoCompact:
    """Neither compact(messages, llm) nor the summarizing members."""

    def summarize(self, messages):
        return messages


class HalfSummarizing:
    fingerprint = "half"

    async def summarize_span(self, summarizer, span, **kwargs):
        raise NotImplementedError


class NotAsync:
    def compact(self, messages, llm):
        return messages


class Raises:
    async def compact(self, messages, llm):
        raise RuntimeError("the strategy's own bug")
'''


@pytest.fixture
def broken_strategies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "broken_strategies.py").write_text(BROKEN, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "broken_strategies"
    sys.modules.pop("broken_strategies", None)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("NoCompact", r"has no compact\(messages, llm\)"),
        ("HalfSummarizing", "has no summary_message"),
        ("NotAsync", "must be an async method"),
    ],
)
def test_a_strategy_that_cannot_work_is_a_config_error_at_start(
    broken_strategies: str, name: str, says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        create_app(make_settings(compaction={"strategy": f"{broken_strategies}:{name}"}))
    with pytest.raises(ConfigError, match=r"compaction\.strategy"):
        create_app(make_settings(compaction={"strategy": ["mask", f"{broken_strategies}:{name}"]}))


def test_serve_exits_2_with_one_line_for_a_strategy_that_cannot_work(
    broken_strategies: str,
    preserved_logging: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text(
        '[upstream]\nbase_url = "http://upstream.test/v1"\n'
        f'[compaction]\nstrategy = "{broken_strategies}:NoCompact"\n'
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--config", str(config)])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "compaction.strategy" in lines[0], lines


@pytest.mark.parametrize("on_error", ["forward", "reject"])
async def test_a_strategy_that_raises_fails_the_compaction_not_the_request(
    broken_strategies: str, fake: FakeUpstream, on_error: str
) -> None:
    messages = [TASK]
    for step in range(8):
        messages += [call(f"c{step}", step), result(f"c{step}", words(200, step))]
    async with await open_client(
        strategy=f"{broken_strategies}:Raises", budget_tokens=1000, on_error=on_error
    ) as client:
        response = await post(client, messages)
    assert response.headers["x-compaction-status"] == "failed"
    assert response.headers["x-compaction-reason"] == "strategy_error"
    if on_error == "reject":
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "compaction_failed"
        assert fake.forwarded == []
    else:
        assert response.status_code == 200
        assert fake.forwarded[-1]["messages"] == messages  # the original, unchanged


# 4. What is stored is used before deciding nothing fits -------------------------------------


async def test_a_stored_summary_is_used_when_the_kept_tail_alone_is_over_budget(
    client: httpx.AsyncClient, fake: FakeUpstream, counter: TokenCounter
) -> None:
    """Turn 1 is compacted; turn 2 adds one call whose result alone nearly fills the
    budget. No new summary can help, but the stored one still makes the request smaller:
    forward that (honestly over budget), never the original."""
    messages = [TASK]
    for step in range(6):
        messages += [call(f"c{step}", step), result(f"c{step}", words(120, step))]
    first = await post(client, messages, **{"x-compaction-budget": "800"})
    assert first.headers["x-compaction-status"] == "compacted"
    calls = len(fake.summary_calls)
    turn2 = [*messages, call("c99", 99), result("c99", words(900, 99))]
    second = await post(client, turn2, **{"x-compaction-budget": "800"})
    headers = second.headers
    assert headers["x-compaction-status"] == "over_budget", headers
    assert headers["x-compaction-cache"] == "hit"
    assert len(fake.summary_calls) == calls  # nothing new paid for
    after = int(headers["x-compaction-tokens-after"])
    assert after < int(headers["x-compaction-tokens-before"])
    assert after == counter.count_request(fake.forwarded[-1])
    assert summary_of(fake.forwarded[-1]["messages"]) is not None


# 5. summary_max_tokens holds whatever the summarizer answers --------------------------------


async def test_a_summary_longer_than_summary_max_tokens_is_capped_and_says_so(
    fake: FakeUpstream, counter: TokenCounter
) -> None:
    fake.summary_text = "S " + words(20_000)  # a summarizer that ignores max_tokens
    messages = [TASK]
    for step in range(30):
        messages += [call(f"c{step}", step), result(f"c{step}", words(300, step))]
    async with await open_client(budget_tokens=3000, summary_max_tokens=500) as client:
        response = await post(client, messages)
    headers = response.headers
    assert headers["x-compaction-status"] == "compacted", headers
    assert headers["x-compaction-reason"] == "summary_capped"
    summary = summary_of(fake.forwarded[-1]["messages"])
    assert summary is not None
    assert counter.count_text(MODEL, summary["content"]) <= 500 + 40  # the marker line
    assert int(headers["x-compaction-tokens-after"]) <= 3000


# 6. A tool call for a summary ---------------------------------------------------------------


async def test_a_summarizer_answering_with_a_tool_call_says_so(upstream: respx.MockRouter) -> None:
    fake = FakeUpstream().install(upstream)

    async def answer(request: httpx.Request) -> httpx.Response:
        if b"compacts conversation context" in request.content:
            call_reply = {"id": "x", "type": "function", "function": {"name": "f", "arguments": ""}}
            message = {"role": "assistant", "content": None, "tool_calls": [call_reply]}
            return httpx.Response(200, json={"choices": [{"message": message}]})
        return await fake(request)

    upstream.post("/chat/completions").mock(side_effect=answer)
    messages = [TASK]
    for step in range(8):
        messages += [call(f"c{step}", step), result(f"c{step}", words(200, step))]
    async with await open_client(budget_tokens=1000) as client:
        response = await post(client, messages)
    assert response.headers["x-compaction-status"] == "failed"
    assert response.headers["x-compaction-reason"] == "summarizer_tool_call"


# 7. force never makes a request larger ------------------------------------------------------


async def test_force_never_forwards_a_larger_request(
    client: httpx.AsyncClient, fake: FakeUpstream
) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "welcome"},
        {"role": "user", "content": "bye"},
    ]
    response = await post(client, messages, **{"x-compaction": "force"})
    headers = response.headers
    assert headers["x-compaction-status"] == "skipped"
    assert headers["x-compaction-reason"] == "no_gain"
    assert headers["x-compaction-tokens-after"] == headers["x-compaction-tokens-before"]
    assert fake.forwarded[-1]["messages"] == messages
