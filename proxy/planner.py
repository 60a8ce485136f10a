"""Plan an over-budget request with the summary store: reuse, extend, or summarize afresh.

A transparent proxy's client resends its whole history every turn. Summaries are stored by a
chain hash of the prefix they cover, so a later request with the same prefix reuses one
(no summarizer call, identical forwarded bytes) until it no longer fits the budget; then the
stored summary is extended with only the new span. Cheapest first:

1. reuse:  the longest stored prefix k <= cut whose result (pinned + summary_k + rest[k:])
           fits the budget;
2. extend: a stored prefix k < cut exists but doesn't fit: summarize [summary_k] + rest[k:cut];
3. fresh:  nothing stored: summarize rest[:cut] (folding in chunks, each chunk's summary
           stored at its boundary so a later request can extend from it).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from proxy.compaction.protocol import Message, Summarizer, Summary, Usage
from proxy.compaction.simple import Prepared, SimpleCompaction
from proxy.store import StoredSummary, SummaryFlight, SummaryStore, chain_hashes

CountMessages = Callable[[list[Message]], Awaitable[int]]


@dataclass(frozen=True)
class Plan:
    """What to forward and how it was obtained.

    status: compacted (fresh) | extended | reused;  cache: hit | partial | miss | none.
    """

    status: str
    cache: str
    messages: list[Message]
    summarized: int
    usage: Usage
    tokens: int  # prompt tokens of the request as forwarded


class SummaryPlanner:
    def __init__(self, store: SummaryStore, flight: SummaryFlight) -> None:
        self.store = store
        self.flight = flight

    async def plan(
        self,
        prepared: Prepared,
        compaction: SimpleCompaction,
        summarizer: Summarizer,
        *,
        scope: str,
        namespace: str,
        budget: int,
        force: bool,
        count: CountMessages,
        count_text: Callable[[str], int],
        custom_instruction: str = "",
        carry: Message | None = None,
    ) -> Plan:
        """Raises SummarizerError when a summary had to be made and could not be.

        `carry`: a message inside the compacted span (the latest user message, in agent
        loops) that is forwarded verbatim right after the summary whenever the summary
        covers it.
        """
        pinned = prepared.pinned
        rest = [*prepared.to_compact, *prepared.to_preserve]
        cut = len(prepared.to_compact)
        keys = chain_hashes(scope, namespace, prepared.to_compact)
        stored = await self.store.lookup_all(keys, cut)
        cache = "miss" if self.store.available else "none"

        carry_at = next((i for i, m in enumerate(rest) if m is carry), len(rest))

        def forward(summary: str, length: int) -> list[Message]:
            carried = [rest[carry_at]] if carry_at < length else []
            return [*pinned, compaction.summary_message(summary), *carried, *rest[length:]]

        for entry in stored:
            if force and entry.length != cut:
                continue  # `force` asks for the full compaction, not a cheaper fit
            if not _starts_cleanly(rest, entry.length):
                continue  # a chunk boundary that would orphan a tool result
            messages = forward(entry.text, entry.length)
            tokens = await count(messages)
            if tokens <= budget or entry.length == cut:
                return Plan("reused", "hit", messages, entry.length, Usage(), tokens)

        base = stored[0] if stored else None
        start = base.length if base is not None else 0
        paid: list[Summary] = []

        async def make() -> StoredSummary:
            async def keep_chunk(covered: int, partial: Summary) -> None:
                length = start + covered
                if 0 < length < cut:
                    await self.store.put(keys[length - 1], _stored(partial, length, count_text))

            summary = await compaction.summarize_span(
                summarizer,
                prepared.to_compact[start:],
                previous_summary=base.text if base is not None else None,
                custom_instruction=custom_instruction,
                on_chunk=keep_chunk,
            )
            paid.append(summary)
            return _stored(summary, cut, count_text)

        made = await self.flight.run(keys[cut - 1], make)
        messages = forward(made.text, cut)
        tokens = await count(messages)
        if not paid:  # another request (or replica) made it while we waited
            return Plan("reused", "hit", messages, cut, Usage(), tokens)
        if base is not None:
            return Plan("extended", "partial", messages, cut, paid[0].usage, tokens)
        return Plan("compacted", cache, messages, cut, paid[0].usage, tokens)


def _stored(summary: Summary, length: int, count_text: Callable[[str], int]) -> StoredSummary:
    return StoredSummary(summary.text, length, count_text(summary.text), summary.usage, time.time())


def _starts_cleanly(rest: list[Message], length: int) -> bool:
    """A tail may not start with a tool result whose call the summary swallowed."""
    if length >= len(rest):
        return True
    role = rest[length].get("role") if isinstance(rest[length], dict) else None
    return role not in ("tool", "function")
