"""The seam between the request path and compaction strategies.

Callers depend only on `Compaction` and `Summarizer`; SimpleCompaction is one implementation.
Messages are the client's own JSON objects (OpenAI chat format), never rebuilt from a schema,
so fields we don't know survive untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]


@dataclass(frozen=True)
class Usage:
    """Token usage of summarizer calls (as the summarizer's API reported it)."""

    input_tokens: int = 0
    output_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.input_tokens + other.input_tokens, self.output_tokens + other.output_tokens
        )


@dataclass(frozen=True)
class Summary:
    """One summarizer reply, reasoning already removed."""

    text: str
    usage: Usage = Usage()


@runtime_checkable
class Summarizer(Protocol):
    """One LLM call: `system_prompt` + `messages` -> summary text. Raises SummarizerError."""

    async def summarize(self, system_prompt: str, messages: list[Message]) -> Summary: ...


class SummarizerError(Exception):
    """The summarizer failed; `reason` is a short code for the x-compaction-reason header."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class CompactionResult:
    """The new history and what producing it cost.

    `summarized` is how many of the input messages the summary replaced (0: unchanged).
    """

    messages: list[Message]
    usage: Usage = Usage()
    summarized: int = 0
    summary: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Compaction(Protocol):
    async def compact(
        self,
        messages: list[Message],
        summarizer: Summarizer,
        *,
        custom_instruction: str = "",
    ) -> CompactionResult: ...
