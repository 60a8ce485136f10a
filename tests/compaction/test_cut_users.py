"""The cut's user positions and injected answers: what the plain loop and the patterns do."""

from __future__ import annotations

from typing import Any

from proxy.compaction.chat_format import DEFAULT_INJECTED, ChatFormat
from proxy.compaction.conversation import describe
from proxy.compaction.cut import CutRules, plan_cut


def test_user_positions_with_and_without_odd_messages() -> None:
    history: list[Any] = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": "a"},
        {"role": ["user"], "content": "not a role"},
        {"content": "no role"},
        {"role": "user", "content": "ask"},
    ]
    chat = ChatFormat()
    assert describe(chat, history).users == [1, 5]
    assert describe(chat, [*history, "not a message", {"role": "user"}]).users == [1, 5, 7]


def test_injected_answers_are_remembered_per_text_not_per_message() -> None:
    chat = ChatFormat(DEFAULT_INJECTED)
    complaint = {"role": "user", "content": "Tool call error: reply with exactly one tool call."}
    ask = {"role": "user", "content": "Now fix the importer."}
    for _ in range(2):  # the second round answers from the memo
        assert chat.is_injected(complaint) and chat.is_injected(dict(complaint))
        assert not chat.is_injected(ask)
    history: list[Any] = [{"role": "user", "content": "task"}]
    for turn in range(6):
        said = ask if turn < 3 else complaint
        history += [{"role": "assistant", "content": f"step {turn}"}, said]
    plan = plan_cut(describe(chat, history), CutRules(2, "carry"))
    assert plan.asks == (0, 2, 4, 6)  # the complaints after the last ask are not asks
