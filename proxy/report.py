"""What the compaction step decided for a request, as values: the ground floor.

The compactor returns an `Outcome`; the web layer turns it into `x-compaction-*` response
headers, the request record, metrics and usage. Nothing here imports the rest of the proxy,
so every floor above may import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Message = dict[str, Any]  # one chat message, the client's own JSON object

# passthrough: under budget; compacted / extended / reused: compacted and within the budget
# (extended / reused: with a stored summary); over_budget: compacted as far as the protected
# messages allow and still over; skipped: forwarded unchanged (see reason); failed: a stage
# failed (see reason), forwarded as the stages before it left it (unchanged if none ran).
Status = Literal[
    "passthrough", "compacted", "reused", "extended", "over_budget", "skipped", "failed", "off"
]
# hit: a stored summary served; partial: one was extended; miss: made afresh; none: no store.
Cache = Literal["hit", "partial", "miss", "none"]
# Whether the first user message (the task) reached the model verbatim or in the summary.
Task = Literal["verbatim", "summarized"]
# Summaries made ahead of need (proxy/preparer.py), as `x-compaction-prepared` says: started:
# this request started a preparation in the background; dropped: it would have, but as many
# as `compaction.prepare_max_concurrent` were running; used: the summary this request was
# forwarded with was made ahead of need and this is the first request it served.
Prepared = Literal["started", "dropped", "used"]


@dataclass(frozen=True)
class Usage:
    """Token usage of summarizer calls (as the summarizer's API reported it)."""

    input_tokens: int = 0
    output_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.input_tokens + other.input_tokens, self.output_tokens + other.output_tokens
        )


NO_USAGE = Usage()


@dataclass(frozen=True)
class Decision:
    """The compaction policy's answer. `messages is None` means: forward the original bytes."""

    status: Status
    reason: str | None = None
    messages: list[Message] | None = None
    tokens_after: int | None = None
    summarized: int = 0  # messages of the history a summary stands for
    masked: int = 0  # tool results whose content a stub replaced
    usage: Usage = NO_USAGE
    cache: Cache | None = None  # None: no store was consulted
    task: Task | None = None
    error: str | None = None  # what failed, for an error reply (never in headers)
    prepared: bool = False  # the summary used was made ahead of need (its first use)


@dataclass(frozen=True)
class Outcome:
    """A decision with the request's numbers, as the response headers and the log report it.

    `rejected`: the step failed and `compaction.on_error = "reject"`: the handler answers
    `compaction_error(outcome)` (proxy/compactor.py) instead of forwarding."""

    status: Status = "passthrough"
    messages: list[Message] | None = None
    tokens_before: int | None = None
    tokens_after: int | None = None
    budget: int | None = None
    summarized: int = 0
    masked: int = 0
    usage: Usage = NO_USAGE
    reason: str | None = None
    cache: Cache | None = None
    estimated: bool = False
    task: Task | None = None
    error: str | None = None
    rejected: bool = False
    seconds: float = 0.0  # time the step took, summarizer calls included
    prepared: tuple[Prepared, ...] = ()

    @classmethod
    def of(
        cls,
        decision: Decision,
        *,
        tokens_before: int,
        budget: int,
        estimated: bool,
        rejected: bool = False,
        seconds: float = 0.0,
    ) -> Outcome:
        return cls(
            status=decision.status,
            messages=decision.messages,
            tokens_before=tokens_before,
            tokens_after=decision.tokens_after,
            budget=budget,
            summarized=decision.summarized,
            masked=decision.masked,
            usage=decision.usage,
            reason=decision.reason,
            cache=decision.cache,
            estimated=estimated,
            task=decision.task,
            error=decision.error,
            rejected=rejected,
            seconds=seconds,
            prepared=("used",) if decision.prepared else (),
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
        if self.masked:
            headers["x-compaction-messages-masked"] = str(self.masked)
        headers["x-compaction-summary-input-tokens"] = str(self.usage.input_tokens)
        headers["x-compaction-summary-output-tokens"] = str(self.usage.output_tokens)
        if self.reason:
            headers["x-compaction-reason"] = self.reason
        if self.cache is not None:
            headers["x-compaction-cache"] = self.cache
        if self.task is not None:
            headers["x-compaction-task"] = self.task
        if self.prepared:
            headers["x-compaction-prepared"] = ", ".join(self.prepared)
        if self.estimated:
            headers["x-compaction-tokens-estimated"] = "true"
        if overhead_ms is not None:
            headers["x-compaction-overhead-ms"] = f"{overhead_ms:.1f}"
        return headers


# Before the compaction step has decided (or with no step at all): a plain passthrough.
PASSTHROUGH = Outcome()
