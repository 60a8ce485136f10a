"""The seam between the request path and compaction strategies.

`Compaction` is exactly what the request path (proxy/compactor.py) and the summary planner
(proxy/planner.py) call: `cut` a history, `summarize_span` (optionally extending a previous
summary, reporting each chunk), build the `summary_message`, and a `fingerprint` of
everything that shapes the summary's text (the summary store keys on it). SimpleCompaction
and StructuredCompaction implement it; so can a user's own class (`compaction.strategy`).

Messages are the client's own JSON objects (OpenAI chat format), never rebuilt from a schema,
so fields we don't know survive untouched.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]
# Tokens of one message as the upstream bills it (the request path passes its counter's).
CountMessage = Callable[[Message], int]


@dataclass(frozen=True)
class Usage:
    """Token usage of summarizer calls (as the summarizer's API reported it)."""

    input_tokens: int = 0
    output_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.input_tokens + other.input_tokens, self.output_tokens + other.output_tokens
        )


NO_USAGE = Usage()


@dataclass(frozen=True)
class Summary:
    """One summarizer reply, reasoning already removed."""

    text: str
    usage: Usage = Usage()


# After each chunk of a long span: (messages of the span covered so far, summary so far).
OnChunk = Callable[[int, Summary], Awaitable[None]]


@runtime_checkable
class Summarizer(Protocol):
    """One LLM call: `system_prompt` + `messages` -> summary text. Raises SummarizerError."""

    async def summarize(self, system_prompt: str, messages: list[Message]) -> Summary: ...


class SummarizerError(Exception):
    """The summarizer failed; `reason` is a short code for the x-compaction-reason header.
    `usage`: what the failed call's reply reported (an answer without a usable summary is
    billed all the same)."""

    def __init__(self, reason: str, message: str, usage: Usage | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.usage = usage if usage is not None else Usage()


class Spend:
    """What one request's summarizer calls cost, added as each answers (however the
    request then ends: the upstream bills a call it answered). After `close(late)`,
    usage that still comes in (a call another request kept waiting on) goes to `late`."""

    __slots__ = ("_late", "usage")

    def __init__(self) -> None:
        self.usage = NO_USAGE  # (frozen: `add` makes a new one)
        self._late: Callable[[Usage], None] | None = None

    def add(self, usage: Usage) -> None:
        if not (usage.input_tokens or usage.output_tokens):
            return
        self.usage += usage
        if self._late is not None:
            self._late(usage)

    def close(self, late: Callable[[Usage], None]) -> None:
        self._late = late


@dataclass(frozen=True)
class Cut:
    """Where a history is cut, and which messages survive verbatim around the summary.

    Positions (`task`, `asks`, `stops`) index `rest` = `to_compact + to_preserve`. A summary
    covering `rest[:length]` is forwarded as
    `pinned + [task] + [summary] + [latest ask] + rest[length:]`, where the task and the
    ask appear only when the summary covered them (see `forward`).

    `stops` are the later positions the cut may move forward to when the result is over
    budget (tool pairs intact, at least the minimum tail kept), ascending.
    `compact_message` is the whole span as the summarizer would read it, unfolded; it is
    rendered on first access, since a request served from the store only needs the cut.
    """

    pinned: list[Message]  # leading system/developer messages, kept in place
    to_compact: list[Message]  # messages[len(pinned):index]
    to_preserve: list[Message]  # messages[index:]
    index: int  # absolute index into the input list of the first preserved message
    task: int | None = None  # the first user message, forwarded verbatim before the summary
    asks: tuple[int, ...] = ()  # user messages that may be carried verbatim after the summary
    stops: tuple[int, ...] = ()
    task_summarized: bool = False  # the first user message exceeded its cap: summarized
    render: Callable[[], Message] | None = field(default=None, repr=False, compare=False)

    @cached_property
    def compact_message(self) -> Message | None:
        """The summarizer's user message (None: nothing to do)."""
        return self.render() if self.render is not None else None

    @cached_property
    def rest(self) -> list[Message]:
        return [*self.to_compact, *self.to_preserve]

    @property
    def length(self) -> int:
        """How many messages of `rest` the cut summarizes."""
        return len(self.to_compact)

    @property
    def latest(self) -> int:
        """The furthest the cut may move forward."""
        return self.stops[-1] if self.stops else self.length

    def ask_for(self, length: int) -> int | None:
        """The ask a summary of `rest[:length]` carries: the latest user message (not an
        injected one), when the summary covers it and it is not the task."""
        ask = self.asks[-1] if self.asks else None
        return ask if ask is not None and ask < length and ask != self.task else None

    def carried(
        self, length: int, sticky: int | None = None
    ) -> tuple[list[Message], list[Message]]:
        """The protected messages a summary of `rest[:length]` covers: (before it, after it).

        `sticky`: an ask the same summary carried when it was made (a newer one has come
        since); it stays, so a reused summary forwards the same prefix as before."""
        rest = self.rest
        before = [rest[self.task]] if self.task is not None and self.task < length else []
        carried = {self.ask_for(length)}
        if sticky is not None and sticky < length and sticky != self.task:
            carried.add(sticky)
        after = [rest[p] for p in sorted(p for p in carried if p is not None)]
        return before, after

    def forward(
        self, summary: Message, length: int | None = None, sticky: int | None = None
    ) -> list[Message]:
        """The forwarded history for a summary of `rest[:length]` (default: the cut)."""
        length = self.length if length is None else length
        before, after = self.carried(length, sticky)
        return [*self.pinned, *before, summary, *after, *self.rest[length:]]


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
    """A compaction strategy, as the request path and the planner use it."""

    @property
    def fingerprint(self) -> str:
        """Changes whenever anything that shapes the summary's text changes (prompt version,
        settings): the store's keys include it, so summaries made otherwise are not reused."""
        ...

    def cut(
        self,
        messages: list[Message],
        *,
        keep_tokens: int | None = None,
        count: CountMessage | None = None,
    ) -> Cut:
        """Where to cut. `keep_tokens`: keep as many recent messages as fit in that many
        tokens (counted with `count`), never fewer than the strategy's minimum tail."""
        ...

    async def summarize_span(
        self,
        summarizer: Summarizer,
        span: list[Message],
        *,
        previous_summary: str | None = None,
        on_chunk: OnChunk | None = None,
    ) -> Summary:
        """Summarize `span`, extending `previous_summary` when given. Raises SummarizerError."""
        ...

    def summary_message(self, summary_text: str) -> Message:
        """The message that stands for the summarized span in the forwarded request."""
        ...


async def compact(
    compaction: Compaction, messages: list[Message], summarizer: Summarizer
) -> CompactionResult:
    """The reference's one-shot `compact`: cut, summarize the span, assemble. No store, no
    budget; SummarizerError propagates."""
    cut = compaction.cut(messages)
    if not cut.to_compact:
        return CompactionResult(messages=list(messages))
    summary = await compaction.summarize_span(summarizer, cut.to_compact)
    return CompactionResult(
        messages=cut.forward(compaction.summary_message(summary.text)),
        usage=summary.usage,
        summarized=len(cut.to_compact),
        summary=summary.text,
    )


def fingerprint_of(**parts: object) -> str:
    """A short stable hash of `parts` (JSON values), for `Compaction.fingerprint`."""
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(canonical.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
