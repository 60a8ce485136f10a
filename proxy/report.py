"""What the proxy did to a chat request, as `x-compaction-*` response headers."""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.compaction.protocol import Message, Usage


@dataclass
class Outcome:
    """The compaction step's decision. `messages is None` means: forward the original bytes.

    status: passthrough | compacted | reused | extended | skipped | failed | off
    cache:  hit | partial | miss | none (None: no store was consulted)
    """

    status: str = "passthrough"
    messages: list[Message] | None = None
    tokens_before: int | None = None
    tokens_after: int | None = None
    budget: int | None = None
    summarized: int = 0
    usage: Usage = field(default_factory=Usage)
    reason: str | None = None
    cache: str | None = None
    estimated: bool = False

    def headers(self, overhead_ms: float | None = None) -> dict[str, str]:
        headers = {"x-compaction-status": self.status}
        if self.tokens_before is not None:
            headers["x-compaction-tokens-before"] = str(self.tokens_before)
            after = self.tokens_after if self.tokens_after is not None else self.tokens_before
            headers["x-compaction-tokens-after"] = str(after)
        if self.budget is not None:
            headers["x-compaction-budget"] = str(self.budget)
        headers["x-compaction-messages-summarized"] = str(self.summarized)
        headers["x-compaction-summary-input-tokens"] = str(self.usage.input_tokens)
        headers["x-compaction-summary-output-tokens"] = str(self.usage.output_tokens)
        if self.reason:
            headers["x-compaction-reason"] = self.reason
        if self.cache is not None:
            headers["x-compaction-cache"] = self.cache
        if self.estimated:
            headers["x-compaction-tokens-estimated"] = "true"
        if overhead_ms is not None:
            headers["x-compaction-overhead-ms"] = f"{overhead_ms:.1f}"
        return headers
