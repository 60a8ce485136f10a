"""UpstreamSummarizer against a respx-mocked upstream, and the CircuitBreaker, on a fake clock."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import respx
from compaction_fakes import FakeClock

from proxy.compaction.prompt import SUMMARY_MARKER, SYSTEM_PROMPT
from proxy.compaction.protocol import Summarizer, SummarizerError, Usage
from proxy.compaction.simple import SimpleCompaction
from proxy.compaction.summarizer import (
    CircuitBreaker,
    UpstreamSummarizer,
    uses_max_completion_tokens,
)

BASE = "http://summarizer.test/v1"
URL = BASE + "/chat/completions"
USER = [{"role": "user", "content": "## Message 1\nRole: user\nContent:\nhi"}]


def reply(content: Any = "the summary", **message: Any) -> httpx.Response:
    body = {
        "choices": [{"message": {"role": "assistant", "content": content, **message}}],
        "usage": {"prompt_tokens": 120, "completion_tokens": 30},
    }
    return httpx.Response(200, json=body)


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


@pytest.fixture
def mock() -> Iterator[respx.MockRouter]:
    with respx.mock(assert_all_called=False) as router:
        yield router


def make(
    http: httpx.AsyncClient, clock: FakeClock, model: str = "gpt-4o-mini", **kwargs: Any
) -> UpstreamSummarizer:
    return UpstreamSummarizer(
        http,
        base_url=BASE + "/",
        model=model,
        headers={"Authorization": "Bearer sk-client"},
        clock=clock,
        sleep=clock.sleep,
        jitter=lambda: 1.0,
        **kwargs,
    )


def sent(route: respx.Route, index: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(route.calls[index].request.content)
    return body


async def test_one_call_with_the_right_shape(
    http: httpx.AsyncClient, mock: respx.MockRouter, clock: FakeClock
) -> None:
    route = mock.post(URL).mock(return_value=reply("<think>hmm</think>\nthe summary"))
    summarizer = make(http, clock)
    assert isinstance(summarizer, Summarizer)

    summary = await summarizer.summarize(SYSTEM_PROMPT, USER)

    assert route.call_count == 1
    body = sent(route)
    assert body["messages"] == [{"role": "system", "content": SYSTEM_PROMPT}, *USER]
    assert "tools" not in body and "tool_choice" not in body
    assert body["stream"] is False and body["model"] == "gpt-4o-mini"
    assert body["max_tokens"] == 2000 and "max_completion_tokens" not in body
    assert route.calls[0].request.headers["authorization"] == "Bearer sk-client"
    assert summary.text == "the summary"
    assert summary.usage == Usage(120, 30)


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("o1", True),
        ("o1-mini", True),
        ("o3-mini-2025-01-31", True),
        ("o4-mini", True),
        ("gpt-5", True),
        ("gpt-5-mini", True),
        ("gpt-5.1-codex", True),
        ("openai/o3", True),
        ("gpt-4o", False),
        ("gpt-4.1-mini", False),
        ("omni-moderation-latest", False),
        ("gpt-50", False),
        ("llama-3.1-8b", False),
    ],
)
def test_reasoning_families_use_max_completion_tokens(model: str, expected: bool) -> None:
    assert uses_max_completion_tokens(model) is expected


async def test_o_series_body_has_max_completion_tokens(
    http: httpx.AsyncClient, mock: respx.MockRouter, clock: FakeClock
) -> None:
    route = mock.post(URL).mock(return_value=reply())
    await make(http, clock, model="o3-mini", max_tokens=777).summarize(SYSTEM_PROMPT, USER)
    body = sent(route)
    assert body["max_completion_tokens"] == 777 and "max_tokens" not in body


async def test_reasoning_fields_and_parts_are_dropped(
    http: httpx.AsyncClient, mock: respx.MockRouter, clock: FakeClock
) -> None:
    parts = [{"type": "reasoning", "text": "R"}, {"type": "text", "text": "kept"}]
    mock.post(URL).mock(return_value=reply(parts, reasoning_content="long reasoning"))
    summary = await make(http, clock).summarize(SYSTEM_PROMPT, USER)
    assert summary.text == "kept"


async def test_retries_a_500_then_succeeds(
    http: httpx.AsyncClient, mock: respx.MockRouter, clock: FakeClock
) -> None:
    route = mock.post(URL).mock(side_effect=[httpx.Response(500), reply()])
    summary = await make(http, clock, backoff_base_s=0.5).summarize(SYSTEM_PROMPT, USER)
    assert summary.text == "the summary"
    assert route.call_count == 2
    assert clock.sleeps == [0.5]


async def test_429_honours_retry_after(
    http: httpx.AsyncClient, mock: respx.MockRouter, clock: FakeClock
) -> None:
    limited = httpx.Response(429, headers={"Retry-After": "7"})
    route = mock.post(URL).mock(side_effect=[limited, reply()])
    await make(http, clock).summarize(SYSTEM_PROMPT, USER)
    assert route.call_count == 2 and clock.sleeps == [7.0]


async def test_backoff_grows_and_retries_are_bounded(
    http: httpx.AsyncClient, mock: respx.MockRouter, clock: FakeClock
) -> None:
    route = mock.post(URL).mock(return_value=httpx.Response(503, text="overloaded"))
    with pytest.raises(SummarizerError) as info:
        await make(http, clock, retries=3, backoff_base_s=1.0).summarize(SYSTEM_PROMPT, USER)
    assert info.value.reason == "summarizer_http_503" and "overloaded" in str(info.value)
    assert route.call_count == 4
    assert clock.sleeps == [1.0, 2.0, 4.0]


async def test_backoff_is_jittered(http: httpx.AsyncClient, clock: FakeClock) -> None:
    low = UpstreamSummarizer(http, base_url=BASE, model="m", backoff_base_s=2.0, jitter=lambda: 0.0)
    assert low._backoff(0, None) == 1.0 and low._backoff(1, None) == 2.0


@pytest.mark.parametrize("status", [400, 401, 404, 422])
async def test_no_retry_on_other_4xx(
    status: int, http: httpx.AsyncClient, mock: respx.MockRouter, clock: FakeClock
) -> None:
    route = mock.post(URL).mock(return_value=httpx.Response(status, json={"error": "bad"}))
    with pytest.raises(SummarizerError) as info:
        await make(http, clock).summarize(SYSTEM_PROMPT, USER)
    assert info.value.reason == f"summarizer_http_{status}"
    assert route.call_count == 1 and clock.sleeps == []


async def test_connection_errors_are_retried_then_unreachable(
    http: httpx.AsyncClient, mock: respx.MockRouter, clock: FakeClock
) -> None:
    route = mock.post(URL).mock(side_effect=httpx.ConnectError("refused"))
    with pytest.raises(SummarizerError) as info:
        await make(http, clock, retries=2).summarize(SYSTEM_PROMPT, USER)
    assert info.value.reason == "summarizer_unreachable"
    assert route.call_count == 3


async def test_an_httpx_timeout_is_a_summarizer_timeout(
    http: httpx.AsyncClient, mock: respx.MockRouter, clock: FakeClock
) -> None:
    route = mock.post(URL).mock(side_effect=httpx.ReadTimeout("slow"))
    with pytest.raises(SummarizerError) as info:
        await make(http, clock).summarize(SYSTEM_PROMPT, USER)
    assert info.value.reason == "summarizer_timeout"
    assert route.call_count == 1  # the deadline covers the whole call: no retry after it


async def test_the_deadline_bounds_a_hanging_upstream(
    http: httpx.AsyncClient, mock: respx.MockRouter
) -> None:
    async def hang(request: httpx.Request) -> httpx.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    mock.post(URL).mock(side_effect=hang)
    summarizer = UpstreamSummarizer(http, base_url=BASE, model="m", timeout_s=0.05)
    with pytest.raises(SummarizerError) as info:
        await summarizer.summarize(SYSTEM_PROMPT, USER)
    assert info.value.reason == "summarizer_timeout"


async def test_no_retry_that_would_outlive_the_deadline(
    http: httpx.AsyncClient, mock: respx.MockRouter, clock: FakeClock
) -> None:
    route = mock.post(URL).mock(return_value=httpx.Response(502))
    summarizer = make(http, clock, timeout_s=10.0, retries=5, backoff_base_s=4.0)
    with pytest.raises(SummarizerError) as info:
        await summarizer.summarize(SYSTEM_PROMPT, USER)
    assert info.value.reason == "summarizer_http_502"
    assert clock.sleeps == [4.0]  # 4 s, then 8 s more would pass the 10 s deadline
    assert route.call_count == 2


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        (httpx.Response(200, text="<html>gateway</html>"), "summarizer_bad_response"),
        (httpx.Response(200, json={"choices": []}), "summarizer_bad_response"),
        (httpx.Response(200, json=["x"]), "summarizer_bad_response"),
        (reply(None, reasoning_content="all reasoning, no answer"), "summarizer_empty"),
        (reply("<think>cut off mid-thought"), "summarizer_empty"),
    ],
)
async def test_unusable_replies(
    response: httpx.Response,
    reason: str,
    http: httpx.AsyncClient,
    mock: respx.MockRouter,
    clock: FakeClock,
) -> None:
    route = mock.post(URL).mock(return_value=response)
    with pytest.raises(SummarizerError) as info:
        await make(http, clock).summarize(SYSTEM_PROMPT, USER)
    assert info.value.reason == reason and route.call_count == 1


# -- circuit breaker --------------------------------------------------------------------------


async def test_breaker_opens_after_n_failures_and_stops_calling(
    http: httpx.AsyncClient, mock: respx.MockRouter, clock: FakeClock
) -> None:
    breaker = CircuitBreaker(3, 30.0, clock=clock)
    route = mock.post(URL).mock(return_value=httpx.Response(500))

    for _ in range(3):
        with pytest.raises(SummarizerError):
            await make(http, clock, retries=0, breaker=breaker).summarize(SYSTEM_PROMPT, USER)
    assert route.call_count == 3 and breaker.state == "open"

    for _ in range(5):  # a fresh summarizer per request, the breaker shared
        with pytest.raises(SummarizerError) as info:
            await make(http, clock, retries=0, breaker=breaker).summarize(SYSTEM_PROMPT, USER)
        assert info.value.reason == "circuit_open"
    assert route.call_count == 3

    clock.advance(30.0)  # cool-down over: one trial, which fails and reopens the circuit
    with pytest.raises(SummarizerError) as info:
        await make(http, clock, retries=0, breaker=breaker).summarize(SYSTEM_PROMPT, USER)
    assert info.value.reason == "summarizer_http_500" and route.call_count == 4
    with pytest.raises(SummarizerError) as info:
        await make(http, clock, retries=0, breaker=breaker).summarize(SYSTEM_PROMPT, USER)
    assert info.value.reason == "circuit_open" and route.call_count == 4

    clock.advance(30.0)  # the next trial succeeds and closes it
    route.mock(return_value=reply())
    await make(http, clock, retries=0, breaker=breaker).summarize(SYSTEM_PROMPT, USER)
    assert breaker.state == "closed"
    await make(http, clock, retries=0, breaker=breaker).summarize(SYSTEM_PROMPT, USER)
    assert route.call_count == 6


async def test_client_errors_do_not_open_the_breaker(
    http: httpx.AsyncClient, mock: respx.MockRouter, clock: FakeClock
) -> None:
    breaker = CircuitBreaker(2, 30.0, clock=clock)
    route = mock.post(URL).mock(return_value=httpx.Response(401))
    for _ in range(5):
        with pytest.raises(SummarizerError):
            await make(http, clock, breaker=breaker).summarize(SYSTEM_PROMPT, USER)
    assert route.call_count == 5 and breaker.state == "closed"


def test_breaker_lets_one_trial_through_at_a_time(clock: FakeClock) -> None:
    breaker = CircuitBreaker(1, 10.0, clock=clock)
    breaker.record_failure()
    assert not breaker.allow()
    clock.advance(10.0)
    assert breaker.allow() and breaker.state == "half_open"
    assert not breaker.allow()  # the trial is in flight
    clock.advance(10.0)
    assert breaker.allow()  # a trial that never reported blocks for one cool-down only


async def test_a_cancelled_trial_frees_the_breaker(
    http: httpx.AsyncClient, mock: respx.MockRouter, clock: FakeClock
) -> None:
    breaker = CircuitBreaker(1, 10.0, clock=clock)
    breaker.record_failure()
    clock.advance(10.0)
    started = asyncio.Event()

    async def hang(request: httpx.Request) -> httpx.Response:
        started.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    mock.post(URL).mock(side_effect=hang)
    task = asyncio.create_task(make(http, clock, breaker=breaker).summarize(SYSTEM_PROMPT, USER))
    await started.wait()
    assert not breaker.allow()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert breaker.allow()


# -- end to end -------------------------------------------------------------------------------


async def test_compact_through_the_upstream_summarizer(
    http: httpx.AsyncClient, mock: respx.MockRouter, clock: FakeClock
) -> None:
    route = mock.post(URL).mock(return_value=reply("<think>x</think>short summary"))
    history = [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "reply"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "reply 2"},
        {"role": "user", "content": "third"},
    ]
    result = await SimpleCompaction(2).compact(history, make(http, clock))
    assert route.call_count == 1
    assert [m["content"] for m in result] == [
        "rules",
        f"{SUMMARY_MARKER}\nshort summary",
        "reply 2",
        "third",
    ]
    assert "## Message 3\nRole: user\nContent:\nsecond" in sent(route)["messages"][1]["content"]


async def test_a_summary_cut_off_by_max_tokens_is_kept_and_logged(
    http: httpx.AsyncClient,
    mock: respx.MockRouter,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    body = {
        "choices": [
            {"message": {"role": "assistant", "content": "part of a"}, "finish_reason": "length"}
        ],
        "usage": {"prompt_tokens": 120, "completion_tokens": 2000},
    }
    mock.post(URL).mock(return_value=httpx.Response(200, json=body))
    caplog.set_level("WARNING", logger="proxy.compaction")
    summary = await make(http, clock).summarize(SYSTEM_PROMPT, USER)
    assert summary.text == "part of a"
    assert "summary_max_tokens" in caplog.text

    caplog.clear()
    mock.post(URL).mock(return_value=reply("a whole summary"))
    await make(http, clock).summarize(SYSTEM_PROMPT, USER)
    assert caplog.text == ""
