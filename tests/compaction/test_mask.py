"""The mask strategy on its own: which results it masks, what a stub says, its steps."""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from test_compaction_better import agent_histories

from proxy.compaction.chat_format import ChatFormat
from proxy.compaction.conversation import broken_pairs, describe
from proxy.compaction.mask import MaskCompaction, MaskOptions
from proxy.compaction.protocol import Compaction, Message

CHAT = ChatFormat()


def tool_turn(i: int, words: int = 100, name: str = "run") -> list[Message]:
    arguments = json.dumps({"cmd": f"pytest -q tests/test_{i}.py " + "-k x " * 30})
    call = {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"c{i}", "content": f"out {i} " + "line " * words},
    ]


def history(turns: int, words: int = 100) -> list[Message]:
    messages: list[Message] = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "task"},
    ]
    for i in range(turns):
        messages += tool_turn(i, words, "read_file" if i % 3 == 0 else "run")
    return messages


def mask(messages: list[Message], options: MaskOptions | None = None) -> tuple[list[Message], int]:
    def count(start: int, end: int) -> list[int]:
        return [len(json.dumps(m)) // 4 for m in messages[start:end]]

    strategy = MaskCompaction(options or MaskOptions(keep_last=2, clear_at_least=0), CHAT)
    return strategy.mask(messages, describe(CHAT, messages), count)


def test_old_results_give_way_to_a_stub_naming_the_call_and_the_rest_is_kept() -> None:
    messages = history(6)
    before = copy.deepcopy(messages)
    masked, count = mask(messages)
    assert count == 4 and messages == before  # nothing changed in place
    results = [i for i, m in enumerate(messages) if m["role"] == "tool"]
    for i, (old, new) in enumerate(zip(messages, masked, strict=True)):
        if i in results[:4]:
            assert new is not old and new["tool_call_id"] == old["tool_call_id"]
            assert set(new) == set(old)  # every field kept, only the content replaced
            assert new["content"].startswith("[tool output cleared to save context: ")
            assert f"returned {len(old['content']):,} characters" in new["content"]
            name = "read_file" if results.index(i) % 3 == 0 else "run"
            assert f'{name}({{"cmd": "pytest -q tests/test_' in new["content"]
            assert "...)" in new["content"]  # the arguments, abbreviated
        else:
            assert new is old  # the same object: forwarded as the client's own bytes


def test_keep_last_clear_at_least_and_exclude_tools() -> None:
    messages = history(10)  # ten results of ~140 tokens, each ~85 more than its stub
    assert mask(messages, MaskOptions(keep_last=10, clear_at_least=0))[1] == 0
    assert mask(messages, MaskOptions(keep_last=3, clear_at_least=0))[1] == 7
    # Steps clearing at least 250 tokens: three results a step, whole steps only.
    assert mask(messages, MaskOptions(keep_last=3, clear_at_least=250))[1] == 6
    assert mask(messages, MaskOptions(keep_last=3, clear_at_least=400))[1] == 5
    assert mask(messages, MaskOptions(keep_last=3, clear_at_least=100_000))[1] == 0
    excluded = MaskOptions(keep_last=3, clear_at_least=0, exclude_tools=("read_file",))
    masked, count = mask(messages, excluded)
    assert count == 3  # six results of other tools, the last three of them kept
    for old, new in zip(messages, masked, strict=True):
        if old["role"] == "tool" and new is not old:
            call = messages[messages.index(old) - 1]["tool_calls"][0]
            assert call["function"]["name"] != "read_file"


def test_a_result_no_longer_than_its_stub_is_never_masked() -> None:
    messages = history(6, words=1)
    assert mask(messages) == (messages, 0)


def test_steps_depend_on_the_prefix_only() -> None:
    """Each turn's masked history starts with the previous turn's, except where a step
    was taken; a step is taken only once the results since the last one clear enough."""
    options = MaskOptions(keep_last=2, clear_at_least=350)
    previous: list[Message] | None = None
    steps = 0
    for turns in range(3, 25):
        masked, _ = mask(history(turns), options)
        if previous is not None and masked[: len(previous)] != previous:
            steps += 1
        previous = masked
    assert 4 <= steps <= 8


def test_legacy_function_results_and_results_without_ids_are_named() -> None:
    messages: list[Message] = [
        {"role": "user", "content": "task"},
        {"role": "assistant", "function_call": {"name": "grep", "arguments": '{"q": "x"}'}},
        {"role": "function", "name": "grep", "content": "match " * 200},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "ls"}}]},
        {"role": "tool", "content": "file " * 200},
        {"role": "user", "content": "go on"},
        *tool_turn(1),
        *tool_turn(2),
    ]
    masked, count = mask(messages)
    assert count == 2
    assert masked[2]["content"].startswith("[tool output cleared to save context: grep(")
    assert masked[2]["name"] == "grep"
    assert masked[4]["content"].startswith("[tool output cleared to save context: ls()")


async def test_it_is_a_compaction_of_the_references_shape() -> None:
    strategy = MaskCompaction(MaskOptions(keep_last=1, clear_at_least=0))
    assert isinstance(strategy, Compaction)
    messages = history(3)
    result = await strategy.compact(messages, llm=None)
    assert sum(m is not o for m, o in zip(result, messages, strict=True)) == 2


@settings(max_examples=200, deadline=None)
@given(
    history=agent_histories(),
    keep=st.integers(0, 4),
    clear=st.sampled_from([0, 5, 50]),
)
def test_pairs_and_structure_are_intact_by_construction(
    history: list[Message], keep: int, clear: int
) -> None:
    masked, count = mask(history, MaskOptions(keep_last=keep, clear_at_least=clear))
    assert len(masked) == len(history)
    assert [m.get("role") for m in masked] == [m.get("role") for m in history]
    changed = [(a, b) for a, b in zip(history, masked, strict=True) if a is not b]
    assert len(changed) == count
    assert all(a["role"] == "tool" and _without(a, "content") == _without(b, "content")
               for a, b in changed)  # fmt: skip
    assert broken_pairs(describe(CHAT, masked)) == broken_pairs(describe(CHAT, history))
    assert mask(history, MaskOptions(keep_last=keep, clear_at_least=clear)) == (masked, count)


def _without(message: Message, key: str) -> dict[str, Any]:
    return {k: v for k, v in message.items() if k != key}
