"""POST /v1/compress, the compression-engine contract agentgateway calls: messages in,
messages out with `tokens_saved`, through the same compaction step."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import httpx
import pytest

from proxy.testing import FakeOpenAI, make_app
from tests.responses.shapes import check_forwarded, codex_history, responses_body

BUDGET = {"compaction": {"budget_tokens": 3000}}
AUTH = {"authorization": "Bearer sk-gateway"}


def chat_history(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the parser."},
    ]
    for i in range(turns):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "sh", "arguments": "{}"}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": "out " * 300})
    messages.append({"role": "user", "content": "What now?"})
    return messages


def paired(messages: list[dict[str, Any]]) -> bool:
    """agentgateway's check: every call id on both sides (chat and Responses shapes)."""
    calls = {c["id"] for m in messages for c in m.get("tool_calls") or []}
    calls |= {m["call_id"] for m in messages if str(m.get("type", "")).endswith("_call")}
    results = {m["tool_call_id"] for m in messages if m.get("role") == "tool"}
    results |= {m["call_id"] for m in messages if str(m.get("type", "")).endswith("_output")}
    return calls == results


# A summary, stored and reused: the summarizing strategy (by default, masking alone would
# bring these tool outputs under the budget).
@pytest.mark.compaction_proxy(compaction={"budget_tokens": 3000, "strategy": "simple"})
async def test_chat_messages_over_budget_come_back_compacted(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    messages = chat_history(20)
    body = {"messages": messages, "model": "gpt-4o"}
    reply = await proxy_client.post("/v1/compress", json=body, headers=AUTH)
    assert reply.status_code == 200
    data = reply.json()
    assert set(data) == {"messages", "tokens_saved"}
    before = int(reply.headers["x-compaction-tokens-before"])
    after = int(reply.headers["x-compaction-tokens-after"])
    assert data["tokens_saved"] == before - after > 0 and after <= 3000
    out = data["messages"]
    assert out[:2] == messages[:2] and out[-1] == messages[-1] and paired(out)
    assert len(fake_openai.summarizer_calls) == 1
    assert not fake_openai.chat_calls  # nothing forwarded: the gateway does that
    again = await proxy_client.post("/v1/compress", json=body, headers=AUTH)
    assert again.headers["x-compaction-status"] == "reused"  # the same store, the same scope
    assert again.json() == data
    # Without a credential (agentgateway forwards none by default) there is no store scope
    # unless cache.anonymous = "shared": summarized afresh.
    anonymous = await proxy_client.post("/v1/compress", json=body)
    assert anonymous.headers["x-compaction-cache"] == "none"


@pytest.mark.compaction_proxy(**BUDGET)
async def test_responses_items_are_read_as_items(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    items = codex_history(30)
    reply = await proxy_client.post("/v1/compress", json={"messages": items, "model": "gpt-4o"})
    assert reply.headers["x-compaction-status"] == "compacted"
    out = reply.json()["messages"]
    assert paired(out)
    sent = json.dumps(responses_body(items)).encode()
    check_forwarded(sent, json.dumps(responses_body(out)).encode())


@pytest.mark.compaction_proxy(**BUDGET)
async def test_under_budget_and_foreign_shapes_come_back_unchanged(
    proxy_client: httpx.AsyncClient,
) -> None:
    short = chat_history(1)
    reply = await proxy_client.post("/v1/compress", json={"messages": short, "model": "gpt-4o"})
    assert reply.json() == {"messages": short, "tokens_saved": 0}
    anthropic = [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "sh"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
    ]
    reply = await proxy_client.post("/v1/compress", json={"messages": anthropic})
    assert reply.json() == {"messages": anthropic, "tokens_saved": 0}
    assert reply.headers["x-compaction-reason"] == "unsupported_format"


@pytest.mark.parametrize(
    ("body", "param"),
    [({"model": "gpt-4o"}, "messages"), ({"messages": [1]}, "messages[0]"),
     ({"messages": [{"content": "no role"}]}, "messages[0].role")],
)  # fmt: skip
async def test_bad_bodies_get_openais_envelope(
    proxy_client: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    reply = await proxy_client.post("/v1/compress", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == param


async def test_with_keys_the_key_admits_and_its_budget_applies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = "sk-proxy-gateway-0123456789"
    entry = {
        "id": "gw",
        "key_sha256": hashlib.sha256(key.encode()).hexdigest(),
        "budget_tokens": 2500,
    }
    app = make_app(auth={"keys": [entry]}, compaction={"strategy": "simple"})  # summarized
    fake = FakeOpenAI()
    with fake.mock():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
                body = {"messages": chat_history(20), "model": "gpt-4o"}
                refused = await http.post("/v1/compress", json=body)
                assert refused.status_code == 401
                reply = await http.post(
                    "/v1/compress", json=body, headers={"authorization": f"Bearer {key}"}
                )
                assert reply.headers["x-compaction-budget"] == "2500"
                assert reply.json()["tokens_saved"] > 0
                assert fake.summarizer_calls and not fake.chat_calls
