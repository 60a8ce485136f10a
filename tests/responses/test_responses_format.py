"""The Responses adapter's rules, the item counter's and the Responses summarizer, unit by
unit: what a user of Codex or the Agents SDK relies on without seeing it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import respx

from proxy.compaction.conversation import broken_pairs, describe
from proxy.compaction.cut import CutRules, cut_messages
from proxy.compaction.render import message_body
from proxy.compaction.responses_format import ResponsesFormat
from proxy.compaction.summarizer import UpstreamSummarizer
from proxy.testing import make_settings
from proxy.testing.app import load_offline_tokenizer
from proxy.tokens import TokenCounter
from proxy.tokens.responses import ResponsesCounter, has_opaque, opaque_tokens
from tests.responses.shapes import ENVIRONMENT, message, tool_turn

Item = dict[str, Any]
FORMAT = ResponsesFormat()


def pair(kind: str, n: int, output: str = "x" * 200) -> list[Item]:
    call: Item = {"type": f"{kind}_call", "call_id": f"{kind}-{n}"}
    if kind == "custom_tool":
        call |= {"name": "apply_patch", "input": "*** Begin Patch"}
    elif kind == "local_shell":
        call |= {"action": {"type": "exec", "command": ["ls", "-la"]}}
    else:
        call |= {"name": "f", "arguments": "{}"}
    return [call, {"type": f"{kind}_call_output", "call_id": f"{kind}-{n}", "output": output}]


def test_every_kind_of_call_is_paired_with_its_output_by_call_id() -> None:
    items: list[Item] = [message("user", "task")]
    for n, kind in enumerate(["function", "custom_tool", "local_shell", "computer", "shell"]):
        items += pair(kind, n)
    described = describe(FORMAT, items)
    assert broken_pairs(described) == 0
    assert all(described.call_of[i] == i - 1 for i in range(2, len(items), 2))


def test_reasoning_never_leaves_the_item_it_led_to_and_is_never_read() -> None:
    items: list[Item] = [message("developer", "rules"), message("user", "task")]
    for i in range(12):
        items += tool_turn(i, output_words=60)
    described = describe(FORMAT, items)
    cut = cut_messages(items, described, CutRules(2, "carry", 100))
    kept = cut.to_preserve
    assert kept[0]["type"] == "reasoning"  # the cut moved before the reasoning of its call
    read = [cut.rest[i] for i in cut.readable(0, cut.length)]
    assert not any(item["type"] == "reasoning" for item in read)
    for position in cut.stops:  # no later stop splits a reasoning item from its call
        assert cut.rest[position - 1]["type"] != "reasoning"


def test_context_blocks_and_additional_tools_are_pinned_and_the_task_is_the_real_one() -> None:
    tools = {"type": "additional_tools", "role": "developer", "tools": [{"type": "function"}]}
    items: list[Item] = [
        tools,
        message("developer", "rules"),
        message("user", ENVIRONMENT),
        message("user", "# AGENTS.md instructions for /repo\n\nrun the tests"),
        message("user", "the task"),
    ]
    for i in range(10):
        items += tool_turn(i, output_words=60)
    cut = cut_messages(items, describe(FORMAT, items), CutRules(2, "carry", 100))
    assert cut.pinned == items[:4]
    assert cut.task is not None and cut.rest[cut.task] == message("user", "the task")


def test_compaction_items_and_unknown_types_are_barriers() -> None:
    for odd in ({"type": "compaction", "encrypted_content": "e"}, {"type": "brand_new_item"}):
        items: list[Item] = [message("user", "task"), *tool_turn(0), odd]
        for i in range(1, 10):
            items += tool_turn(i, output_words=60)
        cut = cut_messages(items, describe(FORMAT, items), CutRules(2, "carry", 100))
        assert cut.pinned == items[: items.index(odd) + 1]


def test_masking_replaces_text_outputs_only() -> None:
    text = {"type": "function_call_output", "call_id": "c", "output": "long " * 100}
    screenshot = {"type": "computer_call_output", "call_id": "d", "output": {"type": "image"}}
    assert FORMAT.masked(text, "stub") == {**text, "output": "stub"}
    assert FORMAT.output_chars(text) == 500 and FORMAT.output_chars(screenshot) == 0
    shell = pair("local_shell", 1)[0]
    assert FORMAT.call_of(shell, "local_shell-1", 0) == ("local_shell", "ls -la")


def test_the_summarizer_reads_calls_and_outputs_as_text() -> None:
    call, output = pair("custom_tool", 0, output="patched 3 files")
    assert "apply_patch(*** Begin Patch)" in message_body(call, 1000, len).text
    body = message_body(output, 1000, len)
    assert body.role == "tool" and "patched 3 files" in body.text


@pytest.fixture(scope="module")
def counter() -> ResponsesCounter:
    load_offline_tokenizer()
    tokens = TokenCounter(make_settings())
    tokens.load()
    return ResponsesCounter(tokens, make_settings())


def test_encrypted_content_is_estimated_by_the_documented_rule(counter: ResponsesCounter) -> None:
    secret = "A" * 4000  # base64: 3000 bytes decoded, 750 tokens at 4 bytes each
    assert opaque_tokens(secret) == 750
    reasoning = {"type": "reasoning", "summary": [], "encrypted_content": secret}
    assert counter.count_message("gpt-4o", reasoning) == 3 + 750
    assert has_opaque([reasoning]) and not has_opaque([message("user", "hi")])
    assert has_opaque([{"type": "item_reference", "id": "msg_1"}])


def test_a_request_counts_instructions_tools_and_items(counter: ResponsesCounter) -> None:
    item = message("user", "hello there")
    body = {"model": "gpt-4o", "input": [item], "instructions": "Be brief."}
    alone = counter.count_request({"model": "gpt-4o", "input": [item]})
    assert counter.count_request(body) == alone + 3 + counter.count_text("gpt-4o", "Be brief.")
    assert counter.count_request({"model": "gpt-4o", "input": "hello there"}) == alone


async def test_the_responses_summarizer_asks_with_instructions_and_reads_the_output() -> None:
    reply = {
        "output": [
            {"type": "reasoning", "summary": []},
            {"type": "message", "content": [{"type": "output_text", "text": "the summary"}]},
        ],
        "usage": {"input_tokens": 120, "output_tokens": 3},
    }
    with respx.mock() as router:
        route = router.post("http://up.test/v1/responses").respond(200, json=reply)
        async with httpx.AsyncClient() as client:
            summarizer = UpstreamSummarizer(
                client, base_url="http://up.test/v1", model="gpt-5", api="responses"
            )
            summary = await summarizer.summarize("SYSTEM", [{"role": "user", "content": "x"}])
    sent = json.loads(route.calls[0].request.content)
    assert sent["instructions"] == "SYSTEM" and sent["input"] == [{"role": "user", "content": "x"}]
    assert sent["store"] is False and sent["max_output_tokens"] == 2000
    assert summary.text == "the summary"
    assert (summary.usage.input_tokens, summary.usage.output_tokens) == (120, 3)
