"""SimpleCompaction: summarize everything but the last N user/assistant messages.

A port of the reference agent's strategy (see shared/reference/simple-compaction.md), adapted to
a proxy in front of OpenAI-style APIs: leading system/developer messages stay pinned, the cut
never separates tool calls from their results, the latest user message survives verbatim, and
long spans are folded in chunks so the summarizer's own request always fits its window.

`prepare`, `render`, `summary_message` and `assemble` are pure, so a summary store can cache
by what the summarizer would see and splice stored summaries without calling anyone.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial

from proxy.compaction.prompt import PROMPT_VERSION, SUMMARY_MARKER, SYSTEM_PROMPT, compact_prompt
from proxy.compaction.protocol import (
    CompactionResult,
    Message,
    Summarizer,
    SummarizerError,
    Summary,
    Usage,
)
from proxy.compaction.render import (
    Body,
    CountTokens,
    compose,
    default_count_tokens,
    message_body,
    message_role,
    strip_reasoning,
)

OnChunk = Callable[[int, Summary], Awaitable[None]]

_PINNED_ROLES = frozenset({"system", "developer"})
_COUNTED_ROLES = frozenset({"user", "assistant"})
# A message header plus the blank line between blocks, in tokens (an upper estimate).
_HEADER_TOKENS = 16
_MIN_MESSAGE_TOKENS = 64


@dataclass(frozen=True)
class Prepared:
    """Where the history is cut, and the summarizer's input for the compacted span.

    `compact_message` is the whole span unfolded; when it exceeds the summarizer's window,
    `summarize_span` sends it in chunks instead. It is rendered on first access: a request
    served from the summary store only needs the cut, and rendering a long history costs more
    than everything else the request path does.
    """

    pinned: list[Message]  # leading system/developer messages, kept in place
    to_compact: list[Message]  # messages[len(pinned):cut]
    to_preserve: list[Message]  # messages[cut:]
    cut: int  # absolute index into the input list
    render: Callable[[], Message] | None = field(default=None, repr=False, compare=False)

    @cached_property
    def compact_message(self) -> Message | None:
        """The summarizer's user message (None: nothing to do)."""
        return self.render() if self.render is not None else None


