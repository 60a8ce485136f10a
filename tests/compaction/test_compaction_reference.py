"""SimpleCompaction behaves like the reference where the reference is right."""

from __future__ import annotations

import copy
from typing import Any

from compaction_fakes import FakeSummarizer, compact_message

from proxy.compaction.prompt import COMPACT_PROMPT, SUMMARY_MARKER, SYSTEM_PROMPT
from proxy.compaction.protocol import Compaction, Message, Summarizing
from proxy.compaction.simple import SimpleCompaction


def msg(role: str, content: Any = None, **extra: Any) -> Message:
    return {"role": role, "content": content, **extra}


def conversation() -> list[Message]:
    return [
        msg("user", "build the parser"),
        msg("assistant", "done, parser.py written"),
        msg("user", "now add tests"),
        msg("assistant", "tests added"),
        msg("user", "run them"),
    ]


def test_satisfies_both_protocols() -> None:
    assert isinstance(SimpleCompaction(), Compaction)  # compact(messages, llm), standalone
    assert isinstance(SimpleCompaction(), Summarizing)  # what the proxy runs, with the store


async def test_too_few_messages_is_a_no_op(fake: FakeSummarizer) -> None:
    history = [msg("user", "hi")]
    assert compact_message(SimpleCompaction(), history) is None
    result = await SimpleCompaction().compact(history, fake)
    assert result == history and result[0] is history[0]
    assert fake.calls == []


async def test_exactly_n_messages_is_a_no_op(fake: FakeSummarizer) -> None:
    history = [msg("user", "hi"), msg("assistant", "hello")]
    prepared = SimpleCompaction(2).cut(history)
    assert compact_message(SimpleCompaction(2), history) is None
    assert prepared.to_compact == [] and prepared.to_preserve == history and prepared.index == 0
    await SimpleCompaction(2).compact(history, fake)
    assert fake.calls == []


async def test_zero_preserved_messages_is_a_no_op(fake: FakeSummarizer) -> None:
    await SimpleCompaction(0).compact(conversation(), fake)
    assert fake.calls == []


def test_cut_counts_user_and_assistant_from_the_end() -> None:
    history = conversation()
    prepared = SimpleCompaction(2).cut(history)
    assert prepared.index == 3
    assert prepared.to_compact == history[:3]
    assert all(a is b for a, b in zip(prepared.to_preserve, history[3:], strict=True))


def test_compact_message_is_numbered_messages_then_the_prompt() -> None:
    history = conversation()
    message = compact_message(SimpleCompaction(2), history)
    assert message is not None and message["role"] == "user"
    content = message["content"]
    assert content.startswith("## Message 1\nRole: user\nContent:\nbuild the parser")
    assert "## Message 2\nRole: assistant\nContent:\ndone, parser.py written" in content
    assert "## Message 3\nRole: user\nContent:\nnow add tests" in content
    assert "## Message 4" not in content
    assert content.endswith(COMPACT_PROMPT)


async def test_compact_calls_once_and_keeps_the_tail_verbatim(fake: FakeSummarizer) -> None:
    history = conversation()
    history[3]["x_client_field"] = {"keep": [1, 2]}
    before = copy.deepcopy(history)
    fake.replies = ["<think>let me see</think>The user builds a parser."]

    result = await SimpleCompaction(2).compact(history, fake)

    assert len(fake.calls) == 1
    system_prompt, sent = fake.calls[0]
    assert system_prompt == SYSTEM_PROMPT
    assert len(sent) == 1 and sent[0]["role"] == "user"
    summary, *tail = result
    assert summary == {"role": "user", "content": f"{SUMMARY_MARKER}\nThe user builds a parser."}
    assert all(a is b for a, b in zip(tail, history[3:], strict=True))
    assert history == before  # nothing mutated, unknown fields intact
    assert len(tail) == len(history) - 3


def test_thinking_is_dropped_from_the_summarizer_input() -> None:
    history = [
        msg("user", "q"),
        msg(
            "assistant",
            [
                {"type": "thinking", "thinking": "SECRET-1"},
                {"type": "reasoning", "text": "SECRET-2"},
                {"type": "text", "text": "<think>SECRET-3</think>the answer"},
            ],
            reasoning_content="SECRET-4",
        ),
        msg("user", "next"),
        msg("assistant", "ok"),
    ]
    message = compact_message(SimpleCompaction(2), history)
    assert message is not None
    content = message["content"]
    assert "the answer" in content
    assert "SECRET" not in content


def test_tool_messages_do_not_count_and_travel_with_the_cut() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    history = [
        msg("user", "list files"),
        msg("assistant", None, tool_calls=[call]),
        msg("tool", "a.py b.py", tool_call_id="c1"),
        msg("assistant", "two files"),
        msg("user", "thanks"),
    ]
    two = SimpleCompaction(2, keep_last_user_message=False).cut(history)
    assert two.index == 3  # the tool result is compacted together with its call
    three = SimpleCompaction(3, keep_last_user_message=False).cut(history)
    assert three.index == 1  # the tool result is preserved together with its call
    assert three.to_preserve[1] is history[2]


def test_custom_instruction_follows_the_prompt() -> None:
    focused = SimpleCompaction(2, custom_instruction="Keep all SQL")
    message = compact_message(focused, conversation())
    assert message is not None
    content = message["content"]
    assert content.index(COMPACT_PROMPT) < content.index("Keep all SQL")
    assert "priority" in content[content.index(COMPACT_PROMPT) + len(COMPACT_PROMPT) :]
    blank = compact_message(SimpleCompaction(2, custom_instruction="   "), conversation())
    assert blank is not None and blank["content"].endswith(COMPACT_PROMPT)
