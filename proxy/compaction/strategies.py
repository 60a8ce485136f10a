"""`compaction.strategy`: which strategies run, in which order, and loading them.

A strategy is a built-in name, a composite name (`hybrid` = mask, then simple), or
`package.module:Name` for one of your own; `compaction.strategy` may also be a list of
them, applied in order, each only while the request is still over budget.

`Name` is a class, a function or an object. A class or function is called once (per
summarizer model) with `StrategyOptions` when it takes a required positional argument (or
one called `options`), else with none; an object with the members is used as it is. What
it makes must be one of the two protocols (proxy/compaction/protocol.py): a `Compaction`
(an async `compact(messages, llm)`) or a `Summarizing` strategy (`fingerprint`, an async
`summarize_span`, `summary_message`). Loading checks that, so a strategy that cannot work
is a one-line config error at start, not a failure on the first over-budget request.

A `Compaction`'s fingerprint (which the log line reports) is, first found: the one
configured for it (`compaction.fingerprints`), its own `fingerprint` attribute, or a hash
of its class's qualified name and its module's source.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from proxy.compaction.mask import MaskCompaction, MaskOptions
from proxy.compaction.protocol import fingerprint_of
from proxy.compaction.render import CountTokens, default_count_tokens
from proxy.compaction.simple import SimpleCompaction
from proxy.compaction.structured import StructuredCompaction

Kind = Literal["mask", "compact", "summarize"]


@dataclass(frozen=True)
class StrategyOptions:
    """What a strategy's factory is called with: the configured settings, and a token
    counter for the summarizer's model."""

    summary_role: str = "user"
    max_message_tokens: int = 4000
    context_tokens: int = 100_000
    summary_max_tokens: int = 2000
    custom_instruction: str = ""
    count_tokens: CountTokens = default_count_tokens
    mask: MaskOptions = field(default_factory=MaskOptions)


def _simple(options: StrategyOptions) -> SimpleCompaction:
    return _summarizing(SimpleCompaction, options)


def _structured(options: StrategyOptions) -> SimpleCompaction:
    return _summarizing(StructuredCompaction, options)


def _summarizing(cls: type[SimpleCompaction], options: StrategyOptions) -> SimpleCompaction:
    return cls(
        summary_role=options.summary_role,
        max_message_tokens=options.max_message_tokens,
        summarizer_context_tokens=options.context_tokens,
        summary_max_tokens=options.summary_max_tokens,
        custom_instruction=options.custom_instruction,
        count_tokens=options.count_tokens,
    )


def _mask(options: StrategyOptions) -> MaskCompaction:
    return MaskCompaction(options.mask)


# Built-in strategies: name -> (kind, factory).
BUILT_IN: dict[str, tuple[Kind, Callable[[StrategyOptions], object]]] = {
    "simple": ("summarize", _simple),
    "structured": ("summarize", _structured),
    "mask": ("mask", _mask),
}
# Names that stand for a row of strategies.
COMPOSITE: dict[str, tuple[str, ...]] = {
    "hybrid": ("mask", "simple"),
}


@dataclass(frozen=True)
class Loaded:
    """One stage of `compaction.strategy`, ready to be made."""

    name: str
    kind: Kind
    factory: Callable[[StrategyOptions], object]
    built_in: bool


def stage_names(spec: str | Sequence[str]) -> tuple[str, ...]:
    """`spec` as the row of names it stands for, composites expanded."""
    names = [spec] if isinstance(spec, str) else list(spec)
    row: list[str] = []
    for name in names:
        row.extend(COMPOSITE.get(name, (name,)))
    return tuple(row)


def load_strategy(
    spec: str | Sequence[str], options: StrategyOptions | None = None
) -> tuple[Loaded, ...]:
    """The stages `spec` names, each checked (a strategy of your own is imported and made
    once with `options`). Raises ValueError with a sentence saying what is wrong."""
    row = stage_names(spec)
    if not row:
        raise ValueError("no strategy named: give a name or a list of names")
    options = options or StrategyOptions()
    return tuple(_load(name, options) for name in row)


