"""Compaction strategies and what a strategy of your own needs (docs/compaction.md, "Your own
strategy").

- `Compaction`: an async `compact(messages, llm) -> messages` (the reference's shape), with
  `LLM` the model it may call (`await llm.complete(messages, system=...) -> str`);
- `Summarizing`: `fingerprint`, an async `summarize_span(...) -> Summary` and
  `summary_message(text) -> Message`, for summaries the store reuses and extends;
- `StrategyOptions`: what a strategy's factory may be called with.
"""

from proxy.compaction.mask import MaskCompaction, MaskOptions
from proxy.compaction.protocol import (
    LLM,
    Compaction,
    CountMessage,
    Message,
    OnChunk,
    Summarizer,
    SummarizerError,
    Summarizing,
    Summary,
    Usage,
    fingerprint_of,
)
from proxy.compaction.simple import SimpleCompaction
from proxy.compaction.strategies import StrategyOptions
from proxy.compaction.structured import StructuredCompaction

__all__ = [
    "LLM",
    "Compaction",
    "CountMessage",
    "MaskCompaction",
    "MaskOptions",
    "Message",
    "OnChunk",
    "SimpleCompaction",
    "StrategyOptions",
    "StructuredCompaction",
    "Summarizer",
    "SummarizerError",
    "Summarizing",
    "Summary",
    "Usage",
    "fingerprint_of",
]
