"""SimpleCompaction in the request path, against a respx upstream (issue 4)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import respx

from proxy.app import create_app
from proxy.compaction.prompt import SUMMARY_MARKER, SYSTEM_PROMPT
from tests.conftest import make_settings
from tests.upstream_fakes import REPLY, SSE, FakeUpstream, summary_of

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


async def app_client(**sections: Any) -> AsyncIterator[httpx.AsyncClient]:
    compaction = {"budget_tokens": 1000, **REFERENCE, **sections.pop("compaction", {})}
    settings = make_settings(compaction=compaction, **sections)
    app = create_app(settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as c:
        yield c


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:  # overrides conftest: budget 1000
    async for c in app_client(cache={"backend": "none"}):
        yield c


@pytest.fixture
def fake(upstream: respx.MockRouter) -> FakeUpstream:
    return FakeUpstream().install(upstream)


async def test_over_budget_request_is_compacted_with_one_summarizer_call(
    client: httpx.AsyncClient, fake: FakeUpstream
) -> None:
    body = request_body()
    response = await client.post(
        "/v1/chat/completions",
        json=body,
        headers={"authorization": "Bearer sk-client", "openai-organization": "org-7"},
    )
    assert response.status_code == 200
    assert response.json() == REPLY  # the summary is never returned to the client

    assert len(fake.summary_calls) == 1
    call = fake.summary_calls[0]
    assert call["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert "tools" not in call and "tool_choice" not in call
    assert call["max_tokens"] == 2000
    assert call["model"] == "gpt-4o-mini"
    assert call["stream"] is False
    # billed to the client's own key and organization
    assert fake.summary_requests[0].headers["authorization"] == "Bearer sk-client"
    assert fake.summary_requests[0].headers["openai-organization"] == "org-7"

    (forwarded,) = fake.forwarded
    original = body["messages"]
    sent = forwarded["messages"]
    assert sent[0] == original[0]  # pinned system prompt, in place
    assert sent[1]["role"] == "user"
    assert sent[1]["content"] == f"{SUMMARY_MARKER}\n{fake.summary_text}"
    assert sent[2:] == original[-2:]  # the preserved tail, verbatim (vendor field included)
    assert sent[-1]["x_vendor_field"] == {"keep": True}
    for key in ("tools", "temperature", "unknown_top_level", "model"):
        assert forwarded[key] == body[key]

    headers = response.headers
    assert headers["x-compaction-status"] == "compacted"
    before = int(headers["x-compaction-tokens-before"])
    after = int(headers["x-compaction-tokens-after"])
    assert before > 1000 > after
    assert headers["x-compaction-budget"] == "1000"
    assert headers["x-compaction-messages-summarized"] == str(len(original) - 3)
    assert headers["x-compaction-summary-input-tokens"] == "1234"
    assert headers["x-compaction-summary-output-tokens"] == "56"
    assert float(headers["x-compaction-overhead-ms"]) > 0


async def test_streaming_request_is_compacted_and_streamed(
    client: httpx.AsyncClient, fake: FakeUpstream
) -> None:
    response = await client.post("/v1/chat/completions", json=request_body(stream=True))
    assert response.content == SSE
    assert response.headers["x-compaction-status"] == "compacted"
    assert response.headers["cache-control"] == "no-cache"
    assert len(fake.summary_calls) == 1
    assert fake.forwarded[0]["stream"] is True
    assert summary_of(fake.forwarded[0]["messages"]) is not None


@pytest.mark.parametrize("status", [500, 503])
async def test_summarizer_failure_forwards_original_bytes(
    client: httpx.AsyncClient, fake: FakeUpstream, status: int
) -> None:
    fake.summary_status = status
    raw = json.dumps(request_body()).encode()
    response = await client.post("/v1/chat/completions", content=raw)
    assert response.status_code == 200
    assert fake.forwarded_raw == [raw]
    assert response.headers["x-compaction-status"] == "failed"
    assert response.headers["x-compaction-reason"] == f"summarizer_http_{status}"
    assert len(fake.summary_calls) == 3  # first try + 2 retries on 5xx


async def test_summarizer_timeout_forwards_unchanged(upstream: respx.MockRouter) -> None:
    fake = FakeUpstream()

    async def side_effect(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["messages"][0].get("content") == SYSTEM_PROMPT:
            raise httpx.ReadTimeout("slow summarizer", request=request)
        return await fake(request)

    upstream.post("/chat/completions").mock(side_effect=side_effect)
    async for client in app_client(compaction={"summarizer": {"retries": 0}}):
        raw = json.dumps(request_body()).encode()
        response = await client.post("/v1/chat/completions", content=raw)
        assert response.status_code == 200
        assert fake.forwarded_raw == [raw]
        assert response.headers["x-compaction-status"] == "failed"
        assert response.headers["x-compaction-reason"] == "summarizer_timeout"


async def test_on_error_reject_answers_502(upstream: respx.MockRouter) -> None:
    fake = FakeUpstream(summary_status=500).install(upstream)
    async for client in app_client(compaction={"on_error": "reject", "summarizer": {"retries": 0}}):
        response = await client.post("/v1/chat/completions", json=request_body())
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["code"] == "compaction_failed"
        assert response.headers["x-compaction-status"] == "failed"
        assert fake.forwarded == []


async def test_breaker_stops_calling_a_failing_summarizer(upstream: respx.MockRouter) -> None:
    fake = FakeUpstream(summary_status=500).install(upstream)
    settings = {"summarizer": {"retries": 0, "breaker_failures": 2, "breaker_cooldown_s": 600}}
    async for client in app_client(compaction=settings):
        reasons = []
        for _ in range(4):
            response = await client.post("/v1/chat/completions", json=request_body())
            reasons.append(response.headers["x-compaction-reason"])
        assert reasons == [
            "summarizer_http_500",
            "summarizer_http_500",
            "circuit_open",
            "circuit_open",
        ]
        assert len(fake.summary_calls) == 2
        assert len(fake.forwarded) == 4


async def test_under_budget_passes_through(client: httpx.AsyncClient, fake: FakeUpstream) -> None:
    raw = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}).encode()
    response = await client.post("/v1/chat/completions", content=raw)
    assert response.headers["x-compaction-status"] == "passthrough"
    assert fake.forwarded_raw == [raw]
    assert fake.summary_calls == []


async def test_off_header_disables_and_force_compacts_under_budget(
    client: httpx.AsyncClient, fake: FakeUpstream
) -> None:
    response = await client.post(
        "/v1/chat/completions", json=request_body(), headers={"x-compaction": "off"}
    )
    assert response.headers["x-compaction-status"] == "off"
    assert fake.summary_calls == []

    small = {"model": "gpt-4o", "messages": conversation(turns=3, words=8)}
    response = await client.post(
        "/v1/chat/completions", json=small, headers={"x-compaction": "force"}
    )
    assert response.headers["x-compaction-status"] == "compacted"
    assert len(fake.summary_calls) == 1


async def test_budget_header_and_per_model_budget(upstream: respx.MockRouter) -> None:
    fake = FakeUpstream().install(upstream)
    per_model = {"models": {"gpt-4o-mini": {"budget_tokens": 50_000}}, "budget_tokens": 1000}
    async for client in app_client(compaction=per_model, cache={"backend": "none"}):
        response = await client.post("/v1/chat/completions", json=request_body())
        assert response.headers["x-compaction-budget"] == "50000"
        assert response.headers["x-compaction-status"] == "passthrough"
        response = await client.post(
            "/v1/chat/completions", json=request_body(), headers={"x-compaction-budget": "900"}
        )
        assert response.headers["x-compaction-budget"] == "900"
        assert response.headers["x-compaction-status"] == "compacted"
    assert len(fake.summary_calls) == 1


async def test_too_few_messages_is_skipped(client: httpx.AsyncClient, fake: FakeUpstream) -> None:
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "word " * 3000}]}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.headers["x-compaction-status"] == "skipped"
    assert response.headers["x-compaction-reason"] == "nothing_to_compact"
    assert fake.summary_calls == []


async def test_no_progress_guard_skips_when_tail_alone_is_over_budget(
    client: httpx.AsyncClient, fake: FakeUpstream
) -> None:
    messages = conversation(turns=4, words=8)
    messages[-1] = {"role": "user", "content": "huge paste " * 2000}
    response = await client.post(
        "/v1/chat/completions", json={"model": "gpt-4o", "messages": messages}
    )
    assert response.headers["x-compaction-status"] == "skipped"
    assert response.headers["x-compaction-reason"] == "preserved_over_budget"
    assert fake.summary_calls == []
    assert len(fake.forwarded) == 1


async def test_summary_role_is_configurable(upstream: respx.MockRouter) -> None:
    fake = FakeUpstream().install(upstream)
    async for client in app_client(
        compaction={"summary_role": "system"}, cache={"backend": "none"}
    ):
        await client.post("/v1/chat/completions", json=request_body())
    summary = summary_of(fake.forwarded[0]["messages"])
    assert summary is not None and summary["role"] == "system"


async def test_summarizer_settings_override_model_and_key(upstream: respx.MockRouter) -> None:
    fake = FakeUpstream().install(upstream)
    summarizer = {"model": "gpt-4.1-nano", "api_key": "sk-summarizer"}
    async for client in app_client(
        compaction={"summarizer": summarizer}, cache={"backend": "none"}
    ):
        await client.post(
            "/v1/chat/completions",
            json=request_body(),
            headers={"authorization": "Bearer sk-client"},
        )
    assert fake.summary_calls[0]["model"] == "gpt-4.1-nano"
    assert fake.summary_requests[0].headers["authorization"] == "Bearer sk-summarizer"
    assert fake.forwarded_requests[0].headers["authorization"] == "Bearer sk-client"


async def test_compaction_log_line_has_no_content(
    client: httpx.AsyncClient, fake: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="proxy.compaction")
    await client.post(
        "/v1/chat/completions",
        json=request_body(),
        headers={"authorization": "Bearer sk-secret-key"},
    )
    records = [r for r in caplog.records if r.name == "proxy.compaction"]
    assert len(records) == 1
    event = records[0].__dict__  # fields of the record, not JSON inside its message
    assert event["status"] == "compacted" and event["tokens_before"] > event["tokens_after"]
    assert "refactor" not in caplog.text and "sk-secret" not in caplog.text
