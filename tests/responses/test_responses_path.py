"""POST /v1/responses through the proxy in-process: what is compacted, what is left alone,
and that every request the upstream gets is one it accepts."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from proxy.testing import FakeOpenAI, Reply
from tests.responses.shapes import (
    check_forwarded,
    codex_history,
    message,
    responses_body,
    tool_turn,
)

AUTH = {"authorization": "Bearer sk-test"}
BUDGET = {"compaction": {"budget_tokens": 3000}}


def dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


async def post(client: httpx.AsyncClient, body: bytes, **headers: str) -> httpx.Response:
    return await client.post(
        "/v1/responses",
        content=body,
        headers={**AUTH, "content-type": "application/json", **headers},
    )


@pytest.mark.compaction_proxy(**BUDGET)
async def test_a_long_history_is_compacted_within_budget_and_stays_valid(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    sent = dumps(
        responses_body(codex_history(30), prompt_cache_key="abc", text={"verbosity": "low"})
    )
    reply = await post(proxy_client, sent)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-compaction-status"] == "compacted"
    assert reply.headers["x-compaction-tokens-estimated"] == "true"  # encrypted reasoning
    assert int(reply.headers["x-compaction-tokens-after"]) <= 3000
    forwarded = fake_openai.responses_calls[-1].request.content
    items = check_forwarded(sent, forwarded)
    texts = [json.dumps(i) for i in items]
    assert any("Fix the failing parser tests." in t for t in texts)  # the task, verbatim
    assert "<environment_context>" in texts[1]  # a context block before the task: pinned
    # The summarizer read the calls and outputs, never the encrypted reasoning.
    (summary_call,) = fake_openai.summarizer_calls
    read = json.dumps(summary_call.body)
    assert "exec_command" in read and "gAAAAA" not in read
    # The reply's usage is what the upstream counted for the shorter request.
    assert reply.json()["usage"]["input_tokens"] == int(reply.headers["x-compaction-tokens-after"])


@pytest.mark.compaction_proxy(**BUDGET)
async def test_the_next_turn_reuses_the_stored_summary(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    items = codex_history(30)
    first = await post(proxy_client, dumps(responses_body(items)))
    assert first.headers["x-compaction-status"] == "compacted"
    items = [*items, *tool_turn(99, output_words=30)]
    second = await post(proxy_client, dumps(responses_body(items)))
    assert second.headers["x-compaction-status"] == "reused"
    assert len(fake_openai.summarizer_calls) == 1
    check_forwarded(dumps(responses_body(items)), fake_openai.responses_calls[-1].request.content)


@pytest.mark.compaction_proxy(**BUDGET)
async def test_a_short_history_passes_byte_for_byte(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    sent = dumps(responses_body(codex_history(2)))
    reply = await post(proxy_client, sent)
    assert reply.headers["x-compaction-status"] == "passthrough"
    assert fake_openai.responses_calls[-1].request.content == sent
    assert int(reply.headers["x-compaction-tokens-before"]) == reply.json()["usage"]["input_tokens"]


@pytest.mark.compaction_proxy(**BUDGET)
async def test_previous_response_id_is_left_to_the_server(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    sent = dumps(responses_body(codex_history(30), previous_response_id="resp_123"))
    reply = await post(proxy_client, sent, **{"x-compaction": "force"})
    assert reply.headers["x-compaction-status"] == "skipped"
    assert reply.headers["x-compaction-reason"] == "server_state"
    assert fake_openai.responses_calls[-1].request.content == sent
    assert not fake_openai.summarizer_calls


@pytest.mark.compaction_proxy(**BUDGET)
@pytest.mark.parametrize("trigger", ["checkpoint", "compaction_trigger"])
async def test_a_clients_own_compaction_request_passes_untouched(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI, trigger: str
) -> None:
    items = codex_history(30)
    if trigger == "checkpoint":
        ask = "You are performing a CONTEXT CHECKPOINT COMPACTION. Create a handoff summary."
        body = {**responses_body([*items, message("user", ask)]), "tools": []}
    else:
        body = responses_body([*items, {"type": "compaction_trigger"}])
    sent = dumps(body)
    reply = await post(proxy_client, sent)
    assert reply.headers["x-compaction-status"] == "skipped"
    assert reply.headers["x-compaction-reason"] == "client_compaction"
    assert fake_openai.responses_calls[-1].request.content == sent


@pytest.mark.compaction_proxy(compaction={"budget_tokens": 3000, "strategy": "simple"})
async def test_compaction_items_are_never_dropped_nor_moved(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    head = codex_history(5)
    opaque = {"type": "compaction", "id": "cmp_1", "encrypted_content": "gAAAAA" + "z" * 4000}
    items = [*head, opaque]
    for i in range(10, 40):
        items += tool_turn(i)
    sent = dumps(responses_body(items))
    reply = await post(proxy_client, sent)
    assert reply.headers["x-compaction-status"] in ("compacted", "over_budget")
    forwarded = check_forwarded(sent, fake_openai.responses_calls[-1].request.content)
    position = forwarded.index(opaque)
    assert forwarded[: position + 1] == items[: position + 1]  # everything up to it in place


@pytest.mark.compaction_proxy(**BUDGET)
async def test_masking_leaves_compaction_items_in_place(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    """The default strategy masks first: outputs before an opaque compaction item may give
    way to stubs, but no item is dropped or moved, the compaction item least of all."""
    head = codex_history(5)
    opaque = {"type": "compaction", "id": "cmp_1", "encrypted_content": "gAAAAA" + "z" * 4000}
    items = [*head, opaque]
    for i in range(10, 40):
        items += tool_turn(i)
    sent = dumps(responses_body(items))
    reply = await post(proxy_client, sent)
    assert reply.headers["x-compaction-status"] in ("compacted", "over_budget")
    assert int(reply.headers["x-compaction-messages-masked"]) > 0
    forwarded = check_forwarded(sent, fake_openai.responses_calls[-1].request.content)
    position = items.index(opaque)
    assert forwarded.index(opaque) == position
    for out, item in zip(forwarded[:position], items[:position], strict=True):
        if out != item:  # a masked output: the same item, its output a stub
            assert out["type"] == item["type"] == "function_call_output"
            assert out["call_id"] == item["call_id"]
            assert out["output"].startswith("[tool output cleared to save context:")


@pytest.mark.compaction_proxy(**BUDGET)
async def test_force_and_off_work_as_on_chat(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    sent = dumps(responses_body(codex_history(8)))
    forced = await post(proxy_client, sent, **{"x-compaction": "force"})
    assert forced.headers["x-compaction-status"] == "compacted"
    check_forwarded(sent, fake_openai.responses_calls[-1].request.content)
    off = await post(
        proxy_client, dumps(responses_body(codex_history(30))), **{"x-compaction": "off"}
    )
    assert off.headers["x-compaction-status"] == "off"


@pytest.mark.compaction_proxy(**BUDGET)
async def test_a_streamed_reply_carries_the_headers_and_the_event_sequence(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    fake_openai.replies = [Reply("All tests pass now.", reasoning="thinking")]
    sent = dumps(responses_body(codex_history(30), stream=True))
    async with proxy_client.stream(
        "POST", "/v1/responses", content=sent, headers={**AUTH, "content-type": "application/json"}
    ) as reply:
        assert reply.headers["x-compaction-status"] == "compacted"
        text = (await reply.aread()).decode()
    kinds = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds


async def test_bad_input_items_get_a_clear_400(proxy_client: httpx.AsyncClient) -> None:
    reply = await post(proxy_client, dumps({"model": "gpt-4o-mini", "input": ["hi", 3]}))
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "input[0]"
    broken = await post(proxy_client, b'{"model": "gpt-4o-mini", "input": [')
    assert broken.status_code == 400
    assert broken.json()["error"]["code"] == "invalid_json"


@pytest.mark.compaction_proxy(
    compaction={"budget_tokens": 3000, "summarizer": {"api": "responses"}}
)
async def test_the_summarizer_can_be_asked_on_the_responses_api(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    sent = dumps(responses_body(codex_history(30)))
    reply = await post(proxy_client, sent)
    assert reply.headers["x-compaction-status"] == "compacted"
    (summary_call,) = fake_openai.summarizer_calls
    assert summary_call.path.endswith("/responses")
    assert summary_call.body["store"] is False
    assert not fake_openai.chat_calls
    forwarded = check_forwarded(sent, fake_openai.responses_calls[-1].request.content)
    assert any("FAKE SUMMARY" in json.dumps(item) for item in forwarded)
