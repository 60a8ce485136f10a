"""Strategies in a row: each stage runs only while the request is still over budget.

`compaction.strategy = ["mask", "simple"]` masks old tool outputs, then summarizes what is
still too long. A stage takes the history as the stages before it left it and returns a
new one (or none: nothing to do); `compose` runs the stages and makes one `Decision` of
what they did. The stages:

- `MaskStage` (proxy/compaction/mask.py): no LLM call, deterministic;
- `RewriteStage`: any `Compaction` (`compact(messages, llm)`), a user's own included;
- `SummaryStage` (proxy/planner.py): a `Summarizing` strategy with the summary store.

A stage that fails ends the row: the request is forwarded as the stages before it left it
(unchanged when it was the first), with status `failed` and the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.compaction.conversation import Described, Format, broken_pairs, describe
from proxy.compaction.cut import CutRules
from proxy.compaction.llm import SummarizerLLM
from proxy.compaction.mask import MaskCompaction
from proxy.compaction.offload import off_loop
from proxy.compaction.protocol import Compaction, Summarizer, SummarizerError
from proxy.jsonspans import Spans
from proxy.report import NO_USAGE, Cache, Decision, Message, Status, Task, Usage
from proxy.sessioncache import SessionCache

log = logging.getLogger("proxy.compaction")


class MessageCounter(Protocol):
    """What the stages need from token counting (proxy.tokens.TokenCounter)."""

    def count_text(self, model: str, text: str) -> int: ...

    def count_message(self, model: str, message: Any, key: int | None = None) -> int: ...

    def count_each(
        self, model: str, messages: Sequence[Any], keys: Sequence[int | None] | None = None
    ) -> list[int]: ...

    async def acount_each(
        self,
        model: str,
        messages: Sequence[Any],
        keys: Sequence[int | None] | None = None,
        *,
        counted: int = 0,
    ) -> list[int]: ...

    def request_tokens(self, message_tokens: int, tools: int) -> int: ...


@dataclass(frozen=True)
class Counting:
    """Token counts as the upstream bills them: a client message's from `counts` (each of
    the body's messages, by position) when known, any other (a summary, a stub) counted."""

    counter: MessageCounter
    model: str
    tools: int  # the tokens of the body's tool definitions
    spans: Spans | None = None  # where the body's messages are in the client's bytes
    counts: Sequence[int] | None = None  # the tokens of each of spans.messages

    def message(self, message: Message) -> int:
        spans = self.spans
        if spans is None:
            return self.counter.count_message(self.model, message)
        index = spans.index_of(message)
        if index is not None and self.counts is not None:
            return self.counts[index]
        key = None if index is None else spans.keys()[index]
        return self.counter.count_message(self.model, message, key)

    def each(self, messages: Sequence[Message]) -> list[int]:
        spans = self.spans
        if spans is None:
            return self.counter.count_each(self.model, messages)
        if self.counts is not None:
            first = spans.run_of(messages)
            if first is not None:
                return list(self.counts[first : first + len(messages)])
            index_of = spans.index_of
            found = [index_of(m) for m in messages]
            if None not in found:
                return [self.counts[i] for i in found]  # type: ignore[index]
        return self.counter.count_each(self.model, messages, spans.keys_for(messages))

    def range_of(self, messages: Sequence[Message]) -> Callable[[int, int], list[int]]:
        """Counts of messages[start:end], for the cut and masking."""
        return lambda start, end: self.each(messages[start:end])

    def text(self, text: str) -> int:
        return self.counter.count_text(self.model, text)

    async def request(self, messages: Sequence[Message]) -> int:
        """The prompt tokens of the body with `messages` instead of its own."""
        spans, counts = self.spans, self.counts
        if spans is None or counts is None:
            keys = None if spans is None else spans.keys_for(messages)
            total = sum(await self.counter.acount_each(self.model, messages, keys))
            return self.counter.request_tokens(total, self.tools)
        index_of = spans.index_of
        total = 0
        others = []
        for message in messages:
            index = index_of(message)
            if index is None:
                others.append(message)
            else:
                total += counts[index]
        if others:
            total += sum(await self.counter.acount_each(self.model, others, counted=total))
        return self.counter.request_tokens(total, self.tools)


@dataclass
class History:
    """A history between stages: its messages, their prompt tokens (tools included) and,
    once a stage asked, its description. `source`: when stages only changed the content of
    some messages (masking), the history before them, message by message: a summary of a
    span reads (and the store keys) what the client sent, so a later masking step never
    invalidates a stored summary."""

    messages: list[Message]
    tokens: int
    described: Described | None = None
    source: list[Message] | None = None

    def describe(self, format: Format) -> Described:
        if self.described is None or self.described.key != format.key:
            self.described = describe(format, self.messages)
        return self.described


@dataclass(frozen=True)
class Job:
    """One over-budget (or forced) request, as every stage sees it."""

    model: str
    budget: int
    force: bool
    counting: Counting
    summarizer: Summarizer  # made on its first call; each call is accounted to the request
    format: Format
    rules: CutRules
    scope: str | None  # the summary store tenant (None: no store)
    spans: Spans | None = None
    cache: SessionCache | None = None  # the session's derived values (the body's own)


@dataclass(frozen=True)
class StageResult:
    """What a stage did: `history` None means it changed nothing (see `reason`)."""

    history: History | None
    status: Status = "compacted"
    reason: str | None = None
    usage: Usage = NO_USAGE
    cache: Cache | None = None
    summarized: int = 0
    masked: int = 0
    task: Task | None = None
    prepared: bool = False  # its summary was made ahead of need (first used here)


