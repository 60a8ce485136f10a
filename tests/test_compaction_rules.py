"""The proxy's compaction promises, against a respx upstream: the budget holds whenever the
status says compacted/extended/reused, the task and the latest ask survive verbatim, an
agent's injected complaint never pins the cut, and the tail is measured in tokens."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import respx

from proxy.app import create_app
from proxy.compaction.prompt import SUMMARY_MARKER
from proxy.compaction.strategies import BUILT_IN
from proxy.settings import ConfigError, Settings
from proxy.tokens import TokenCounter
from tests.agent_sim import TOOLS
from tests.conftest import make_settings, respx_app
from tests.upstream_fakes import FakeUpstream, summary_of

SYSTEM = {"role": "system", "content": "You are a coding agent."}
TASK = {"role": "user", "content": "Fix the CSV importer: amounts like 1.234,56 are dropped."}
COMPLAINT = {
    "role": "user",
    "content": "Tool call error: could not parse your reply. Please reply with exactly one "
    "tool call.",
}


def tool_turn(i: int, words: int = 120) -> list[dict[str, Any]]:
    call = {"id": f"c{i}", "type": "function", "function": {"name": "run", "arguments": "{}"}}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"c{i}", "content": f"out {i} " + "log line " * words},
    ]


def agent(turns: int, *, complaint_at: int | None = None, words: int = 120) -> list[Any]:
    messages: list[Any] = [SYSTEM, TASK]
    for i in range(turns):
        if i == complaint_at:
            messages += [{"role": "assistant", "content": "I will now run it"}, COMPLAINT]
        messages += tool_turn(i, words)
    return messages


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    counter = TokenCounter(Settings())
    counter.load()
    return counter


@pytest.fixture
def fake(upstream: respx.MockRouter) -> FakeUpstream:
    return FakeUpstream(numbered=True).install(upstream)


async def open_client(**compaction: Any) -> httpx.AsyncClient:
    cache = compaction.pop("cache", {"backend": "memory"})
    compaction = {"budget_tokens": 2000, "keep_recent_ratio": 0.5, **compaction}
    settings = make_settings(compaction=compaction, cache=cache)
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=respx_app(settings)), base_url="http://p"
    )


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with await open_client() as c:
        yield c


async def post(client: httpx.AsyncClient, messages: list[Any], **headers: str) -> httpx.Response:
    response = await client.post(
        "/v1/chat/completions",
        json={"model": "gpt-4o-mini", "messages": messages, "tools": TOOLS},
        headers={"authorization": "Bearer sk-rules", **headers},
    )
    assert response.status_code == 200, response.text
    return response


def assert_valid(sent: list[dict[str, Any]]) -> None:
    assert sent[0] == SYSTEM
    called: set[str] = set()
    for message in sent:
        called.update(c["id"] for c in message.get("tool_calls") or [])
        if message["role"] == "tool":
            assert message["tool_call_id"] in called, "orphaned tool result"
    answered = {m["tool_call_id"] for m in sent if m["role"] == "tool"}
    assert called == answered, "tool call without its result"


def forwarded_tokens(counter: TokenCounter, fake: FakeUpstream) -> int:
    return counter.count_request(fake.forwarded[-1])


# -- budget as a guarantee --------------------------------------------------------------------


async def test_a_summary_too_big_for_the_tail_moves_the_cut_forward(
    fake: FakeUpstream, counter: TokenCounter
) -> None:
    fake.summary_text = "S " + "fact " * 1300  # with three tool turns kept: too big
    async with await open_client(keep_recent_ratio=0.6) as client:
        response = await post(client, agent(30))
    headers = response.headers
    assert headers["x-compaction-status"] == "compacted"
    assert len(fake.summary_calls) == 2  # the first summary, then its extension
    after = int(headers["x-compaction-tokens-after"])
    assert after == forwarded_tokens(counter, fake) <= 2000
    assert_valid(fake.forwarded[-1]["messages"])


async def test_nothing_fits_is_over_budget_and_says_so(
    client: httpx.AsyncClient, fake: FakeUpstream, counter: TokenCounter
) -> None:
    fake.summary_text = "S " + "fact " * 2500  # alone larger than the budget
    messages = agent(30)
    response = await post(client, messages)
    headers = response.headers
    assert headers["x-compaction-status"] == "over_budget"
    assert headers["x-compaction-reason"] == "over_budget"
    after = int(headers["x-compaction-tokens-after"])
    assert after == forwarded_tokens(counter, fake) > 2000
    assert after < int(headers["x-compaction-tokens-before"])
    sent = fake.forwarded[-1]["messages"]
    assert_valid(sent)
    assert sent[-2:] == messages[-2:]  # the smallest valid tail: the last call and its result
    assert sent[1] == TASK and summary_of([sent[2]]) is not None


async def test_a_stored_summary_that_no_longer_fits_is_not_reused_silently(
    fake: FakeUpstream, counter: TokenCounter
) -> None:
    fake.summary_text = "S " + "fact " * 600
    messages = agent(30)
    async with await open_client(keep_recent_ratio=0.9) as client:
        first = await post(client, messages)
        assert first.headers["x-compaction-status"] == "compacted"
        # The same history under a smaller budget: the stored summary's result is over it.
        again = await post(client, messages, **{"x-compaction-budget": "1400"})
    status = again.headers["x-compaction-status"]
    after = int(again.headers["x-compaction-tokens-after"])
    assert after == forwarded_tokens(counter, fake)
    assert status == "extended" and after <= 1400
    assert again.headers["x-compaction-cache"] == "partial"


async def test_preserved_tail_over_budget_with_a_big_history_still_compacts(
    client: httpx.AsyncClient, fake: FakeUpstream
) -> None:
    """The last tool output alone is over the budget, but there is a lot a summary can
    replace: forward the smallest valid request (reported over_budget), not the original."""
    messages = [*agent(40), *tool_turn(99, words=2500)]
    response = await post(client, messages)
    headers = response.headers
    assert headers["x-compaction-status"] == "over_budget"
    assert int(headers["x-compaction-tokens-after"]) < int(headers["x-compaction-tokens-before"])
    assert fake.forwarded[-1]["messages"][-2:] == messages[-2:]


# -- the task and the latest ask --------------------------------------------------------------


async def test_the_task_stays_verbatim_after_the_pinned_messages(
    client: httpx.AsyncClient, fake: FakeUpstream
) -> None:
    response = await post(client, agent(30))
    assert response.headers["x-compaction-status"] == "compacted"
    assert response.headers["x-compaction-task"] == "verbatim"
    sent = fake.forwarded[-1]["messages"]
    assert sent[:2] == [SYSTEM, TASK]
    assert sent[2]["content"].startswith(SUMMARY_MARKER)
    assert_valid(sent)


async def test_a_task_over_its_cap_is_summarized_and_the_headers_say_so(
    fake: FakeUpstream,
) -> None:
    async with await open_client(task_max_tokens=5) as client:
        response = await post(client, agent(30))
    assert response.headers["x-compaction-task"] == "summarized"
    sent = fake.forwarded[-1]["messages"]
    assert TASK not in sent and summary_of([sent[1]]) is not None
    assert "1.234,56" in fake.summary_calls[0]["messages"][1]["content"]  # in the summary


async def test_an_injected_complaint_is_not_carried_and_does_not_pin_the_cut(
    fake: FakeUpstream,
) -> None:
    """The agent's parse-error message mid-loop is summarized like tool output once the cut
    passes it; the task is what stays verbatim, and every turn the cut moves forward."""
    async with await open_client(cache={"backend": "none"}) as client:
        summarized: list[int] = []
        for turns in range(26, 40):
            messages = agent(turns, complaint_at=10)
            response = await post(client, messages)
            assert response.headers["x-compaction-status"] == "compacted"
            sent = fake.forwarded[-1]["messages"]
            assert sent[:2] == [SYSTEM, TASK]
            assert COMPLAINT not in sent
            assert_valid(sent)
            summarized.append(int(response.headers["x-compaction-messages-summarized"]))
    # Without a store every turn pays, but never twice for the same span.
    assert all(a < b for a, b in itertools.pairwise(summarized)), summarized


async def test_the_latest_real_ask_is_carried_verbatim_after_the_summary(
    client: httpx.AsyncClient, fake: FakeUpstream
) -> None:
    ask = {"role": "user", "content": "Now also handle negative amounts like -12,50."}
    messages = [*agent(10), {"role": "assistant", "content": "Done."}, ask]
    for i in range(100, 125):
        messages += tool_turn(i)
    response = await post(client, messages)
    assert response.headers["x-compaction-status"] == "compacted"
    sent = fake.forwarded[-1]["messages"]
    assert sent[:2] == [SYSTEM, TASK]
    assert sent[3] == ask  # right after the summary
    assert_valid(sent)


# -- the token-aware tail ---------------------------------------------------------------------


async def test_the_tail_fills_the_kept_share_of_what_the_budget_leaves(
    fake: FakeUpstream, counter: TokenCounter
) -> None:
    """keep_recent_ratio is a share of what remains of the budget after the tools, the
    pinned messages, the task and the summary reserve (min(summary_max_tokens, budget/4))."""
    kept: dict[float, int] = {}
    for ratio in (0.0, 0.5):
        async with await open_client(keep_recent_ratio=ratio) as client:
            response = await post(client, agent(30))
        assert response.headers["x-compaction-status"] == "compacted"
        sent = fake.forwarded[-1]["messages"]
        kept[ratio] = sum(counter.count_each("gpt-4o-mini", sent[3:]))
    tools = counter.count_tools("gpt-4o-mini", {"tools": TOOLS})
    pinned_and_task = sum(counter.count_each("gpt-4o-mini", [SYSTEM, TASK]))
    room = 2000 - tools - pinned_and_task - min(2000, 2000 // 4)
    assert kept[0.0] < 600  # two user/assistant messages: the last two calls and results
    assert room // 2 - 260 <= kept[0.5] <= room // 2  # within one tool turn of half the room


async def test_with_the_store_the_summary_is_reused_until_the_tail_outgrows_the_budget(
    client: httpx.AsyncClient, fake: FakeUpstream
) -> None:
    statuses = []
    for turns in range(26, 46):
        response = await post(client, agent(turns))
        statuses.append(response.headers["x-compaction-status"])
        assert int(response.headers["x-compaction-tokens-after"]) <= 2000
    assert statuses[0] == "compacted"
    assert set(statuses) == {"compacted", "reused", "extended"}, statuses
    assert statuses.count("reused") > statuses.count("extended")


# -- strategies -------------------------------------------------------------------------------


def test_an_unknown_strategy_fails_at_start() -> None:
    for name in ("nope", "no_such_module:Factory", "proxy.compaction.simple:Missing"):
        with pytest.raises(ConfigError, match=r"compaction\.strategy"):
            create_app(make_settings(compaction={"strategy": name}))


def test_the_store_namespace_is_the_strategys_fingerprint() -> None:
    """Summaries made under one strategy (or one prompt setting) are never reused by another."""

    def namespace(**compaction: Any) -> str:
        compactor = create_app(make_settings(compaction=compaction)).state.proxy.compactor
        return str(compactor.stages_for("m")[-1].namespace)

    simple = namespace(strategy="simple")
    assert simple == namespace(strategy="simple", max_preserved_messages=5, keep_recent_ratio=0.2)
    assert simple == namespace()  # the default, hybrid: what masking leaves is hashed as sent
    assert simple != namespace(strategy="structured")
    assert simple != namespace(strategy="simple", summary_max_tokens=999)
    assert simple != namespace(strategy="simple", custom_instruction="keep SQL")
    assert simple != namespace(strategy="simple", summary_role="system")


def test_stages_are_made_once_per_summarizer_model_and_bounded() -> None:
    compactor = create_app(make_settings(compaction={"strategy": "hybrid"})).state.proxy.compactor
    first = compactor.stages_for("m")
    assert [stage.name for stage in first] == ["mask", "simple"]
    assert compactor.stages_for("m") is first
    other = compactor.stages_for("other-model")
    assert other is not first and other[-1].namespace != first[-1].namespace
    for i in range(200):
        compactor.stages_for(f"model-{i}")
    assert len(compactor._stages) <= 64


def test_a_loaded_strategy_is_made_once_per_summarizer_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A strategy holds nothing of a request: its factory is asked once at start (the check)
    and once per summarizer model."""
    made: list[object] = []

    def factory(options: Any) -> object:
        made.append(options)
        return BUILT_IN["simple"][1](options)

    import proxy.compaction.strategies as strategies

    monkeypatch.setattr(strategies, "_test_factory", factory, raising=False)
    compactor = create_app(
        make_settings(compaction={"strategy": "proxy.compaction.strategies:_test_factory"})
    ).state.proxy.compactor
    assert len(made) == 1  # checked at start
    assert compactor.stages_for("m") is compactor.stages_for("m")
    compactor.stages_for("n")
    assert len(made) == 3


