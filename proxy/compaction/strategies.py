"""`compaction.strategy`: a built-in name or `package.module:Factory` for one of your own.

A factory is called once per compacted request with `StrategyOptions` (the configured
settings and a token counter for the summarizer's model) and returns a `Compaction`.
A class whose `__init__` takes the options is a factory.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from proxy.compaction.cut import CutRules
from proxy.compaction.protocol import Compaction
from proxy.compaction.render import CountTokens, default_count_tokens
from proxy.compaction.simple import SimpleCompaction
from proxy.compaction.structured import StructuredCompaction


@dataclass(frozen=True)
class StrategyOptions:
    rules: CutRules = field(default_factory=CutRules)
    summary_role: str = "user"
    max_message_tokens: int = 4000
    context_tokens: int = 100_000
    summary_max_tokens: int = 2000
    custom_instruction: str = ""
    count_tokens: CountTokens = default_count_tokens


StrategyFactory = Callable[[StrategyOptions], Compaction]


def _built_in(cls: type[SimpleCompaction]) -> StrategyFactory:
    def factory(options: StrategyOptions) -> Compaction:
        return cls(
            rules=options.rules,
            summary_role=options.summary_role,
            max_message_tokens=options.max_message_tokens,
            summarizer_context_tokens=options.context_tokens,
            summary_max_tokens=options.summary_max_tokens,
            custom_instruction=options.custom_instruction,
            count_tokens=options.count_tokens,
        )

    return factory


BUILT_IN: dict[str, StrategyFactory] = {
    "simple": _built_in(SimpleCompaction),
    "structured": _built_in(StructuredCompaction),
}


def load_strategy(name: str) -> StrategyFactory:
    """The factory `name` denotes. Raises ValueError with a sentence saying what is wrong."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    module_name, colon, attribute = name.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(
            f"unknown strategy {name!r}: expected one of {sorted(BUILT_IN)} "
            "or 'package.module:Factory'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"strategy {name!r}: cannot import {module_name!r} ({exc})") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"strategy {name!r}: {module_name} has no callable {attribute!r}")
    return factory  # type: ignore[no-any-return]
