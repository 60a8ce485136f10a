"""Compaction strategies and the summarizer they call.

What a strategy of your own needs (see README, "Your own strategy"): the `Compaction`
protocol, the `Cut` it returns (build one with `cut_messages` and the configured `CutRules`),
`Summary`, and the `StrategyOptions` its factory is called with.
"""

from proxy.compaction.cut import CutRules, cut_messages
from proxy.compaction.protocol import (
    Compaction,
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
from proxy.compaction.strategies import StrategyOptions

__all__ = [
    "Compaction",
    "CountMessage",
    "Cut",
    "CutRules",
    "Message",
    "OnChunk",
    "StrategyOptions",
    "Summarizer",
    "SummarizerError",
    "Summary",
    "Usage",
    "compact",
    "cut_messages",
    "fingerprint_of",
]