async def test_a_long_history_is_cut_off_the_event_loop(
    fake: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cutting and hashing cost ~25 ms per 10k messages: a long history is cut in a worker
    thread so other requests keep being served; a short one stays on the loop."""
    import threading

    from proxy.compaction import cut as cut_module

    threads: list[int] = []
    real = cut_module.plan_cut

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(cut_module, "plan_cut", recording)
    async with await open_client(budget_tokens=5000, strategy="simple") as client:
        await post(client, agent(20, words=200))
        await post(client, agent(2600, words=2))  # 5,202 messages
    loop_thread = threading.get_ident()
    assert threads[0] == loop_thread and threads[1] != loop_thread


async def test_a_stored_summary_over_budget_at_the_last_cut_is_over_budget_not_reused(
    client: httpx.AsyncClient, fake: FakeUpstream, counter: TokenCounter
) -> None:
    fake.summary_text = "S " + "fact " * 600
    messages = agent(30)
    assert (await post(client, messages)).headers["x-compaction-status"] == "compacted"
    small = {"x-compaction-budget": "900"}  # below task + this summary + the last two calls
    first = await post(client, messages, **small)
    calls = len(fake.summary_calls)
    again = await post(client, messages, **small)
    assert first.headers["x-compaction-status"] == again.headers["x-compaction-status"]
    assert again.headers["x-compaction-status"] == "over_budget"
    assert again.headers["x-compaction-cache"] == "hit"
    assert len(fake.summary_calls) == calls  # nothing paid twice for the same span
    assert int(again.headers["x-compaction-tokens-after"]) == forwarded_tokens(counter, fake)
    assert fake.forwarded[-1]["messages"][-2:] == messages[-2:]


# -- the default strategy ---------------------------------------------------------------------


@pytest.mark.parametrize(("budget", "summarized"), [(8000, False), (3000, True)])
async def test_the_default_masks_old_tool_outputs_first_and_holds_the_budget(
    fake: FakeUpstream, counter: TokenCounter, budget: int, summarized: bool
) -> None:
    """The default strategy is hybrid: old tool outputs give way to stubs (no LLM call); a
    summary is made only when what masking leaves is still over the budget, and either way
    the forwarded request is within it."""
    settings = make_settings(compaction={"budget_tokens": budget})
    assert settings.compaction.strategy == Settings().compaction.strategy == "hybrid"
    app = respx_app(settings)
    assert [stage.name for stage in app.state.proxy.compactor.stages_for("m")] == [
        "mask", "simple"
    ]  # fmt: skip
    messages = agent(20, words=300)  # ~12k tokens, nearly all of it tool output
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as c:
        response = await post(c, messages)
    await app.state.proxy.upstream.client.aclose()
    headers = response.headers
    assert int(headers["x-compaction-tokens-before"]) > budget
    assert headers["x-compaction-status"] == "compacted"
    assert int(headers["x-compaction-messages-masked"]) > 0
    after = int(headers["x-compaction-tokens-after"])
    assert after == forwarded_tokens(counter, fake) <= budget
    sent = fake.forwarded[-1]["messages"]
    assert_valid(sent)
    assert sent[1] == TASK and sent[-1] == messages[-1]
    assert (int(headers["x-compaction-messages-summarized"]) > 0) is summarized
    assert len(fake.summary_calls) == (1 if summarized else 0)
    if not summarized:  # masking alone: every message kept, only old outputs' content stubbed
        assert [m["role"] for m in sent] == [m["role"] for m in messages]
        assert sum(m != o for m, o in zip(sent, messages, strict=True)) == int(
            headers["x-compaction-messages-masked"]
        )
