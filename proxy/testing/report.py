"""The proxy's `x-compaction-*` response headers, read back as one typed value."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

PREFIX = "x-compaction-"
# Statuses under which the forwarded request carried a summary instead of older messages.
SUMMARIZED = frozenset({"compacted", "reused", "extended", "over_budget"})


@dataclass(frozen=True)
class CompactionReport:
    """What the proxy says it did to one chat request.

    status: passthrough | compacted | reused | extended | over_budget | skipped | failed | off
    cache:  hit | partial | miss | none, or None when no store was consulted
    `headers` holds every `x-compaction-*` header as sent, including any not typed here.
    """

    status: str
    tokens_before: int | None = None
    tokens_after: int | None = None
    budget: int | None = None
    messages_summarized: int = 0
    summary_input_tokens: int = 0
    summary_output_tokens: int = 0
    reason: str | None = None
    cache: str | None = None
    tokens_estimated: bool = False
    overhead_ms: float | None = None
    headers: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def summarized(self) -> bool:
        """True when older messages went upstream as a summary (new, reused or extended)."""
        return self.status in SUMMARIZED

    @classmethod
    def from_headers(
        cls, headers: Mapping[str, str] | Iterable[tuple[str, str]]
    ) -> CompactionReport:
        """From a response's headers (httpx, openai's `.headers`, a dict, or pairs).

        Raises ValueError when there is no `x-compaction-status`: the response did not come
        from the proxy's chat completions route.
        """
        pairs = headers.items() if isinstance(headers, Mapping) else headers
        ours = {k.lower(): v for k, v in pairs if k.lower().startswith(PREFIX)}
        status = ours.get(f"{PREFIX}status")
        if status is None:
            raise ValueError("no x-compaction-status header: not a proxied chat completion")

        def number(name: str) -> int | None:
            value = ours.get(PREFIX + name)
            return int(value) if value is not None else None

        overhead = ours.get(f"{PREFIX}overhead-ms")
        return cls(
            status=status,
            tokens_before=number("tokens-before"),
            tokens_after=number("tokens-after"),
            budget=number("budget"),
            messages_summarized=number("messages-summarized") or 0,
            summary_input_tokens=number("summary-input-tokens") or 0,
            summary_output_tokens=number("summary-output-tokens") or 0,
            reason=ours.get(f"{PREFIX}reason"),
            cache=ours.get(f"{PREFIX}cache"),
            tokens_estimated=ours.get(f"{PREFIX}tokens-estimated") == "true",
            overhead_ms=float(overhead) if overhead is not None else None,
            headers=ours,
        )
