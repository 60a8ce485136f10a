"""What the proxy did to a chat request, as `x-compaction-*` response headers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from proxy.compaction.protocol import Message, Usage

# passthrough: under budget; compacted / extended / reused: a summary is in the forwarded
# request and the request is within the budget; over_budget: compacted as far as the
# protected messages allow and still over; skipped / failed: forwarded unchanged (see reason).
Status = Literal[
    "passthrough", "compacted", "reused", "extended", "over_budget", "skipped", "failed", "off"
]
# hit: a stored summary served; partial: one was extended; miss: made afresh; none: no store.
Cache = Literal["hit", "partial", "miss", "none"]
# Whether the first user message (the task) reached the model verbatim or in the summary.
Task = Literal["verbatim", "summarized"]


@dataclass(frozen=True)
class Decision:
    """The compaction policy's answer. `messages is None` means: forward the original bytes."""

    status: Status
    reason: str | None = None
    messages: list[Message] | None = None
    tokens_after: int | None = None
    summarized: int = 0
    usage: Usage = field(default_factory=Usage)
    cache: Cache | None = None  # None: no store was consulted
    task: Task | None = None
    error: str | None = None  # what failed, for an error reply (never in headers)


@dataclass(frozen=True)
class Outcome:
    """A decision with the request's numbers, as the response headers and the log report it."""

    status: Status = "passthrough"
    messages: list[Message] | None = None
    tokens_before: int | None = None
    tokens_after: int | None = None
    budget: int | None = None
    summarized: int = 0
    usage: Usage = field(default_factory=Usage)
    reason: str | None = None
    cache: Cache | None = None
    estimated: bool = False
    task: Task | None = None

    @classmethod
    def of(cls, decision: Decision, *, tokens_before: int, budget: int, estimated: bool) -> Outcome:
        return cls(
            status=decision.status,
            messages=decision.messages,
            tokens_before=tokens_before,
            tokens_after=decision.tokens_after,
            budget=budget,
            summarized=decision.summarized,
            usage=decision.usage,
            reason=decision.reason,
            cache=decision.cache,
            estimated=estimated,
            task=decision.task,
        )

    def headers(self, overhead_ms: float | None = None) -> dict[str, str]:
        headers: dict[str, str] = {"x-compaction-status": self.status}
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
        if self.task is not None:
            headers["x-compaction-task"] = self.task
        if self.estimated:
            headers["x-compaction-tokens-estimated"] = "true"
        if overhead_ms is not None:
            headers["x-compaction-overhead-ms"] = f"{overhead_ms:.1f}"
        return headers


# Before the compaction step has decided (or with no step at all): a plain passthrough. One
# shared instance: Outcome is frozen, and making one costs a setattr per field.
PASSTHROUGH = Outcome()
