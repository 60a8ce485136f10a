"""Fakes for the compaction tests: a summarizer that records its calls, a clock you move."""

from __future__ import annotations

from typing import Any

from proxy.compaction.protocol import Message, Summary, Usage
from proxy.compaction.simple import SimpleCompaction

CALL_USAGE = Usage(10, 5)


class FakeSummarizer:
    """Answers from `replies` (or "summary <n>"), recording every call's input."""

    def __init__(self, replies: list[str] | None = None, usage: Usage = CALL_USAGE) -> None:
        self.replies = list(replies or [])
        self.usage = usage
        self.calls: list[tuple[str, list[Message]]] = []

    async def summarize(self, system_prompt: str, messages: list[Message]) -> Summary:
        self.calls.append((system_prompt, messages))
        text = self.replies.pop(0) if self.replies else f"summary {len(self.calls)}"
        return Summary(text, self.usage)

    def content(self, call: int = 0) -> str:
        value: Any = self.calls[call][1][0]["content"]
        assert isinstance(value, str)
        return value


class FakeClock:
    """`clock()` reads it, `await sleep(s)` moves it forward and records s: no real waiting."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def compact_message(compaction: SimpleCompaction, history: list[Message]) -> Message | None:
    """The summarizer's message for the span the strategy's own cut takes (None: nothing)."""
    cut = compaction.cut(history)
    return compaction.render(cut.to_compact) if cut.to_compact else None
