"""The two views of one model call: `LLM` (what a user's `compact` gets: text in, text out)
and `Summarizer` (what summarizing strategies call: a `Summary` with its usage)."""

from __future__ import annotations

from proxy.compaction.prompt import SYSTEM_PROMPT
from proxy.compaction.protocol import LLM, Summarizer, Summary
from proxy.report import NO_USAGE, Message, Usage


class SummarizerLLM:
    """An `LLM` over a summarizer; `usage` adds up what its calls cost."""

    def __init__(self, summarizer: Summarizer) -> None:
        self._summarizer = summarizer
        self.usage: Usage = NO_USAGE
        self.calls = 0

    async def complete(self, messages: list[Message], *, system: str | None = None) -> str:
        self.calls += 1
        summary = await self._summarizer.summarize(system or SYSTEM_PROMPT, list(messages))
        self.usage += summary.usage
        return summary.text


class LLMSummarizer:
    """A `Summarizer` over an `LLM` (its usage unknown: reported as none)."""

    def __init__(self, llm: LLM) -> None:
        self._llm = llm

    async def summarize(self, system_prompt: str, messages: list[Message]) -> Summary:
        return Summary(await self._llm.complete(messages, system=system_prompt))


def as_summarizer(model: LLM | Summarizer) -> Summarizer:
    """`model` as a Summarizer, whichever of the two it is."""
    if isinstance(model, Summarizer):
        return model
    return LLMSummarizer(model)
