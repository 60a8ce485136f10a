"""SimpleCompaction: summarize everything but the most recent messages.

A port of the reference agent's strategy, adapted to a proxy in front of OpenAI-style APIs:
leading system/developer messages stay pinned, the cut never separates tool calls from their
results, the task and the latest ask survive verbatim (proxy/compaction/cut.py), and long
spans are folded in chunks so the summarizer's own request always fits its window.

The request path cuts the history itself and calls `summarize_span` and `summary_message`
(the `Summarizing` protocol), so its summaries are stored, reused and extended; `compact` is
the reference's one-shot shape for use outside the proxy. `render` and `summary_message` are
pure, so a summary store can cache by what the summarizer would see and splice stored
summaries without calling anyone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from proxy.compaction.chat_format import ChatFormat
from proxy.compaction.conversation import describe
from proxy.compaction.cut import Cut, CutRules, cut_messages
from proxy.compaction.llm import as_summarizer
from proxy.compaction.offload import off_loop
from proxy.compaction.prompt import PROMPT_VERSION, SUMMARY_MARKER, SYSTEM_PROMPT, compact_prompt
from proxy.compaction.protocol import (
    LLM,
    CountMessage,
    Message,
    OnChunk,
    Summarizer,
    SummarizerError,
    Summary,
    Usage,
    fingerprint_of,
)
from proxy.compaction.render import (
    Body,
    CountTokens,
    cap_tokens,
    compose,
    default_count_tokens,
    message_body,
    strip_reasoning,
)

# A message header plus the blank line between blocks, in tokens (an upper estimate).
_HEADER_TOKENS = 16
_MIN_MESSAGE_TOKENS = 64


class SimpleCompaction:
    """The reference's strategy behind the `Compaction` protocol.

    `summary_max_tokens` is the room kept free in the summarizer's window for its reply;
    pass the same value the summarizer uses as max_tokens. `rules` replaces the cut rules
    the first two arguments describe (the proxy passes its configured ones).
    """

    name = "simple"
    prompt_version = PROMPT_VERSION

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
        custom_instruction: str = "",
        rules: CutRules | None = None,
        format: ChatFormat | None = None,
    ) -> None:
        self.rules = rules or CutRules(
            max_preserved_messages, "pin" if keep_last_user_message else "off"
        )
        self.format = format or ChatFormat()
        self.max_preserved_messages = self.rules.max_preserved_messages
        self.summary_role = summary_role
        self.summarizer_context_tokens = summarizer_context_tokens
        self.summary_max_tokens = summary_max_tokens
        self.custom_instruction = custom_instruction
        self.count_tokens: CountTokens = count_tokens or default_count_tokens
        self._margin = 64 + summarizer_context_tokens // 50
        # A message (or a previous summary, which is capped the same way) must fit in a chunk
        # next to another one, so the fold always makes progress.
        room = summarizer_context_tokens - self._fixed_tokens() - 2 * _HEADER_TOKENS
        self.max_message_tokens = max(_MIN_MESSAGE_TOKENS, min(max_message_tokens, room // 2))

    @property
    def fingerprint(self) -> str:
        """Everything that shapes the summary text. The cut rules don't: a summary of a
        given prefix reads the same wherever the cut falls."""
        return fingerprint_of(
            strategy=self.name,
            prompt=self.prompt_version,
            summary_role=self.summary_role,
            max_message_tokens=self.max_message_tokens,
            context_tokens=self.summarizer_context_tokens,
            summary_max_tokens=self.summary_max_tokens,
            custom_instruction=self.custom_instruction.strip(),
        )

    # -- pure parts ---------------------------------------------------------------------------

    def cut(
        self,
        messages: list[Message],
        *,
        keep_tokens: int | None = None,
        count: CountMessage | None = None,
    ) -> Cut:
        """Where this strategy's rules cut `messages` on their own (the request path cuts
        with the configured rules and its counts; see proxy/compaction/cut.py)."""
        described = describe(self.format, messages)

        def count_range(start: int, end: int) -> list[int]:
            counted = count or _estimate
            return [counted(m) for m in messages[start:end]]

        return cut_messages(
            messages, described, self.rules, keep_tokens=keep_tokens, count=count_range
        )

    def render(
        self,
        span: list[Message],
        *,
        previous_summary: str | None = None,
        custom_instruction: str | None = None,
    ) -> Message:
        """The summarizer's user message for `span`.

        With `previous_summary`, this is exactly what the reference would send for a history
        that starts with that summary's message: `render([summary_message(s)] + span)`.
        """
        instruction = self.custom_instruction if custom_instruction is None else custom_instruction
        bodies = self._bodies(self._with_summary(span, previous_summary))
        return {"role": "user", "content": self._compose(bodies, instruction, previous_summary)}

    def summary_message(self, summary_text: str) -> Message:
        return {"role": self.summary_role, "content": f"{SUMMARY_MARKER}\n{summary_text}"}

    # -- summarizer calls ---------------------------------------------------------------------

    async def summarize_span(
        self,
        summarizer: Summarizer,
        span: list[Message],
        *,
        previous_summary: str | None = None,
        on_chunk: OnChunk | None = None,
    ) -> Summary:
        """Summarize `span` (extending `previous_summary`), folding in chunks when too long.

        Each chunk is `render(chunk, previous_summary=<summary so far>)`. `on_chunk(n, s)` runs
        after each chunk: n = messages of `span` covered, s = that summary and the usage so far.
        """
        bodies = await off_loop(len(span), self._bodies, span)
        summary, _ = await self._fold(summarizer, bodies, previous_summary, on_chunk)
        return summary

    async def compact(self, messages: list[Message], llm: LLM | Summarizer) -> list[Message]:
        """The reference's one-shot shape: cut, summarize the span with one call (folded in
        chunks when long), assemble. No store, no budget; SummarizerError propagates."""
        cut = self.cut(messages)
        if not cut.to_compact:
            return list(messages)
        summary = await self.summarize_span(as_summarizer(llm), cut.to_compact)
        return cut.forward(self.summary_message(summary.text))

    # -- internals ----------------------------------------------------------------------------

    def _compose(self, bodies: list[Body], instruction: str, previous: str | None) -> str:
        """The summarizer's user message (StructuredCompaction asks for its template)."""
        return compose(bodies, instruction)

    def _prompt_tokens(self) -> int:
        """The longest text `_compose` adds after the messages."""
        return self.count_tokens(compact_prompt(self.custom_instruction))

    def _bodies(self, span: Sequence[Message]) -> list[Body]:
        return [message_body(m, self.max_message_tokens, self.count_tokens) for m in span]

    def _with_summary(self, span: Sequence[Message], summary: str | None) -> list[Message]:
        return [self.summary_message(summary), *span] if summary else list(span)

    def _fixed_tokens(self) -> int:
        """Tokens of a summarizer call that are not the serialized messages."""
        prompt = self.count_tokens(SYSTEM_PROMPT) + self._prompt_tokens()
        return prompt + self.summary_max_tokens + self._margin

    async def _fold(
        self,
        summarizer: Summarizer,
        bodies: list[Body],
        previous_summary: str | None,
        on_chunk: OnChunk | None,
    ) -> tuple[Summary, int]:
        summary_text = previous_summary or None
        if not bodies:
            return Summary(summary_text or ""), 0
        fixed = self._fixed_tokens()
        usage = Usage()
        done = chunks = 0
        capped = False
        while done < len(bodies):
            head = self._bodies(self._with_summary([], summary_text))
            budget = self.summarizer_context_tokens - fixed
            budget -= sum(b.tokens + _HEADER_TOKENS for b in head)
            end, used = done + 1, bodies[done].tokens + _HEADER_TOKENS
            while end < len(bodies) and used + bodies[end].tokens + _HEADER_TOKENS <= budget:
                used += bodies[end].tokens + _HEADER_TOKENS
                end += 1
            content = self._compose(head + bodies[done:end], self.custom_instruction, summary_text)
            reply = await summarizer.summarize(
                SYSTEM_PROMPT, [{"role": "user", "content": content}]
            )
            text = strip_reasoning(reply.text)
            if not text:
                raise SummarizerError("summarizer_empty", "the summarizer returned no summary")
            usage += reply.usage
            text, cut_short = self._capped(text)
            capped = capped or cut_short
            summary_text, done, chunks = text, end, chunks + 1
            if on_chunk is not None:
                await on_chunk(done, Summary(text, usage, capped))
        return Summary(summary_text or "", usage, capped), chunks

    def _capped(self, text: str) -> tuple[str, bool]:
        """`text` within `summary_max_tokens` (head + tail): a summarizer may ignore the
        max_tokens it was sent, and a summary larger than its cap could crowd out the
        tail it was made to make room for."""
        if len(text) <= self.summary_max_tokens:  # no tokenizer makes more tokens than chars
            return text, False
        capped, _ = cap_tokens(text, self.summary_max_tokens, self.count_tokens)
        return capped, capped != text


def _estimate(message: Message) -> int:
    return default_count_tokens(str(message.get("content") or "")) + 4


if TYPE_CHECKING:
    from proxy.compaction.protocol import Compaction, Summarizing

    _check: Summarizing = SimpleCompaction()
    _check_compact: Compaction = SimpleCompaction()
