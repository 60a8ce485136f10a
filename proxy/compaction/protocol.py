"""The seams between the request path and compaction strategies.

Two kinds of strategy, and the request path runs either (or a list of them, in order):

- `Compaction`: the reference module's own shape, `compact(messages, llm) -> messages`. It
  may rewrite any message and return any new history. The built-in `mask` is one; so is a
  user's class with just that method. It runs on every over-budget turn and gets no store.
- `Summarizing`: a strategy that replaces the older part of the history with one summary
  message. The request path cuts the history (proxy/compaction/cut.py: pinned messages, the
  task, the latest ask and tool pairs kept intact), and the strategy only says how a span
  becomes text (`summarize_span`) and that text a message (`summary_message`); in exchange
  its summaries are stored by prefix, reused, extended and made once across replicas, and
  the budget is a guarantee. `simple` and `structured` are these.

Messages are the client's own JSON objects (OpenAI chat format), never rebuilt from a
schema, so fields we don't know survive untouched. A strategy never changes one in place.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from proxy.report import NO_USAGE, Message, Usage

__all__ = [
    "LLM",
    "NO_USAGE",
    "Compaction",
    "CountMessage",
    "Message",
    "OnChunk",
    "Spend",
    "Summarizer",
    "SummarizerError",
    "Summarizing",
    "Summary",
    "Usage",
    "fingerprint_of",
]

# Tokens of one message as the upstream bills it (the request path passes its counter's).
CountMessage = Callable[[Message], int]


@dataclass(frozen=True)
class Summary:
    """One summarizer reply, reasoning already removed. `capped`: it was longer than
    `compaction.summary_max_tokens` and was cut to it."""

    text: str
    usage: Usage = NO_USAGE
    capped: bool = False


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
        self.usage = usage if usage is not None else NO_USAGE


@runtime_checkable
class LLM(Protocol):
    """What a `Compaction` gets to call a model: the configured summarizer
    (`compaction.summarizer`: its URL, model and credential, by default the request's own),
    one non-streaming chat completion without tools, its reply capped at
    `compaction.summary_max_tokens`. What it costs is accounted to the request."""

    async def complete(self, messages: list[Message], *, system: str | None = None) -> str:
        """The model's reply to `messages` (chat format), reasoning removed. `system`: the
        system prompt (default: the reference's "You are a helpful assistant that compacts
        conversation context."). Raises SummarizerError when the call fails."""
        ...


@runtime_checkable
class Compaction(Protocol):
    """The reference's shape: the history in, a new history out.

    `messages` is the whole history as the client sent it (chat format, leading system
    messages included); return the history to forward, as a new list. Messages you keep
    should be the same objects (the request path then forwards the client's own bytes for
    them); messages you change are new dicts. Tool calls and their results must stay
    paired, or the request path refuses the result (`strategy_error`). An exception, or a
    result that is not a list of messages, is `failed` with reason `strategy_error`.
    """

    async def compact(self, messages: list[Message], llm: LLM) -> list[Message]: ...


@runtime_checkable
class Summarizing(Protocol):
    """A strategy that summarizes the span before the cut, with the summary store."""

    @property
    def fingerprint(self) -> str:
        """Changes whenever anything that shapes the summary's text changes (prompt version,
        settings): the store's keys include it, so summaries made otherwise are not reused."""
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


class Spend:
    """What one request's summarizer calls cost, added as each answers (however the
    request then ends: the upstream bills a call it answered). After `close(late)`,
    usage that still comes in (a call another request kept waiting on) goes to `late`.

    Calls made on the request's behalf but outside it (a summary prepared ahead of need,
    which may answer long after the reply) are recorded on their own, never in the
    request's reply: through `detached()`, by what `on_detached` was given."""

    __slots__ = ("_apart", "_late", "usage")

    def __init__(self) -> None:
        self.usage = NO_USAGE  # (frozen: `add` makes a new one)
        self._late: Callable[[Usage], None] | None = None
        self._apart: Callable[[Usage], None] | None = None

    def on_detached(self, record: Callable[[Usage], None]) -> None:
        """How the usage of detached calls is recorded (the usage tap's summarizer rows)."""
        self._apart = record

    def detached(self) -> Spend | None:
        """A Spend for calls made on this request's behalf that may outlive it: their usage
        is recorded as each answers. None: nothing would record it."""
        if self._apart is None:
            return None
        spend = Spend()
        spend.close(self._apart)
        return spend

    def add(self, usage: Usage) -> None:
        if not (usage.input_tokens or usage.output_tokens):
            return
        self.usage += usage
        if self._late is not None:
            self._late(usage)

    def close(self, late: Callable[[Usage], None]) -> None:
        self._late = late


def fingerprint_of(**parts: object) -> str:
    """A short stable hash of `parts` (JSON values), for a strategy's `fingerprint`."""
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(canonical.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
