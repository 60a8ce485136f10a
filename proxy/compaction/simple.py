"""SimpleCompaction: summarize everything but the most recent messages.

A port of the reference agent's strategy, adapted to a proxy in front of OpenAI-style APIs:
leading system/developer messages stay pinned, the cut never separates tool calls from their
results, the task and the latest ask survive verbatim (proxy/compaction/cut.py), and long
spans are folded in chunks so the summarizer's own request always fits its window.

`cut`, `render` and `summary_message` are pure, so a summary store can cache by what the
summarizer would see and splice stored summaries without calling anyone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from proxy.compaction.cut import CutRules, cut_messages
from proxy.compaction.offload import off_loop
from proxy.compaction.prompt import PROMPT_VERSION, SUMMARY_MARKER, SYSTEM_PROMPT, compact_prompt
from proxy.compaction.protocol import (
    CompactionResult,
    CountMessage,
    Cut,
    Message,
    OnChunk,
    Summarizer,
    SummarizerError,
    Summary,
    Usage,
    compact,
    fingerprint_of,
)
from proxy.compaction.render import (
    Body,
    CountTokens,
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
    ) -> None:
        self.rules = rules or CutRules(
            max_preserved_messages, "pin" if keep_last_user_message else "off"
        )
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
        """Cut the history (proxy/compaction/cut.py); the summarizer's message for the part
        before the cut is built on first access to `compact_message`."""
        return cut_messages(
            messages, self.rules, keep_tokens=keep_tokens, count=count, render=self.render
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

    async def compact(self, messages: list[Message], summarizer: Summarizer) -> CompactionResult:
        """The reference's one-shot compaction (`proxy.compaction.protocol.compact`)."""
        return await compact(self, messages, summarizer)

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
            summary_text, done, chunks = text, end, chunks + 1
            if on_chunk is not None:
                await on_chunk(done, Summary(text, usage))
        return Summary(summary_text or "", usage), chunks


if TYPE_CHECKING:
    from proxy.compaction.protocol import Compaction

    _check: Compaction = SimpleCompaction()