class SimpleCompaction:
    """Satisfies `proxy.compaction.protocol.Compaction`.

    `summary_max_tokens` (an addition to the issue's signature) is the room kept free in the
    summarizer's window for its reply; pass the same value the summarizer uses as max_tokens.
    """

    def __init__(
        self,
        max_preserved_messages: int = 2,
        *,
        keep_last_user_message: bool = True,
        summary_role: str = "user",
        max_message_tokens: int = 4000,
        summarizer_context_tokens: int = 100_000,
        count_tokens: CountTokens | None = None,
        summary_max_tokens: int = 2000,
    ) -> None:
        self.max_preserved_messages = max_preserved_messages
        self.keep_last_user_message = keep_last_user_message
        self.summary_role = summary_role
        self.summarizer_context_tokens = summarizer_context_tokens
        self.summary_max_tokens = summary_max_tokens
        self.count_tokens: CountTokens = count_tokens or default_count_tokens
        self._margin = 64 + summarizer_context_tokens // 50
        # A message (or a previous summary, which is capped the same way) must fit in a chunk
        # next to another one, so the fold always makes progress.
        room = summarizer_context_tokens - self._fixed_tokens("") - 2 * _HEADER_TOKENS
        self.max_message_tokens = max(_MIN_MESSAGE_TOKENS, min(max_message_tokens, room // 2))

    # -- pure parts ---------------------------------------------------------------------------

    def prepare(self, messages: list[Message], *, custom_instruction: str = "") -> Prepared:
        """Cut the history; the summarizer's message for the part before the cut is built on
        first access to `compact_message`."""
        return self._split(messages, custom_instruction)

    def render(
        self,
        span: list[Message],
        *,
        previous_summary: str | None = None,
        custom_instruction: str = "",
    ) -> Message:
        """The summarizer's user message for `span`.

        With `previous_summary`, this is exactly what the reference would send for a history
        that starts with that summary's message: `render([summary_message(s)] + span)`.
        """
        bodies = self._bodies(self._with_summary(span, previous_summary))
        return {"role": "user", "content": compose(bodies, custom_instruction)}

    def summary_message(self, summary_text: str) -> Message:
        return {"role": self.summary_role, "content": f"{SUMMARY_MARKER}\n{summary_text}"}

    def assemble(self, prepared: Prepared, summary_text: str) -> list[Message]:
        """pinned + [summary] + tail; the client's own message objects, untouched."""
        return [*prepared.pinned, self.summary_message(summary_text), *prepared.to_preserve]

    # -- summarizer calls ---------------------------------------------------------------------

    async def summarize_span(
        self,
        summarizer: Summarizer,
        span: list[Message],
        *,
        previous_summary: str | None = None,
        custom_instruction: str = "",
        on_chunk: OnChunk | None = None,
    ) -> Summary:
        """Summarize `span` (extending `previous_summary`), folding in chunks when too long.

        Each chunk is `render(chunk, previous_summary=<summary so far>)`. `on_chunk(n, s)` runs
        after each chunk: n = messages of `span` covered, s = that summary and the usage so far.
        """
        summary, _ = await self._fold(
            summarizer, self._bodies(span), previous_summary, custom_instruction, on_chunk
        )
        return summary

    async def compact(
        self,
        messages: list[Message],
        summarizer: Summarizer,
        *,
        custom_instruction: str = "",
    ) -> CompactionResult:
        """Summarize the prefix and return pinned + summary + tail. SummarizerError propagates."""
        prepared, bodies = self._prepare(messages, custom_instruction)
        if not prepared.to_compact:
            return CompactionResult(messages=list(messages))
        summary, chunks = await self._fold(summarizer, bodies, None, custom_instruction, None)
        return CompactionResult(
            messages=self.assemble(prepared, summary.text),
            usage=summary.usage,
            summarized=len(prepared.to_compact),
            summary=summary.text,
            extra={"prompt_version": PROMPT_VERSION, "chunks": chunks},
        )

    # -- internals ----------------------------------------------------------------------------

    def _prepare(
        self, messages: Sequence[Message], custom_instruction: str
    ) -> tuple[Prepared, list[Body]]:
        """The cut, and (lazily) the summarizer's message; `compact` wants the bodies too."""
        prepared = self._split(messages, custom_instruction)
        return prepared, self._bodies(prepared.to_compact) if prepared.to_compact else []

    def _split(self, messages: Sequence[Message], custom_instruction: str) -> Prepared:
        start = 0
        while start < len(messages) and message_role(messages[start]) in _PINNED_ROLES:
            start += 1
        pinned = list(messages[:start])
        cut = self._cut(messages, start)
        if cut <= start:
            return Prepared(pinned, [], list(messages[start:]), start)
        to_compact = list(messages[start:cut])
        render = partial(self._compact_message, to_compact, custom_instruction)
        return Prepared(pinned, to_compact, list(messages[cut:]), cut, render)

    def _compact_message(self, span: list[Message], custom_instruction: str) -> Message:
        return {"role": "user", "content": compose(self._bodies(span), custom_instruction)}

    def _cut(self, messages: Sequence[Message], start: int) -> int:
        """Index of the first preserved message; <= start means nothing to compact."""
        n = self.max_preserved_messages
        if n <= 0:
            return start
        counted = 0
        cut = start
        for index in range(len(messages) - 1, start - 1, -1):
            if message_role(messages[index]) in _COUNTED_ROLES:
                counted += 1
                if counted == n:
                    cut = index
                    break
        if counted < n:
            return start
        if self.keep_last_user_message:
            for index in range(len(messages) - 1, start - 1, -1):
                if message_role(messages[index]) == "user":
                    cut = min(cut, index)
                    break
        return max(start, _keep_tool_pairs(messages, cut))

    def _bodies(self, span: Sequence[Message]) -> list[Body]:
        return [message_body(m, self.max_message_tokens, self.count_tokens) for m in span]

    def _with_summary(self, span: Sequence[Message], summary: str | None) -> list[Message]:
        return [self.summary_message(summary), *span] if summary else list(span)

    def _fixed_tokens(self, custom_instruction: str) -> int:
        """Tokens of a summarizer call that are not the serialized messages."""
        prompt = self.count_tokens(SYSTEM_PROMPT) + self.count_tokens(
            compact_prompt(custom_instruction)
        )
        return prompt + self.summary_max_tokens + self._margin

    async def _fold(
        self,
        summarizer: Summarizer,
        bodies: list[Body],
        previous_summary: str | None,
        custom_instruction: str,
        on_chunk: OnChunk | None,
    ) -> tuple[Summary, int]:
        summary_text = previous_summary or None
        if not bodies:
            return Summary(summary_text or ""), 0
        fixed = self._fixed_tokens(custom_instruction)
        usage = Usage()
        done = chunks = 0
        while done < len(bodies):
            head = self._bodies(self._with_summary([], summary_text))
            budget = self.summarizer_context_tokens - fixed
            budget -= sum(b.tokens + _HEADER_TOKENS for b in head)
            end, used = done + 1, bodies[done].tokens + _HEADER_TOKENS
            while end < len(bodies) and used + bodies[end].tokens + _HEADER_TOKENS <= budget:
                used += bodies[end].tokens + _HEADER_TOKENS
                end += 1
            content = compose(head + bodies[done:end], custom_instruction)
            reply = await summarizer.summarize(
                SYSTEM_PROMPT, [{"role": "user", "content": content}]
            )
            text = strip_reasoning(reply.text)
            if not text:
                raise SummarizerError("summarizer_empty", "the summarizer returned no summary")
            usage += reply.usage
            summary_text, done, chunks = text, end, chunks + 1
            if on_chunk is not None:
                await on_chunk(done, Summary(text, usage))
        return Summary(summary_text or "", usage), chunks


def _keep_tool_pairs(messages: Sequence[Message], cut: int) -> int:
    """Move `cut` back until no tool result is separated from its call, in either direction.

    Pairs are matched by id; a result without an id belongs to the nearest earlier message
    with calls. Moving back only preserves more, so it never breaks another pair.
    """
    partner = _partners(messages)
    lo, hi = cut, len(messages)
    while True:
        need = min((partner[j] for j in range(lo, hi)), default=cut)
        if need >= cut:
            return cut
        lo, hi, cut = need, cut, need


def _partners(messages: Sequence[Message]) -> list[int]:
    """For each message, the lowest index that must stay on its side of any cut."""
    calls_at: dict[str, int] = {}
    results_at: dict[str, int] = {}
    last_call: int | None = None
    call_ids: list[list[str]] = []
    partner = list(range(len(messages)))
    for index, message in enumerate(messages):
        ids = _call_ids(message)
        call_ids.append(ids)
        for call_id in ids:
            calls_at[call_id] = index
        if ids or (isinstance(message, dict) and isinstance(message.get("function_call"), dict)):
            last_call = index
        role = message_role(message)
        if role not in ("tool", "function"):
            continue
        result_id = message.get("tool_call_id") if role == "tool" else None
        if isinstance(result_id, str) and result_id:
            results_at.setdefault(result_id, index)
            if result_id in calls_at:
                partner[index] = calls_at[result_id]
        elif last_call is not None:
            partner[index] = last_call
    for index, ids in enumerate(call_ids):
        found = [results_at[i] for i in ids if i in results_at]
        partner[index] = min([partner[index], *found])
    return partner


def _call_ids(message: Message) -> list[str]:
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not isinstance(calls, list):
        return []
    return [
        c["id"] for c in calls if isinstance(c, dict) and isinstance(c.get("id"), str) and c["id"]
    ]
