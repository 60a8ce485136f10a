"""SimpleCompaction in the request path, against the kit's fake upstream."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from proxy.compaction.prompt import SUMMARY_MARKER, SYSTEM_PROMPT
from proxy.testing import Call, CompactionReport, Error, FakeOpenAI, Reply
from tests.upstream_fakes import summary_of

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def conversation(turns: int = 12, words: int = 120) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    for i in range(turns):
        messages.append(
            {
                "role": "user",
                "content": f"turn {i}: " + "please refactor the parser " * (words // 4),
            }
        )
        messages.append(
            {
                "role": "assistant",
                "content": f"done {i}: " + "I changed the tokenizer module " * (words // 5),
            }
        )
    messages.append(
        {"role": "user", "content": "What is the state now?", "x_vendor_field": {"keep": True}}
    )
    return messages


def request_body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "gpt-4o-mini",
        "messages": conversation(),
        "tools": TOOLS,
        "temperature": 0.2,
        "unknown_top_level": {"nested": [1, 2, 3]},
        **extra,
    }


# The reference's cut: the last 2 user/assistant messages, no task or ask carried verbatim
# (tests/test_compaction_rules.py covers the proxy's defaults).
REFERENCE = {"keep_recent_ratio": 0, "protect_task": False, "keep_last_user_message": False}
pytestmark = pytest.mark.compaction_proxy(
    compaction={"budget_tokens": 1000, **REFERENCE}, cache={"backend": "none"}
)
SUMMARY = "SUMMARY: the user is building a parser; tests pass."
CHAT = "/v1/chat/completions"


def forwarded_raw(fake: FakeOpenAI) -> list[bytes]:
    return [call.request.content for call in fake.chat_calls]


async def test_over_budget_request_is_compacted_with_one_summarizer_call(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    fake_openai.summaries = [Reply(SUMMARY, usage={"prompt_tokens": 1234, "completion_tokens": 56})]
    body = request_body()
    response = await proxy_client.post(
        CHAT,
        json=body,
        headers={"authorization": "Bearer sk-client", "openai-organization": "org-7"},
    )
    assert response.status_code == 200
    # the summary is never returned to the client: the reply is the forwarded call's
    assert response.headers["x-fake-openai"] == "chat"
    assert response.json()["choices"][0]["message"]["content"] == fake_openai.reply_text

    (call,) = fake_openai.summarizer_calls
    assert call.messages[0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert "tools" not in call.body and "tool_choice" not in call.body
    assert call.body["max_tokens"] == 2000
    assert call.model == "gpt-4o-mini"
    assert call.body["stream"] is False
    # billed to the client's own key and organization
    assert call.headers["authorization"] == "Bearer sk-client"
    assert call.headers["openai-organization"] == "org-7"

    (forwarded,) = fake_openai.chat_calls
    original = body["messages"]
    sent = forwarded.messages
    assert sent[0] == original[0]  # pinned system prompt, in place
    assert sent[1]["role"] == "user"
    assert sent[1]["content"] == f"{SUMMARY_MARKER}\n{SUMMARY}"
    assert sent[2:] == original[-2:]  # the preserved tail, verbatim (vendor field included)
    assert sent[-1]["x_vendor_field"] == {"keep": True}
    for key in ("tools", "temperature", "unknown_top_level", "model"):
        assert forwarded.body[key] == body[key]

    report = CompactionReport.from_headers(response.headers)
    assert report.status == "compacted"
    assert report.tokens_before is not None and report.tokens_after is not None
    assert report.tokens_before > 1000 > report.tokens_after
    assert report.budget == 1000
    assert report.messages_summarized == len(original) - 3
    assert report.summary_input_tokens == 1234
    assert report.summary_output_tokens == 56
    assert report.overhead_ms is not None and report.overhead_ms > 0


async def test_streaming_request_is_compacted_and_streamed(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    response = await proxy_client.post(CHAT, json=request_body(stream=True))
    assert response.headers["x-compaction-status"] == "compacted"
    assert response.headers["cache-control"] == "no-cache"
    assert len(fake_openai.summarizer_calls) == 1
    (forwarded,) = fake_openai.chat_calls
    assert forwarded.stream is True
    assert summary_of(forwarded.messages) is not None
    # relayed byte for byte: what the fake streams for the forwarded request, sent to it directly
    async with httpx.AsyncClient() as direct:
        streamed = await direct.post(str(forwarded.request.url), content=forwarded.request.content)
    assert response.content == streamed.content
    assert streamed.headers["content-type"] == "text/event-stream"


@pytest.mark.parametrize("status", [500, 503])
async def test_summarizer_failure_forwards_original_bytes(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI, status: int
) -> None:
    fake_openai.summaries = lambda call: Error(status)
    raw = json.dumps(request_body()).encode()
    response = await proxy_client.post(CHAT, content=raw)
    assert response.status_code == 200
    assert forwarded_raw(fake_openai) == [raw]
    assert response.headers["x-compaction-status"] == "failed"
    assert response.headers["x-compaction-reason"] == f"summarizer_http_{status}"
    assert len(fake_openai.summarizer_calls) == 3  # first try + 2 retries on 5xx


@pytest.mark.compaction_proxy(
    compaction={"summarizer": {"retries": 0}}, cache={"backend": "memory"}
)
async def test_summarizer_timeout_forwards_unchanged(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    def timeout(call: Call) -> None:
        raise httpx.ReadTimeout("slow summarizer", request=call.request)

    fake_openai.summaries = timeout
    raw = json.dumps(request_body()).encode()
    response = await proxy_client.post(CHAT, content=raw)
    assert response.status_code == 200
    assert forwarded_raw(fake_openai) == [raw]
    assert response.headers["x-compaction-status"] == "failed"
    assert response.headers["x-compaction-reason"] == "summarizer_timeout"


@pytest.mark.compaction_proxy(
    compaction={"on_error": "reject", "summarizer": {"retries": 0}}, cache={"backend": "memory"}
)
async def test_on_error_reject_answers_502(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    fake_openai.summaries = lambda call: Error(500)
    response = await proxy_client.post(CHAT, json=request_body())
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "compaction_failed"
    assert response.headers["x-compaction-status"] == "failed"
    assert fake_openai.chat_calls == []


@pytest.mark.compaction_proxy(
    compaction={"summarizer": {"retries": 0, "breaker_failures": 2, "breaker_cooldown_s": 600}},
    cache={"backend": "memory"},
)
async def test_breaker_stops_calling_a_failing_summarizer(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    fake_openai.summaries = lambda call: Error(500)
    reasons = []
    for _ in range(4):
        response = await proxy_client.post(CHAT, json=request_body())
        reasons.append(response.headers["x-compaction-reason"])
    assert reasons == [
        "summarizer_http_500",
        "summarizer_http_500",
        "circuit_open",
        "circuit_open",
    ]
    assert len(fake_openai.summarizer_calls) == 2
    assert len(fake_openai.chat_calls) == 4


async def test_under_budget_passes_through(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    raw = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}).encode()
    response = await proxy_client.post(CHAT, content=raw)
    assert response.headers["x-compaction-status"] == "passthrough"
    assert forwarded_raw(fake_openai) == [raw]
    assert fake_openai.summarizer_calls == []


async def test_off_header_disables_and_force_compacts_under_budget(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    response = await proxy_client.post(CHAT, json=request_body(), headers={"x-compaction": "off"})
    assert response.headers["x-compaction-status"] == "off"
    assert fake_openai.summarizer_calls == []

    small = {"model": "gpt-4o", "messages": conversation(turns=3, words=8)}
    response = await proxy_client.post(CHAT, json=small, headers={"x-compaction": "force"})
    assert response.headers["x-compaction-status"] == "compacted"
    assert len(fake_openai.summarizer_calls) == 1


@pytest.mark.compaction_proxy(compaction={"models": {"gpt-4o-mini": {"budget_tokens": 50_000}}})
async def test_budget_header_and_per_model_budget(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    response = await proxy_client.post(CHAT, json=request_body())
    assert response.headers["x-compaction-budget"] == "50000"
    assert response.headers["x-compaction-status"] == "passthrough"
    response = await proxy_client.post(
        CHAT, json=request_body(), headers={"x-compaction-budget": "900"}
    )
    assert response.headers["x-compaction-budget"] == "900"
    assert response.headers["x-compaction-status"] == "compacted"
    assert len(fake_openai.summarizer_calls) == 1


async def test_too_few_messages_is_skipped(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "word " * 3000}]}
    response = await proxy_client.post(CHAT, json=body)
    assert response.headers["x-compaction-status"] == "skipped"
    assert response.headers["x-compaction-reason"] == "nothing_to_compact"
    assert fake_openai.summarizer_calls == []


async def test_no_progress_guard_skips_when_tail_alone_is_over_budget(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    messages = conversation(turns=4, words=8)
    messages[-1] = {"role": "user", "content": "huge paste " * 2000}
    response = await proxy_client.post(CHAT, json={"model": "gpt-4o", "messages": messages})
    assert response.headers["x-compaction-status"] == "skipped"
    assert response.headers["x-compaction-reason"] == "preserved_over_budget"
    assert fake_openai.summarizer_calls == []
    assert len(fake_openai.chat_calls) == 1


@pytest.mark.compaction_proxy(compaction={"summary_role": "system"})
async def test_summary_role_is_configurable(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    await proxy_client.post(CHAT, json=request_body())
    summary = summary_of(fake_openai.last_forwarded_messages)
    assert summary is not None and summary["role"] == "system"


@pytest.mark.compaction_proxy(
    compaction={"summarizer": {"model": "gpt-4.1-nano", "api_key": "sk-summarizer"}}
)
async def test_summarizer_settings_override_model_and_key(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    await proxy_client.post(
        CHAT, json=request_body(), headers={"authorization": "Bearer sk-client"}
    )
    (summarizer,) = fake_openai.summarizer_calls
    assert summarizer.model == "gpt-4.1-nano"
    assert summarizer.headers["authorization"] == "Bearer sk-summarizer"
    assert fake_openai.chat_calls[0].headers["authorization"] == "Bearer sk-client"


async def test_compaction_log_line_has_no_content(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="proxy.compaction")
    await proxy_client.post(
        CHAT, json=request_body(), headers={"authorization": "Bearer sk-secret-key"}
    )
    records = [r for r in caplog.records if r.name == "proxy.compaction"]
    assert len(records) == 1
    event = records[0].__dict__  # fields of the record, not JSON inside its message
    assert event["status"] == "compacted" and event["tokens_before"] > event["tokens_after"]
    assert "refactor" not in caplog.text and "sk-secret" not in caplog.text
