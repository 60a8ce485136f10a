"""Every user ask a summary covers is forwarded verbatim after it, newest first, within
`user_messages_max_tokens`: what the user said steers the work, a summary loses its words."""

from __future__ import annotations

from typing import Any

from proxy.compaction.chat_format import ChatFormat
from proxy.compaction.conversation import describe
from proxy.compaction.cut import CutRules, cut_messages


def history() -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "the task"},
    ]
    for turn in range(8):
        messages.append({"role": "assistant", "content": f"work {turn} " + "x " * 50})
        if turn in (2, 4, 6):
            messages.append({"role": "user", "content": f"ask {turn}"})
    messages.append({"role": "assistant", "content": "last"})
    return messages


def words(start: int, end: int, messages: list[dict[str, Any]]) -> list[int]:
    return [len(str(m["content"]).split()) for m in messages[start:end]]


def carried(limit: int) -> list[str]:
    messages = history()
    cut = cut_messages(
        messages,
        describe(ChatFormat(), messages),
        CutRules(1, "carry", 100, limit),
        count=lambda start, end: words(start, end, messages),
    )
    before, after = cut.carried(cut.latest)
    assert [m["content"] for m in before] == ["the task"]
    forwarded = cut.forward({"role": "user", "content": "SUMMARY"}, cut.latest)
    assert forwarded[:3] == [messages[0], messages[1], {"role": "user", "content": "SUMMARY"}]
    return [m["content"] for m in after]


def test_every_covered_ask_is_carried_within_the_bound() -> None:
    assert carried(100) == ["ask 2", "ask 4", "ask 6"]


def test_newest_first_when_the_bound_is_tight() -> None:
    assert carried(4) == ["ask 4", "ask 6"]  # two words each
    assert carried(3) == ["ask 6"]  # the latest always


def test_zero_carries_only_the_latest_as_before() -> None:
    assert carried(0) == ["ask 6"]
