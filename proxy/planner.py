"""Plan an over-budget request with the summary store: reuse, extend, or summarize afresh,
and keep the result within the budget.

A transparent proxy's client resends its whole history every turn. Summaries are stored by a
chain hash of the prefix they cover, so a later request with the same prefix reuses one
(no summarizer call, identical forwarded bytes) until it no longer fits the budget; then the
stored summary is extended with only the new span. Cheapest first:

1. reuse:  the longest stored prefix k <= the furthest cut whose result fits the budget;
2. extend: a stored prefix k < the cut exists: summarize [summary_k] + rest[k:cut];
3. fresh:  nothing stored: summarize rest[:cut] (folding in chunks, each chunk's summary
           stored at its boundary so a later request can extend from it).

Then the budget is a guarantee: while the result is over, the cut moves forward to a later
clean boundary (`Cut.stops`) and the summary is extended over the messages it passed. When
no boundary is left the result is `over_budget`: the smallest valid request, said so.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

import anyio.to_thread

from proxy.compaction.protocol import (
    Compaction,
    CountMessage,
    Cut,
    Message,
    Summarizer,
    Summary,
    Usage,
)
from proxy.jsonspans import Spans
from proxy.report import Cache
from proxy.store import ChainMemo, StoredSummary, SummaryFlight, SummaryStore, chain_hashes

CountMessages = Callable[[list[Message]], Awaitable[int]]

PlanStatus = Literal["compacted", "extended", "reused", "over_budget"]
# Moving the cut forward at most this many times before going straight to the last stop.
_MAX_STEPS = 2
# Bodies up to this size are hashed on the event loop when their bytes are known (SHA-256 of
# every message, ~1 ms per MB, on a session's first turn; later turns hash only new ones).
HASH_ON_LOOP_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Plan:
    """What to forward and how it was obtained."""

    status: PlanStatus
    cache: Cache
    messages: list[Message]
    summarized: int  # messages of the history the summary stands for
    usage: Usage
    tokens: int  # prompt tokens of the request as forwarded


@dataclass(frozen=True)
class Budget:
    """The limit and how to count against it."""

    tokens: int
    count: CountMessages  # the forwarded request, tools included
    count_message: CountMessage
    count_text: Callable[[str], int]


class SummaryPlanner:
    def __init__(
        self, store: SummaryStore, flight: SummaryFlight, memo: ChainMemo | None = None
    ) -> None:
        self.store = store
        self.flight = flight
        self.memo = memo

    async def plan(
        self,
        cut: Cut,
        compaction: Compaction,
        summarizer: Summarizer,
        *,
        scope: str,
        namespace: str,
        budget: Budget,
        force: bool,
        spans: Spans | None = None,
    ) -> Plan:
        """Raises SummarizerError when a summary had to be made and could not be.

        `spans`: where the client's messages are in its body, to hash their bytes."""
        rest = cut.rest
        target, latest = cut.length, cut.latest
        hashes = partial(chain_hashes, scope, namespace, rest[:latest], spans, self.memo)
        if spans is not None and len(spans.raw) <= HASH_ON_LOOP_BYTES:
            keys = hashes()
        else:  # canonical JSON of every message costs ~10 ms per 400 KB: not on the loop
            keys = await anyio.to_thread.run_sync(hashes)
        stored = [
            entry
            for entry in await self.store.lookup_all(keys, latest)
            if _starts_cleanly(rest, entry.length) and not (force and entry.length < target)
        ]
        miss: Cache = "miss" if self.store.available else "none"

        def forward(text: str, length: int, sticky: int | None = None) -> list[Message]:
            return cut.forward(compaction.summary_message(text), length, sticky)

        if stored:  # the longest: the one whose tail is shortest, and already upstream-cached
            entry = stored[0]
            messages = forward(entry.text, entry.length, entry.carried)
            tokens = await budget.count(messages)
            if tokens <= budget.tokens:
                return Plan("reused", "hit", messages, entry.length, Usage(), tokens)

        async def make(
            start: int, end: int, previous: str | None
        ) -> tuple[StoredSummary, Usage | None]:
            """The summary of rest[:end], from the one of rest[:start]; usage None: not paid
            here (another request or replica made it)."""
            paid: list[Summary] = []

            async def produce() -> StoredSummary:
                async def keep_chunk(covered: int, partial: Summary) -> None:
                    length = start + covered
                    if 0 < length < end and _starts_cleanly(rest, length):
                        entry = _stored(partial, length, cut.ask_for(length), budget)
                        await self.store.put(keys[length - 1], entry)

                summary = await compaction.summarize_span(
                    summarizer, rest[start:end], previous_summary=previous, on_chunk=keep_chunk
                )
                paid.append(summary)
                return _stored(summary, end, cut.ask_for(end), budget)

            made = await self.flight.run(keys[end - 1], produce)
            return made, (paid[0].usage if paid else None)

        usage = Usage()
        paid = False
        fresh = not stored  # no stored summary to start from
        base = next((e for e in stored if e.length < target), None)
        if stored and stored[0].length >= target:
            current = stored[0]  # covers the cut, but over budget
        else:
            current, made = await make(
                base.length if base else 0, target, base.text if base else None
            )
            if made is not None:
                usage, paid = usage + made, True
        length, text = current.length, current.text
        messages = forward(text, length, current.carried)
        tokens = await budget.count(messages)

        steps = 0
        while tokens > budget.tokens:
            step = _next_stop(cut, length, tokens - budget.tokens, text, budget, steps)
            if step is None:
                break
            current, made = await make(length, step, text)
            if made is not None:
                usage, paid = usage + made, True
            length, text, steps = current.length, current.text, steps + 1
            messages = forward(text, length, current.carried)
            tokens = await budget.count(messages)

        cache: Cache = "hit" if not paid else miss if fresh else "partial"
        if tokens > budget.tokens:
            return Plan("over_budget", cache, messages, length, usage, tokens)
        if not paid:
            return Plan("reused", "hit", messages, length, usage, tokens)
        status: PlanStatus = "compacted" if fresh else "extended"
        return Plan(status, cache, messages, length, usage, tokens)


def _next_stop(
    cut: Cut, length: int, excess: int, summary: str, budget: Budget, steps: int
) -> int | None:
    """The first clean boundary past `length` that drops enough of the tail to fit, allowing
    for the summary to grow by half when extended; the last one after a few tries."""
    later = [s for s in cut.stops if s > length]
    if not later:
        return None
    if steps >= _MAX_STEPS:
        return later[-1]
    needed = excess + budget.count_text(summary) // 2 + 64
    rest = cut.rest
    dropped = 0
    position = length
    for stop in later:
        while position < stop:
            dropped += budget.count_message(rest[position])
            position += 1
        if dropped >= needed:
            return stop
    return later[-1]


def _stored(summary: Summary, length: int, carried: int | None, budget: Budget) -> StoredSummary:
    tokens = budget.count_text(summary.text)
    return StoredSummary(summary.text, length, tokens, summary.usage, time.time(), carried)


def _starts_cleanly(rest: list[Message], length: int) -> bool:
    """A tail may not start with a tool result whose call the summary swallowed."""
    if length >= len(rest):
        return True
    role = rest[length].get("role") if isinstance(rest[length], dict) else None
    return role not in ("tool", "function")