def _load(name: str, options: StrategyOptions) -> Loaded:
    if name in BUILT_IN:
        kind, factory = BUILT_IN[name]
        return Loaded(name, kind, factory, True)
    module_name, colon, attribute = name.partition(":")
    if not colon or not module_name or not attribute:
        known = sorted([*BUILT_IN, *COMPOSITE])
        raise ValueError(
            f"unknown strategy {name!r}: expected one of {known} or 'package.module:Name'"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # its import runs the user's code: any error is a config error
        raise ValueError(
            f"strategy {name!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc})"
        ) from None
    if not hasattr(module, attribute):
        raise ValueError(f"strategy {name!r}: {module_name} has no {attribute!r}")
    target = getattr(module, attribute)

    def made_from(options: StrategyOptions) -> object:
        return make(target, options)

    try:
        made = made_from(options)
    except Exception as exc:
        raise ValueError(
            f"strategy {name!r}: making it failed ({type(exc).__name__}: {exc})"
        ) from None
    return Loaded(name, kind_of(name, made), made_from, False)


def make(target: Any, options: StrategyOptions) -> object:
    """The strategy `target` stands for: called with the options, without, or used as is."""
    if not callable(target) or (not inspect.isclass(target) and _has_members(target)):
        return target
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return target(options)
    positional = [
        p
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    takes = any(
        p.name == "options" or (p.default is p.empty and p.kind != p.VAR_POSITIONAL)
        for p in positional
    )
    return target(options) if takes else target()


def _has_members(value: object) -> bool:
    return hasattr(value, "compact") or hasattr(value, "summarize_span")


_SUMMARIZING = ("fingerprint", "summarize_span", "summary_message")


def kind_of(name: str, strategy: object) -> Kind:
    """Which protocol `strategy` implements. Raises ValueError naming what is missing."""
    present = [m for m in _SUMMARIZING if hasattr(strategy, m)]
    if hasattr(strategy, "summarize_span") or hasattr(strategy, "summary_message"):
        missing = [m for m in _SUMMARIZING if m not in present]
        if missing:
            raise ValueError(
                f"strategy {name!r}: {type(strategy).__name__} has no {', '.join(missing)} "
                f"(a summarizing strategy needs {', '.join(_SUMMARIZING)})"
            )
        if not inspect.iscoroutinefunction(getattr(strategy, "summarize_span", None)):
            raise ValueError(f"strategy {name!r}: summarize_span must be an async method")
        if not isinstance(getattr(strategy, "fingerprint", None), str):
            raise ValueError(f"strategy {name!r}: fingerprint must be a string")
        return "summarize"
    compact = getattr(strategy, "compact", None)
    if compact is None:
        raise ValueError(
            f"strategy {name!r}: {type(strategy).__name__} has no compact(messages, llm) "
            f"(nor the summarizing members {', '.join(_SUMMARIZING)})"
        )
    if not inspect.iscoroutinefunction(compact):
        raise ValueError(f"strategy {name!r}: compact(messages, llm) must be an async method")
    return "compact"


def fingerprint_for(name: str, strategy: object, configured: Mapping[str, str]) -> str:
    """A `compact` strategy's fingerprint (see the module docstring)."""
    given = configured.get(name)
    if given:
        return given
    own = getattr(strategy, "fingerprint", None)
    if isinstance(own, str) and own:
        return own
    cls = strategy if inspect.isclass(strategy) else type(strategy)
    return fingerprint_of(
        module=cls.__module__, qualname=cls.__qualname__, source=_source_hash(cls.__module__)
    )


def _source_hash(module_name: str) -> str:
    module = sys.modules.get(module_name)
    try:
        path = inspect.getsourcefile(module) if module is not None else None
        source = Path(path).read_bytes() if path else b""
    except (TypeError, OSError):
        source = b""
    return hashlib.sha256(source).hexdigest()