class StageError(Exception):
    """A stage failed: `reason` for the headers, what its calls cost so far."""

    def __init__(
        self, reason: str, message: str, usage: Usage = NO_USAGE, cache: Cache | None = None
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.usage = usage
        self.cache = cache


class Stage(Protocol):
    """One strategy of the row, as the request path runs it."""

    @property
    def name(self) -> str: ...

    @property
    def fingerprint(self) -> str: ...

    async def run(self, history: History, job: Job) -> StageResult: ...


@dataclass(frozen=True)
class MaskStage:
    strategy: MaskCompaction
    name: str = "mask"
    fingerprint: str = field(default="")

    async def run(self, history: History, job: Job) -> StageResult:
        described = history.describe(job.format)
        messages, masked = await off_loop(
            len(history.messages),
            self.strategy.mask,
            history.messages,
            described,
            job.counting.range_of(history.messages),
        )
        if not masked:
            return StageResult(None, "skipped", "nothing_to_compact")
        tokens = await job.counting.request(messages)
        # Only tool outputs changed: the description holds for the masked history.
        source = history.source or history.messages
        return StageResult(History(messages, tokens, described, source), masked=masked)


@dataclass(frozen=True)
class RewriteStage:
    """A `Compaction`: the history in, a new one out, checked before it is used."""

    strategy: Compaction
    name: str
    fingerprint: str

    async def run(self, history: History, job: Job) -> StageResult:
        llm = SummarizerLLM(job.summarizer)
        try:
            result = await self.strategy.compact(list(history.messages), llm)
        except SummarizerError as error:
            raise StageError(error.reason, str(error), llm.usage + error.usage) from None
        except Exception as exc:
            log.warning(
                "compaction strategy %s raised %s: %s", self.name, type(exc).__name__, exc,
                exc_info=True,
            )  # fmt: skip
            raise StageError("strategy_error", f"{type(exc).__name__}: {exc}", llm.usage) from None
        if not isinstance(result, list) or not all(isinstance(m, dict) for m in result):
            raise StageError(
                "strategy_error", f"{self.name} returned {type(result).__name__}, not messages",
                llm.usage,
            )  # fmt: skip
        if len(result) == len(history.messages) and all(
            a is b for a, b in zip(result, history.messages, strict=True)
        ):
            return StageResult(None, "skipped", "nothing_to_compact", usage=llm.usage)
        described = describe(job.format, result)
        if broken_pairs(described) > broken_pairs(history.describe(job.format)):
            raise StageError(
                "strategy_error", f"{self.name} separated tool calls from their results",
                llm.usage,
            )  # fmt: skip
        tokens = await job.counting.request(result)
        return StageResult(History(result, tokens, described), usage=llm.usage)


async def compose(stages: Sequence[Stage], history: History, job: Job) -> Decision:
    """Run `stages` in order while the request is over budget (every one when forced) and
    say what they did. Never raises for a stage's failure: that is a `failed` decision."""
    current = history
    results: list[StageResult] = []
    failure: StageError | None = None
    for stage in stages:
        if current.tokens <= job.budget and not job.force:
            break
        try:
            result = await stage.run(current, job)
        except SummarizerError as error:
            failure = StageError(error.reason, str(error), error.usage)
            break
        except StageError as error:
            failure = error
            break
        except Exception as exc:
            log.error("compaction stage %s failed", stage.name, exc_info=True)
            failure = StageError("strategy_error", f"{type(exc).__name__}: {exc}")
            break
        results.append(result)
        if result.history is not None:
            current = result.history
    return _decision(results, failure, history, current, job)


def _decision(
    results: list[StageResult],
    failure: StageError | None,
    original: History,
    current: History,
    job: Job,
) -> Decision:
    usage = sum((r.usage for r in results), failure.usage if failure else NO_USAGE)
    cache = next((r.cache for r in reversed(results) if r.cache is not None), None)
    summarized = sum(r.summarized for r in results if r.history is not None)
    masked = sum(r.masked for r in results if r.history is not None)
    task = next((r.task for r in reversed(results) if r.task is not None), None)
    prepared = any(r.prepared for r in results if r.history is not None)
    changed = current is not original
    smaller = changed and current.tokens < original.tokens
    if failure is not None:
        return Decision(
            "failed",
            failure.reason,
            messages=current.messages if smaller else None,
            tokens_after=current.tokens if smaller else None,
            summarized=summarized if smaller else 0,
            masked=masked if smaller else 0,
            usage=usage,
            cache=failure.cache if failure.cache is not None else cache,
            task=task if smaller else None,
            error=str(failure),
        )
    if not changed:
        skip = next((r.reason for r in reversed(results) if r.reason), "nothing_to_compact")
        return Decision("skipped", skip, usage=usage, cache=cache)
    if not smaller:
        # Never forward a larger request than the client's (forced or not).
        return Decision("skipped", "no_gain", usage=usage, cache=cache)
    last = next(r for r in reversed(results) if r.history is not None)
    status: Status = last.status
    reason: str | None = next(
        (r.reason for r in reversed(results) if r.history is not None and r.reason), None
    )
    if current.tokens > job.budget:
        status, reason = "over_budget", "over_budget"
    return Decision(
        status,
        reason,
        messages=current.messages,
        tokens_after=current.tokens,
        summarized=summarized,
        masked=masked,
        usage=usage,
        cache=cache,
        task=task,
        prepared=prepared,
    )
