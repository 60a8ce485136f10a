"""Summarize an over-budget history with the summary store: reuse, extend, or summarize
afresh, and keep the result within the budget.

A transparent proxy's client resends its whole history every turn. Summaries are stored by a
chain hash of the prefix they cover, so a later request with the same prefix reuses one
(no summarizer call, identical forwarded bytes) until it no longer fits the budget; then the
stored summary is extended with only the new span. Cheapest first:

1. reuse:  the longest stored prefix k <= the furthest cut whose result fits the budget
           (one made ahead of need: only once the longest other one no longer fits);
2. extend: a stored prefix k < the cut exists: summarize [summary_k] + rest[k:cut];
3. fresh:  nothing stored: summarize rest[:cut] (folding in chunks, each chunk's summary
           stored at its boundary so a later request can extend from it).

Then the budget is a guarantee: while the result is over, the cut moves forward to a later
clean boundary (`Cut.stops`) and the summary is extended over the messages it passed. When
no boundary is left the result is `over_budget`: the smallest valid request, said so.

`SummaryStage` is the step of the request path (proxy/compaction/pipeline.py) that runs a
`Summarizing` strategy this way: it sizes the kept tail, cuts, decides whether a summary
can help at all, and plans. Its `prepare` makes, in the background and before the budget
is crossed, the summary that step will want then (proxy/preparer.py); stored marked as
prepared, it is reused only once the summary a session uses no longer fits.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

import anyio.to_thread

from proxy.compaction.conversation import Described
from proxy.compaction.cut import PINNED_ROLES, Cut, clean_lengths, cut_messages
from proxy.compaction.offload import off_loop
from proxy.compaction.pipeline import History, Job, StageError, StageResult
from proxy.compaction.protocol import (
    CountMessage,
    Summarizer,
    SummarizerError,
    Summarizing,
    Summary,
)
from proxy.jsonspans import Spans
from proxy.report import NO_USAGE, Cache, Message, Task, Usage
from proxy.sessioncache import SessionCache
from proxy.store import StoredSummary, SummaryFlight, SummaryStore, chain_hashes

CountMessages = Callable[[list[Message]], Awaitable[int]]

PlanStatus = Literal["compacted", "extended", "reused", "over_budget"]
# Moving the cut forward at most this many times before going straight to the last stop.
_MAX_STEPS = 2
# A session's preparations are single flight by the key of its first messages this long.
_SESSION_MESSAGES = 2
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
    capped: bool = False  # a summary made here was cut to summary_max_tokens
    prepared: bool = False  # the summary used (or extended) was made ahead of need


@dataclass(frozen=True)
class Budget:
    """The limit and how to count against it."""

    tokens: int
    count: CountMessages  # the forwarded request, tools included
    count_message: CountMessage
    count_text: Callable[[str], int]


@dataclass(frozen=True)
class Prepared:
    """What a preparation did (proxy/preparer.py): made a summary (`usage`: what it cost),
    or why none was needed: `ahead` (what is stored still leaves room below the threshold),
    `stored` (the summary wanted is stored already), `held` (another task or replica is
    preparing this session's), `nothing` (nothing to summarize, or no store)."""

    status: Literal["made", "ahead", "stored", "held", "nothing"]
    usage: Usage = NO_USAGE
    length: int = 0  # messages of the history the summary made stands for


class SummaryPlanner:
    def __init__(
        self,
        store: SummaryStore,
        flight: SummaryFlight,
        on_prepared: Callable[[str, StoredSummary], None] | None = None,
    ) -> None:
        """`on_prepared(key, entry)`: told when a request first uses a summary made ahead
        of need (proxy/preparer.py stores it again unmarked, off the request's path)."""
        self.store = store
        self.flight = flight
        self.on_prepared = on_prepared
        self._preparing: set[str] = set()  # sessions being prepared for in this process

    async def _keys(
        self,
        cut: Cut,
        scope: str,
        namespace: str,
        spans: Spans | None,
        session: SessionCache | None,
    ) -> list[str]:
        """The store keys of rest[:1] .. rest[:latest]."""
        hashes = partial(chain_hashes, scope, namespace, cut.read[: cut.latest], spans, session)
        if spans is not None and len(spans.raw) <= HASH_ON_LOOP_BYTES:
            return hashes()
        # canonical JSON of every message costs ~10 ms per 400 KB: not on the loop
        return await anyio.to_thread.run_sync(hashes)

    async def plan(
        self,
        cut: Cut,
        compaction: Summarizing,
        summarizer: Summarizer,
        *,
        scope: str,
        namespace: str,
        budget: Budget,
        force: bool,
        accept: Callable[[int], bool],
        spans: Spans | None = None,
        session: SessionCache | None = None,
        reuse_only: bool = False,
    ) -> Plan | None:
        """Raises SummarizerError when a summary had to be made and could not be.

        `accept(k)`: may a summary of rest[:k] be used (it leaves every tool pair whole)?
        `spans`: where the client's messages are in its body, to hash their bytes; `session`:
        the body's session cache, whose chain of an earlier turn is extended.
        `reuse_only`: no summary may be paid for; the longest stored one that applies is
        used as it is, over budget or not (None: nothing stored applies)."""
        target, latest = cut.length, cut.latest
        keys = await self._keys(cut, scope, namespace, spans, session)
        stored = [
            entry
            for entry in await self.store.lookup(keys, latest, accept)
            if not (force and entry.length < target)
        ]
        miss: Cache = "miss" if self.store.available else "none"

        def forward(text: str, length: int, sticky: int | None = None) -> list[Message]:
            return cut.forward(compaction.summary_message(text), length, sticky)

        for entry in _reuse_order(stored):
            messages = forward(entry.text, entry.length, entry.carried)
            tokens = await budget.count(messages)
            if tokens <= budget.tokens or (reuse_only and entry is stored[0]):
                status: PlanStatus = "reused" if tokens <= budget.tokens else "over_budget"
                prepared = self._first_use(keys, entry)
                return Plan(
                    status, "hit", messages, entry.length, NO_USAGE, tokens, False, prepared
                )
        if reuse_only:
            return None

        async def make(
            start: int, end: int, previous: str | None
        ) -> tuple[StoredSummary, Summary | None]:
            return await self._make(
                cut, compaction, summarizer, keys, budget, accept, start, end, previous
            )

        usage = NO_USAGE
        paid = capped = False
        fresh = not stored  # no stored summary to start from
        base = next((e for e in stored if e.length < target), None)
        prepared = False
        if stored and stored[0].length >= target:
            current = stored[0]  # covers the cut, but over budget
            prepared = self._first_use(keys, current)
        else:
            current, made = await make(
                base.length if base else 0, target, base.text if base else None
            )
            if made is not None:
                usage, paid, capped = usage + made.usage, True, made.capped
                prepared = base is not None and self._first_use(keys, base)
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
                usage, paid, capped = usage + made.usage, True, capped or made.capped
            length, text, steps = current.length, current.text, steps + 1
            messages = forward(text, length, current.carried)
            tokens = await budget.count(messages)

        cache: Cache = "hit" if not paid else miss if fresh else "partial"
        if tokens > budget.tokens:
            return Plan("over_budget", cache, messages, length, usage, tokens, capped, prepared)
        if not paid:
            return Plan("reused", "hit", messages, length, usage, tokens, False, prepared)
        status = "compacted" if fresh else "extended"
        return Plan(status, cache, messages, length, usage, tokens, capped, prepared)

    def _first_use(self, keys: list[str], entry: StoredSummary) -> bool:
        """Whether `entry` was made ahead of need and is used for the first time (the
        preparer is told, to store it again unmarked)."""
        if not entry.prepared:
            return False
        if self.on_prepared is not None:
            self.on_prepared(keys[entry.length - 1], entry)
        return True

    async def _make(
        self,
        cut: Cut,
        compaction: Summarizing,
        summarizer: Summarizer,
        keys: list[str],
        budget: Budget,
        accept: Callable[[int], bool],
        start: int,
        end: int,
        previous: str | None,
        *,
        prepared: bool = False,
    ) -> tuple[StoredSummary, Summary | None]:
        """The summary of rest[:end], from the one of rest[:start]; the reply None: not
        paid here (another request or replica made it). Once per key across requests and
        replicas (`SummaryFlight`); each chunk's summary of a long span is stored at its
        boundary too, so a later request can extend from it. `prepared`: made ahead of
        need (the entry at `end` says so)."""
        paid: list[Summary] = []
        read = cut.read
        readable = cut.readable(start, end)

        async def produce() -> StoredSummary:
            async def keep_chunk(covered: int, partial: Summary) -> None:
                length = readable[covered - 1] + 1 if covered else start
                if 0 < length < end and accept(length):
                    entry = _stored(partial, length, cut.ask_for(length), budget)
                    await self.store.put(keys[length - 1], entry)

            span = [read[i] for i in readable]
            summary = await compaction.summarize_span(
                summarizer, span, previous_summary=previous, on_chunk=keep_chunk
            )
            paid.append(summary)
            return _stored(summary, end, cut.ask_for(end), budget, prepared)

        made = await self.flight.run(keys[end - 1], produce)
        return made, (paid[0] if paid else None)

    async def prepare(
        self,
        cut: Cut,
        compaction: Summarizing,
        summarizer: Summarizer,
        *,
        scope: str,
        namespace: str,
        budget: Budget,
        accept: Callable[[int], bool],
        tokens: int,
        threshold: int,
        target: Callable[[int], Awaitable[int]],
        spans: Spans | None = None,
        session: SessionCache | None = None,
    ) -> Prepared:
        """Make, ahead of need, the summary a later request of this history will want.

        The request as it would be forwarded now (with the longest stored summary that
        applies, or as it is when none does: `tokens`) is measured against `threshold`;
        under it, nothing is needed yet. Else the summary of rest[:target(forwarded)] is
        made (extending the longest stored one shorter than that) and stored, marked as
        prepared. One preparation per session at a time, across replicas: a lock named
        for the session's first messages (sessions that start alike share it: one of them
        waits for the next turn). Raises SummarizerError when the summarizer fails."""
        latest = cut.latest
        keys = await self._keys(cut, scope, namespace, spans, session)
        if not keys:
            return Prepared("nothing")
        lock = "prepare:" + keys[min(latest, _SESSION_MESSAGES) - 1]
        if lock in self._preparing:
            return Prepared("held")
        self._preparing.add(lock)
        try:
            token = secrets.token_hex(16)
            if await self.store.acquire_lock(lock, token) != "acquired":
                return Prepared("held")  # (or the store is down: nothing could be stored)
            try:
                return await self._prepare(
                    cut, compaction, summarizer, keys, budget, accept, tokens, threshold, target
                )
            finally:
                await self.store.release_lock(lock, token)
        finally:
            self._preparing.discard(lock)

    async def _prepare(
        self,
        cut: Cut,
        compaction: Summarizing,
        summarizer: Summarizer,
        keys: list[str],
        budget: Budget,
        accept: Callable[[int], bool],
        tokens: int,
        threshold: int,
        target: Callable[[int], Awaitable[int]],
    ) -> Prepared:
        """`prepare` once the session's lock is taken."""
        latest = cut.latest
        stored = await self.store.lookup(keys, latest, accept)
        used = next((entry for entry in stored if not entry.prepared), None)
        ahead = next((entry for entry in stored if entry.prepared), None)
        if ahead is not None and (used is None or ahead.length > used.length):
            return Prepared("stored")  # made ahead already: waiting for the budget
        forwarded = tokens
        if stored:
            entry = stored[0]
            summary = compaction.summary_message(entry.text)
            forwarded = await budget.count(cut.forward(summary, entry.length, entry.carried))
        if forwarded < threshold:
            return Prepared("ahead")
        length = await target(forwarded)
        if (stored and stored[0].length >= length) or not accept(length):
            return Prepared("stored" if stored else "nothing")
        base = stored[0] if stored else None
        _, made = await self._make(
            cut, compaction, summarizer, keys, budget, accept,
            base.length if base else 0, length, base.text if base else None,
            prepared=True,
        )  # fmt: skip
        if made is None:  # made meanwhile by a request that needed it
            return Prepared("stored")
        return Prepared("made", made.usage, length)


def _reuse_order(stored: list[StoredSummary]) -> list[StoredSummary]:
    """Which stored summaries to try as they are, first that fits: the longest (its tail is
    the shortest, and it is already in the upstream's prompt cache), but one made ahead of
    need and not used yet only once the longest of the others no longer fits, so a
    session switches to it when it crosses the budget, not as soon as it is stored (the
    forwarded prefix, and the prompt cache, stay as they are until then)."""
    used = next((entry for entry in stored if not entry.prepared), None)
    ahead = next((entry for entry in stored if entry.prepared), None)
    order = [entry for entry in (used, ahead) if entry is not None]
    if stored and stored[0] not in order:
        order.append(stored[0])
    return order


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


def _stored(
    summary: Summary, length: int, carried: int | None, budget: Budget, prepared: bool = False
) -> StoredSummary:
    tokens = budget.count_text(summary.text)
    return StoredSummary(
        summary.text, length, tokens, summary.usage, time.time(), carried, prepared
    )


@dataclass(frozen=True)
class SummaryOptions:
    """What sizes the kept tail and says whether a summary can help."""

    keep_recent_ratio: float = 0.3
    summary_max_tokens: int = 2000


class SummaryStage:
    """A `Summarizing` strategy as a stage of the request path (see the module docstring).

    `namespace`: everything that shapes its summaries (the store's keys start from it);
    `planner` is used for requests with a store scope, `unstored` for the others."""

    def __init__(
        self,
        name: str,
        strategy: Summarizing,
        fingerprint: str,
        namespace: str,
        planner: SummaryPlanner,
        unstored: SummaryPlanner,
        options: SummaryOptions,
    ) -> None:
        self.name = name
        self.strategy = strategy
        self.fingerprint = fingerprint
        self.namespace = namespace
        self.planner = planner
        self.unstored = unstored
        self.options = options

    async def _cut(self, history: History, job: Job, keep_tokens: int | None) -> Cut:
        messages = history.messages
        return await off_loop(
            len(messages),
            cut_messages,
            messages,
            history.describe(job.format),
            job.rules,
            keep_tokens=keep_tokens,
            count=job.counting.range_of(messages),
            source=history.source,
        )

    def _accept(self, history: History, job: Job, cut: Cut) -> Callable[[int], bool]:
        """May a summary of rest[:k] be used: it leaves every tool pair whole."""
        described = history.describe(job.format)
        start = len(cut.pinned)
        clean = clean_lengths(described, start)
        whole = len(described) - start
        return lambda length: length >= whole or length in clean

    async def run(self, history: History, job: Job) -> StageResult:
        messages = history.messages
        described = history.describe(job.format)
        counting = job.counting
        cut = await self._cut(history, job, self.keep_tokens(messages, described, job))
        if not cut.to_compact:
            return StageResult(None, "skipped", "nothing_to_compact")
        strategy = self.strategy
        floor = await counting.request(cut.forward(strategy.summary_message(""), cut.latest))
        # Pinned + tools + protected + the minimum tail alone are over budget, and what a
        # summary could replace is no larger than a summary may be: no summary is paid for,
        # but one already stored is used.
        reuse_only = (
            not job.force
            and floor > job.budget
            and history.tokens - floor <= self.options.summary_max_tokens
        )
        planner, scope = self.planner, job.scope
        if scope is None:  # no store: a scope of its own, so not even single flight is shared
            planner, scope = self.unstored, f"request:{uuid.uuid4().hex}"
        try:
            plan = await planner.plan(
                cut,
                strategy,
                job.summarizer,
                scope=scope,
                namespace=self.namespace,
                budget=Budget(job.budget, counting.request, counting.message, counting.text),
                force=job.force,
                accept=self._accept(history, job, cut),
                spans=job.spans,
                session=job.cache,
                reuse_only=reuse_only,
            )
        except SummarizerError as error:
            cache: Cache | None = None if planner.store.available else "none"
            raise StageError(error.reason, str(error), error.usage, cache) from None
        if plan is None:
            return StageResult(None, "skipped", "preserved_over_budget")
        if plan.tokens >= history.tokens:
            # The summary is longer than what it replaces: forward what came in instead.
            return StageResult(None, "skipped", "no_gain", usage=plan.usage, cache=plan.cache)
        return StageResult(
            History(plan.messages, plan.tokens),
            plan.status,
            "summary_capped" if plan.capped else None,
            usage=plan.usage,
            cache=plan.cache,
            summarized=plan.summarized,
            task=_task_state(cut, plan.summarized),
            prepared=plan.prepared,
        )

    async def prepare(self, history: History, job: Job, threshold: int) -> Prepared:
        """Make ahead of need the summary a compaction of this history at the budget will
        want (`SummaryPlanner.prepare`), when its request as forwarded now is at least
        `threshold` tokens. Raises SummarizerError.

        Which span: the one the cut will take when the budget is crossed. The kept tail is
        sized as for a compaction (`keep_tokens`); the messages still to come before the
        budget is crossed (about budget - forwarded tokens) will be part of that tail, so
        what of this history stays verbatim is the tail less that. When the budget is
        crossed, the stored summary is then reused as it is (or extended by what came
        past the expected)."""
        if job.scope is None or not self.planner.store.available:
            return Prepared("nothing")
        messages = history.messages
        described = history.describe(job.format)
        keep = self.keep_tokens(messages, described, job)
        cut = await self._cut(history, job, keep)
        if not cut.to_compact:
            return Prepared("nothing")

        async def target(forwarded: int) -> int:
            if keep is None:  # the reference's tail: a number of messages, whatever comes
                return cut.length
            later = await self._cut(history, job, max(0, keep - (job.budget - forwarded)))
            return later.length

        counting = job.counting
        return await self.planner.prepare(
            cut,
            self.strategy,
            job.summarizer,
            scope=job.scope,
            namespace=self.namespace,
            budget=Budget(job.budget, counting.request, counting.message, counting.text),
            accept=self._accept(history, job, cut),
            tokens=history.tokens,
            threshold=threshold,
            target=target,
            spans=job.spans,
            session=job.cache,
        )

    def keep_tokens(self, messages: list[Message], described: Described, job: Job) -> int | None:
        """How many tokens of recent messages to keep verbatim: `keep_recent_ratio` of what
        remains of the budget after the tools, the pinned messages, the task (the messages
        up to the first user message, inclusive) and the summary reserve
        (`summary_max_tokens`, at most a quarter of the budget), so the first summary made
        usually fits as it is. None: the reference's tail."""
        ratio = self.options.keep_recent_ratio
        if ratio <= 0:
            return None
        reserve = min(self.options.summary_max_tokens, job.budget // 4)
        entries = described.entries
        task = next((u for u in described.users if not entries[u].context), None)
        if task is not None:
            end = task + 1
        else:  # no task: the pinned messages only
            end = 0
            while end < len(entries) and entries[end].role in PINNED_ROLES:
                end += 1
        fixed = sum(job.counting.each(messages[:end]))
        room = job.budget - job.counting.tools - reserve - fixed
        return max(0, round(ratio * room))


def _task_state(cut: Cut, summarized: int) -> Task | None:
    """Whether the summary covered the first user message, and how it reached the model."""
    if cut.task is not None and cut.task < summarized:
        return "verbatim"
    if cut.task_summarized:
        return "summarized"
    return None
