"""What one replayed run forwarded, turn by turn, and what that costs and loses.

Cost, with simulated provider prompt caching: a forwarded request's cached tokens are those
of the longest prefix it shares with the session's previous forwarded request (the tool
definitions when they are the same, then the leading messages that are equal), when that
prefix is at least `CACHE_MIN_TOKENS` (1,024) tokens; they are billed at the model's cached
input price, the rest at its input price (the pricing table, `[pricing."glob"]`). Summarizer
calls are billed at the summarizer model's input and output prices, without caching; when
that model is not in the table (a local one), at the session model's (what the proxy's
default, the request's own model, would cost). The agent's own replies are not counted: they
are the same whatever the strategy.

Needed-later recall: for each compacted turn, the identifiers (proxy.replay.identifiers) of
the compacted span (the recorded messages not forwarded as they were) that a later assistant
message of the session uses again (its text or its tool calls' arguments, anywhere after the
turn's history) are "needed later"; the share of them still found in the forwarded request
(in a message forwarded as it was, or anywhere in the text of a new one: the summary) is the
turn's recall. Function names the request declares as tools are left out (always present).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.replay import validity
from proxy.replay.engine import Turn
from proxy.replay.identifiers import ByContent, IdentifierCache, message_text, tool_names
from proxy.replay.session import Session
from proxy.tokens import TokenCounter
from proxy.usage.pricing import Price, Pricing

CACHE_MIN_TOKENS = 1024
LOST_EXAMPLES = 12  # identifiers listed as lost per run, at most
HONEST_OVER = ("over_budget", "skipped", "failed")  # over the budget and saying so


class LaterUse:
    """For one session: where each identifier is last used by an assistant message."""

    def __init__(self, session: Session) -> None:
        self.last: dict[str, int] = {}
        ids = IdentifierCache()
        for position, message in enumerate(session.final):
            if isinstance(message, dict) and message.get("role") == "assistant":
                for identifier in ids.of(message):
                    self.last[identifier] = position
        for name in tool_names(session.tools):
            self.last.pop(name, None)

    def wanted(self, found: frozenset[str]) -> tuple[tuple[int, str], ...]:
        """The identifiers of a message an assistant uses somewhere, latest use first."""
        last = self.last
        uses = [(last[i], i) for i in found if i in last]
        uses.sort(reverse=True)
        return tuple(uses)


@dataclass
class TurnRow:
    status: str
    reason: str | None
    cache: str | None
    tokens_before: int
    tokens_after: int
    cached_tokens: int
    calls: int
    summary_input: int
    summary_output: int
    changed: bool  # the forwarded messages are not the recorded ones
    extends: bool | None  # None on the first turn
    problem: str | None
    task_verbatim: bool | None  # None: the request has no user message
    ask_verbatim: bool | None
    needed: int = 0
    kept: int = 0
    lost: list[str] = field(default_factory=list)


class RunMeasure:
    """Fed every turn of one run (`add`), in order; `result()` is its entry in report.json."""

    def __init__(
        self,
        session: Session,
        counter: TokenCounter,
        pricing: Pricing,
        *,
        injected: Sequence[str],
        later: LaterUse,
        summarizer_model: str | None,
        budget: int | None,
    ) -> None:
        self.session = session
        self.counter = counter
        self.model = session.model
        self.price = pricing.price_of(session.model)
        summarizer = pricing.price_of(summarizer_model) if summarizer_model else None
        self.summarizer_price = summarizer or self.price
        self.injected = [re.compile(p) for p in injected]
        self.later = later
        self.budget = budget
        self.rows: list[TurnRow] = []
        self._ids = IdentifierCache()
        self._wanted = ByContent(lambda m: later.wanted(self._ids.of(m)))
        self._previous: list[Any] | None = None
        self._previous_tools: Any = None
        self.seconds = 0.0

    # -- per turn ----------------------------------------------------------------------------

    def add(self, turn: Turn) -> TurnRow:
        original, forwarded = turn.original, turn.messages
        tools = turn.body.get("tools")
        common = self._common_prefix(forwarded)
        same_tools = self._previous is not None and tools == self._previous_tools
        extends = None if self._previous is None else same_tools and common == len(self._previous)
        prefix = 0
        if same_tools and common:
            prefix = self.counter.count_tools(self.model, turn.body)
            prefix += sum(self._count(m) for m in forwarded[:common])
        cached = min(prefix, turn.tokens_after) if prefix >= CACHE_MIN_TOKENS else 0
        row = TurnRow(
            status=turn.status,
            reason=turn.reason,
            cache=turn.cache,
            tokens_before=turn.tokens_before,
            tokens_after=turn.tokens_after,
            cached_tokens=cached,
            calls=turn.calls,
            summary_input=turn.usage.input_tokens,
            summary_output=turn.usage.output_tokens,
            changed=turn.changed,
            extends=extends,
            problem=validity.problem(forwarded) if turn.changed else None,
            task_verbatim=self._kept(self._task(original), forwarded),
            ask_verbatim=self._kept(self._ask(original), forwarded),
        )
        if turn.changed:
            self._recall(row, original, forwarded)
        self.rows.append(row)
        self._previous, self._previous_tools = forwarded, tools
        return row

    def _common_prefix(self, forwarded: list[Any]) -> int:
        previous = self._previous
        if previous is None:
            return 0
        common = 0
        for a, b in zip(previous, forwarded, strict=False):
            if a is not b and a != b:
                break
            common += 1
        return common

    def _count(self, message: Any) -> int:
        return self.counter.count_message(self.model, message)

    def _task(self, messages: list[Any]) -> Any:
        for message in messages:
            if isinstance(message, dict) and message.get("role") == "user":
                return message
        return None

    def _ask(self, messages: list[Any]) -> Any:
        for message in reversed(messages):
            if isinstance(message, dict) and message.get("role") == "user":
                text = message_text(message)
                if not any(p.search(text) for p in self.injected):
                    return message
        return None

    @staticmethod
    def _kept(message: Any, forwarded: list[Any]) -> bool | None:
        if message is None:
            return None
        return any(m is message for m in forwarded) or message in forwarded

    def _recall(self, row: TurnRow, original: list[Any], forwarded: list[Any]) -> None:
        as_sent = {id(m) for m in forwarded}
        length = len(original)
        needed: set[str] = set()
        for message in original:
            if id(message) in as_sent:
                continue
            for position, identifier in self._wanted.of(message):
                if position < length:
                    break  # used again only within the history already sent
                needed.add(identifier)
        if not needed:
            return
        missing = set(needed)
        new_texts: list[str] = []
        originals = {id(m) for m in original}
        for message in forwarded:
            if id(message) not in originals:
                new_texts.append(message_text(message))
                continue
            hit = missing & self._ids.of(message)
            if hit:
                missing -= hit
                if not missing:
                    break
        if missing and new_texts:
            text = "\n".join(new_texts)
            missing = {i for i in missing if i not in text}
        row.needed = len(needed)
        row.kept = len(needed) - len(missing)
        row.lost = sorted(missing)[:LOST_EXAMPLES]

    # -- the run's numbers -------------------------------------------------------------------

    def cost(self) -> dict[str, Any]:
        rows = self.rows
        cached = sum(r.cached_tokens for r in rows)
        prompt = sum(r.tokens_after for r in rows)
        summary_in = sum(r.summary_input for r in rows)
        summary_out = sum(r.summary_output for r in rows)
        forwarded_usd = _usd(self.price, prompt, cached, 0)
        summarizer_usd = _usd(self.summarizer_price, summary_in, 0, summary_out)
        total = None
        if forwarded_usd is not None and summarizer_usd is not None:
            total = forwarded_usd + summarizer_usd
        return {
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "forwarded_usd": forwarded_usd,
            "summarizer_usd": summarizer_usd,
            "total_usd": total,
            "ratio_to_none": None,  # filled in once the baseline is known
        }

    def result(self) -> dict[str, Any]:
        rows = self.rows
        series = [r.tokens_after for r in rows]
        statuses: dict[str, int] = {}
        for r in rows:
            statuses[r.status] = statuses.get(r.status, 0) + 1
        over = [r for r in rows if self.budget is not None and r.tokens_after > self.budget]
        invalid = [r for r in rows if r.problem is not None]
        compactions = [r for r in rows if r.needed]
        shares = [r.kept / r.needed for r in compactions]
        lost: dict[str, int] = {}
        for r in compactions:
            for identifier in r.lost:
                lost[identifier] = lost.get(identifier, 0) + 1
        later = [r.extends for r in rows[1:]]
        return {
            "turns": len(rows),
            "forwarded_tokens": {
                "series": series,
                "min": min(series, default=0),
                "median": statistics.median(series) if series else 0,
                "max": max(series, default=0),
            },
            "statuses": statuses,
            "status_series": [r.status for r in rows],
            "over_budget": {
                "turns": len(over),
                "honest": sum(1 for r in over if r.status in HONEST_OVER),
                "by_status": _tally(r.status for r in over),
            },
            "invalid_requests": {
                "turns": len(invalid),
                "examples": [r.problem for r in invalid[:3]],
            },
            "summarizer": {
                "calls": sum(r.calls for r in rows),
                "input_tokens": sum(r.summary_input for r in rows),
                "output_tokens": sum(r.summary_output for r in rows),
            },
            "cost": self.cost(),
            "prefix_stability": _share(sum(1 for e in later if e), len(later)),
            "recall": {
                "compacted_turns": sum(1 for r in rows if r.changed),
                "measured_turns": len(compactions),
                "needed": sum(r.needed for r in compactions),
                "kept": sum(r.kept for r in compactions),
                "mean": statistics.fmean(shares) if shares else None,
                "worst": min(shares) if shares else None,
                "lost": sorted(lost, key=lambda i: (-lost[i], i))[:LOST_EXAMPLES],
            },
            "task_verbatim": _share(
                sum(1 for r in rows if r.task_verbatim),
                sum(1 for r in rows if r.task_verbatim is not None),
            ),
            "ask_verbatim": _share(
                sum(1 for r in rows if r.ask_verbatim),
                sum(1 for r in rows if r.ask_verbatim is not None),
            ),
        }


def _usd(price: Price | None, prompt: int, cached: int, completion: int) -> float | None:
    return None if price is None else price.cost_usd(prompt, cached, completion)


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _tally(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts
