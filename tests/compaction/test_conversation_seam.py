"""The seam an API adapter plugs into: a toy adapter for Responses-style items (calls and
outputs linked by `call_id`, reasoning, an opaque compaction item, an environment block
before the task) gets the cut's guarantees without a line of the core changed."""

from __future__ import annotations

from typing import Any

from proxy.compaction.conversation import Entry, describe
from proxy.compaction.cut import CutRules, cut_messages

Item = dict[str, Any]


class ItemsFormat:
    """What a Responses adapter would say about each item."""

    key = "items-test"

    def entry(self, item: Item) -> Entry:
        kind = item.get("type")
        if kind == "message":
            role = item["role"]
            text = str(item.get("content"))
            context = role == "user" and text.startswith("<environment_context>")
            return Entry(role, ask=role == "user" and not context, context=context)
        if kind == "function_call":
            return Entry("assistant", calls=(item["call_id"],))
        if kind == "function_call_output":
            return Entry("tool", result_of=item["call_id"])
        if kind == "reasoning":
            return Entry("reasoning", span="drop")
        return Entry(str(kind), span="barrier")  # compaction, item_reference, unknown

    def masked(self, item: Item, stub: str) -> Item:
        return {**item, "output": stub}

    def output_chars(self, item: Item) -> int:
        return len(str(item.get("output", "")))

    def call_of(self, item: Item, call_id: str, index: int) -> tuple[str, str]:
        return item.get("name", "?"), item.get("arguments", "")


def message(role: str, text: str) -> Item:
    return {"type": "message", "role": role, "content": text}


def turn(i: int) -> list[Item]:
    return [
        {"type": "reasoning", "encrypted_content": f"r{i}"},
        {"type": "function_call", "call_id": f"c{i}", "name": "shell", "arguments": "{}"},
        {"type": "function_call_output", "call_id": f"c{i}", "output": "x" * 100},
    ]


def test_the_cut_keeps_its_promises_on_another_apis_items() -> None:
    items: list[Item] = [
        message("developer", "rules"),
        message("user", "<environment_context>cwd=/repo</environment_context>"),
        message("user", "the task"),
    ]
    for i in range(3):
        items += turn(i)
    items.append({"type": "compaction", "encrypted_content": "opaque"})
    for i in range(3, 9):
        items += turn(i)
    items.append(message("user", "the latest ask"))
    for i in range(9, 12):
        items += turn(i)
    described = describe(ItemsFormat(), items)
    cut = cut_messages(items, described, CutRules(2, "carry", 1000))
    barrier = items.index({"type": "compaction", "encrypted_content": "opaque"})
    # Everything up to the barrier stays in place; the compacted span starts after it.
    assert cut.pinned == items[: barrier + 1] and cut.to_compact
    # No call is separated from its output.
    head = {i["call_id"] for i in cut.to_compact if i["type"] == "function_call"}
    assert all(i["call_id"] in head for i in cut.to_compact if i["type"] == "function_call_output")
    # The summarizer never reads reasoning.
    read = [cut.rest[i] for i in cut.readable(0, cut.length)]
    assert read and not any(i["type"] == "reasoning" for i in read)
    assert len(read) < cut.length
    # The latest real ask is carried verbatim when the summary covers it.
    before, after = cut.carried(cut.latest)
    assert before == [] and after == [message("user", "the latest ask")]  # the task is pinned


def test_an_environment_block_is_never_the_task() -> None:
    items: list[Item] = [
        message("user", "<environment_context>cwd=/repo</environment_context>"),
        message("user", "the task"),
        *turn(0),
        *turn(1),
        message("user", "go on"),
        *turn(2),
        *turn(3),
    ]
    cut = cut_messages(items, describe(ItemsFormat(), items), CutRules(2, "carry", 1000))
    assert cut.task is not None and cut.rest[cut.task] == message("user", "the task")
