"""The compaction step of the request path: decide, compact, and say what happened.

It owns the policy (budget, per-request control headers, no-progress guard, failure policy)
and returns it as a `Decision`; the algorithm lives behind the `Compaction` protocol in
proxy/compaction/ (the strategy `compaction.strategy` names), the store logic in the planner.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, Protocol

import httpx

from proxy.compaction.cut import CutRules, message_keys
from proxy.compaction.offload import off_loop
from proxy.compaction.protocol import (
    Compaction,
    Cut,
    Message,
    Spend,
    Summarizer,
    SummarizerError,
    Summary,
)
from proxy.compaction.strategies import (
    BUILT_IN,
    StrategyFactory,
    StrategyOptions,
    load_strategy,
)
from proxy.compaction.summarizer import CircuitBreaker, UpstreamSummarizer
from proxy.errors import ProxyError
from proxy.jsonspans import Parsed, Spans, spans_of
from proxy.metrics import Metrics
from proxy.planner import Budget, SummaryPlanner
from proxy.report import Cache, Decision, Outcome
from proxy.settings import ConfigError, Settings
from proxy.store import (
    CHAIN_VERSION,
    ChainMemo,
    NullStore,
    SummaryFlight,
    SummaryStore,
    namespace_for,
)

log = logging.getLogger("proxy.compaction")
_NAMESPACES = 1024  # (summarizer model, strategy fingerprint) pairs whose namespace is kept
_COMPACTIONS = 64  # built-in strategy objects kept, one per summarizer model and options
_BUILT_IN_FACTORIES = tuple(BUILT_IN.values())
_SPANS_COUNTS = 2  # count profiles (encodings) whose counts a body keeps (turnmemo's bound)


class PromptCounter(Protocol):
    """What the request path needs from token counting (proxy.tokens.TokenCounter)."""

    @property
    def estimated(self) -> bool: ...

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

    def profile_key(self, model: str) -> str: ...

    def count_messages(self, model: str, messages: list[Any]) -> int: ...

    def count_tools(self, model: str, body: dict[str, Any]) -> int: ...

    async def acount_request(
        self, body: dict[str, Any], keys: Sequence[int | None] | None = None
    ) -> int: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Control:
    """Per-request overrides from the `x-compaction` / `x-compaction-budget` headers."""

    mode: Literal["auto", "off", "force"] = "auto"
    budget: int | None = None
    strategy: str | None = None  # a proxy key's own strategy; None: compaction.strategy


def model_of(body: dict[str, Any]) -> str:
    model = body.get("model")
    return model if isinstance(model, str) else ""


@dataclass(frozen=True)
class MessageCounts:
    """The tokens of one of a request's messages (`count`) or of many at once (`each`, one
    memo lookup for all: the cut walks the recent tail with it). A client message's count
    comes from `counts` (each of the body's messages, by position) when known."""

    counter: PromptCounter
    model: str
    spans: Spans | None  # the messages' own keys, when their bytes are known
    counts: Sequence[int] | None = None  # the tokens of each of spans.messages

    def __call__(self, message: Message) -> int:
        if self.spans is None:
            return self.counter.count_message(self.model, message)
        index = self.spans.index_of(message)
        if index is not None and self.counts is not None:
            return self.counts[index]
        key = None if index is None else self.spans.keys()[index]
        return self.counter.count_message(self.model, message, key)

    def each(self, messages: Sequence[Message]) -> list[int]:
        if self.spans is None:
            return self.counter.count_each(self.model, messages)
        if self.counts is not None:
            first = self.spans.run_of(messages)
            if first is not None:
                return list(self.counts[first : first + len(messages)])
        return self.counter.count_each(self.model, messages, self.spans.keys_for(messages))

    async def listed(self, messages: Sequence[Message]) -> int:
        """The sum of the counts of `messages`: the client's from `counts`, the others (a
        summary) from the counter."""
        if self.spans is None or self.counts is None:
            keys = None if self.spans is None else self.spans.keys_for(messages)
            return sum(await self.counter.acount_each(self.model, messages, keys))
        counts, index_of = self.counts, self.spans.index_of
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
        return total


@dataclass(frozen=True)
class Job:
    """One over-budget (or forced) request, as the policy sees it."""

    body: dict[str, Any]
    model: str
    summarizer_model: str
    tokens: int
    budget: int
    force: bool
    client_headers: dict[str, str]
    scope: str | None  # the summary store tenant (None: no store)
    strategy: str | None = None  # None: compaction.strategy
    spans: Spans | None = None  # where body["messages"] are in the client's bytes
    tools: int | None = None  # the tokens of the body's tool definitions (None: not counted)
    counts: Sequence[int] | None = None  # the tokens of each of spans.messages
    spend: Spend | None = None  # what its summarizer calls cost, as they answer

    @property
    def messages(self) -> list[Message]:
        messages: list[Message] = self.body["messages"]
        return messages


class Compactor:
    def __init__(
        self,
        settings: Settings,
        counter: PromptCounter,
        client: httpx.AsyncClient,
        store: SummaryStore,
        metrics: Metrics,
    ) -> None:
        """Raises ConfigError when `compaction.strategy` cannot be loaded."""
        self.settings = settings
        self.counter = counter
        self.client = client
        self.store = store
        self.metrics = metrics
        self.planner = SummaryPlanner(store, SummaryFlight(store), ChainMemo())
        unstored = NullStore()
        self.unstored_planner = SummaryPlanner(unstored, SummaryFlight(unstored))
        summarizer = settings.compaction.summarizer
        self.breaker = CircuitBreaker(
            summarizer.breaker_failures,
            summarizer.breaker_cooldown_s,
            on_change=metrics.breaker_changed,
        )
        self._other_strategies: dict[str, StrategyFactory] = {}
        self._namespaces: dict[tuple[str, str], str] = {}
        # Built-in strategies hold nothing of a request: one per (summarizer model, options),
        # with its fingerprint (a JSON encoding and a hash) made once.
        self._compactions: dict[tuple[object, ...], tuple[Compaction, str]] = {}
        self._built_fingerprints: dict[int, tuple[Compaction, str]] = {}  # by id, held
        config = settings.compaction
        # One for the process: it remembers which user messages matched the injected patterns.
        self.rules = CutRules(
            config.max_preserved_messages,
            "carry" if config.keep_last_user_message else "off",
            config.task_max_tokens if config.protect_task else None,
            tuple(config.injected_user_patterns),
        )
        try:
            self.strategy_factory = load_strategy(settings.compaction.strategy)
        except ValueError as exc:
            raise ConfigError(f"invalid config: compaction.strategy: {exc}") from None

    async def run(
        self,
        body: dict[str, Any],
        control: Control,
        *,
        client_headers: dict[str, str],
        scope: str | None,
        parsed: Parsed | None = None,
        spend: Spend | None = None,
    ) -> Outcome:
        """`spend`: told what each summarizer call costs as it answers.
        `client_headers`: what the summarizer call carries, as
        `headers.summarizer_request_headers` decided it; `scope`: the summary store tenant;
        `parsed`: the client's bytes and where the messages are in them (proxy.jsonspans);
        when the step runs and they are not known yet, they are found and `parsed.spans` set.

        Raises ProxyError (502) when compaction failed and `on_error = "reject"`."""
        started = time.perf_counter()
        config = self.settings.compaction
        model = model_of(body)
        if control.mode == "off" or not config.enabled:  # nothing to decide: not even counted
            outcome = Outcome(status="off")
            self.metrics.observe(outcome, time.perf_counter() - started)
            return outcome
        spans = parsed.spans if parsed is not None else None
        if spans is not None and body.get("messages") is not spans.messages:
            spans = parsed = None  # not this body's messages
        tools: int | None = None
        counts: list[int] | None = None
        if spans is not None:  # each message's count, kept with the spans for the next turn
            counts = await self.message_counts(model, spans)
            tools = self.counter.count_tools(model, body)
            tokens = self.counter.request_tokens(sum(counts), tools)
        else:
            tokens = await self.counter.acount_request(body)
        budget = control.budget or config.budget_for(model)
        force = control.mode == "force"
        if (tokens > budget or force) and parsed is not None and spans is None:
            # The store keys hash the client's bytes of each message, whatever the body's size.
            spans = parsed.spans = await spans_of(parsed.raw)
            if spans is not None:
                body["messages"] = spans.messages  # the same values, read from the same bytes
        if tokens > budget or force:
            job = Job(
                body,
                model,
                config.summarizer.model or model,
                tokens,
                budget,
                force,
                client_headers,
                scope,
                control.strategy,
                spans,
                tools,
                counts,
                spend,
            )
            decision = await self.decide(job)
        else:
            decision = Decision("passthrough")
        outcome = Outcome.of(
            decision, tokens_before=tokens, budget=budget, estimated=self.counter.estimated
        )
        seconds = time.perf_counter() - started
        if decision.status != "passthrough":
            self.log_decision(outcome, model, seconds)
        self.metrics.observe(outcome, seconds)
        if decision.status == "failed" and config.on_error == "reject":
            raise ProxyError(
                502,
                f"Compaction failed ({decision.reason}): {decision.error}",
                type="upstream_error",
                code="compaction_failed",
                headers=outcome.headers(),
            )
        return outcome

    async def decide(self, job: Job) -> Decision:
        """Over budget (or forced): skip when compaction can't help, else plan and compact."""
        config = self.settings.compaction
        compaction = self.compaction_for(job.summarizer_model, job.strategy)

        spans = job.spans
        count_message = MessageCounts(self.counter, job.model, spans, job.counts)
        tools = job.tools
        if tools is None:
            tools = self.counter.count_tools(job.model, job.body)

        async def count(messages: list[Message]) -> int:
            """The prompt tokens of the body with `messages` instead of its own."""
            return self.counter.request_tokens(await count_message.listed(messages), tools)

        with message_keys(None if spans is None else spans.keys_for, spans):
            cut = await off_loop(
                len(job.messages),
                compaction.cut,
                job.messages,
                keep_tokens=self.keep_tokens(job, count_message, tools),
                count=count_message,
            )
        if not cut.to_compact:
            return Decision("skipped", "nothing_to_compact")
        floor = await count(cut.forward(compaction.summary_message(""), cut.latest))
        if not job.force and floor > job.budget and job.tokens - floor <= config.summary_max_tokens:
            # Pinned + tools + protected + the minimum tail alone are over budget, and what a
            # summary could replace is no larger than a summary may be: it cannot help.
            return Decision("skipped", "preserved_over_budget")
        planner, scope = self.planner, job.scope
        if scope is None:  # no store: a scope of its own, so not even single flight is shared
            planner, scope = self.unstored_planner, f"request:{uuid.uuid4().hex}"
        try:
            plan = await planner.plan(
                cut,
                compaction,
                _Deferred(
                    partial(self.summarizer_for, job.summarizer_model, job.client_headers),
                    job.spend,
                ),
                scope=scope,
                namespace=self.namespace(job.summarizer_model, compaction),
                budget=Budget(
                    job.budget,
                    count,
                    count_message,
                    lambda text: self.counter.count_text(job.model, text),
                ),
                force=job.force,
                spans=spans,
            )
        except SummarizerError as error:
            cache: Cache | None = None if planner.store.available else "none"
            return Decision("failed", error.reason, cache=cache, error=str(error))
        if not job.force and plan.tokens >= job.tokens:
            # The summary is longer than what it replaces: forward the original instead.
            return Decision("skipped", "no_gain", cache=plan.cache, usage=plan.usage)
        return Decision(
            plan.status,
            "over_budget" if plan.status == "over_budget" else None,
            messages=plan.messages,
            tokens_after=plan.tokens,
            summarized=plan.summarized,
            usage=plan.usage,
            cache=plan.cache,
            task=_task_state(cut, plan.summarized),
        )

    def keep_tokens(self, job: Job, count: MessageCounts, tools: int) -> int | None:
        """How many tokens of recent messages to keep verbatim: `keep_recent_ratio` of the
        budget, less what the pinned messages, the task, the tools and a summary need (a
        summary is taken as `summary_max_tokens`, at most a quarter of the budget), so the
        first summary made usually fits as it is. None: the reference's tail."""
        config = self.settings.compaction
        if config.keep_recent_ratio <= 0:
            return None
        summary = min(config.summary_max_tokens, job.budget // 4)
        fixed = tools + summary
        for message in job.messages:
            fixed += count(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break  # the task, the first user message, is the last one kept up front
        room = job.budget - fixed
        return max(0, min(round(config.keep_recent_ratio * job.budget), room))

    async def message_counts(self, model: str, spans: Spans) -> list[int]:
        """The tokens of each of the body's messages: those of the body it extends from its
        spans (kept by an earlier turn), the others counted (and kept for the next turn)."""
        key = self.counter.profile_key(model)
        kept = spans.counts.get(key)
        total = len(spans.messages)
        if kept is not None and len(kept) == total:
            return kept
        known = kept if kept is not None and len(kept) < total else []
        start = len(known)
        keys = spans.keys()
        counts = known + await self.counter.acount_each(
            model, spans.messages[start:], keys[start:], counted=sum(known)
        )
        if key not in spans.counts and len(spans.counts) >= _SPANS_COUNTS:
            spans.counts.pop(next(iter(spans.counts)), None)  # the oldest profile's
        spans.counts[key] = counts
        return counts

    def namespace(self, summarizer_model: str, compaction: Compaction) -> str:
        """Everything that shapes a summary's text: a change starts a new set of keys."""
        fingerprint = self._fingerprint_of(compaction)
        known = self._namespaces.get((summarizer_model, fingerprint))
        if known is not None:
            return known
        if len(self._namespaces) >= _NAMESPACES:  # model names are client input
            self._namespaces.clear()
        namespace = self._namespaces[(summarizer_model, fingerprint)] = namespace_for(
            model=summarizer_model,
            base_url=self.settings.compaction.summarizer.base_url
            or self.settings.upstream.base_url,
            strategy=fingerprint,
            chain=CHAIN_VERSION,
        )
        return namespace

    def _fingerprint_of(self, compaction: Compaction) -> str:
        built = self._built_fingerprints.get(id(compaction))
        if built is not None and built[0] is compaction:
            return built[1]
        return compaction.fingerprint

    def compaction_for(self, summarizer_model: str, strategy: str | None = None) -> Compaction:
        config = self.settings.compaction
        factory = self.strategy_factory
        if strategy is not None and strategy != config.strategy:
            factory = self._other_strategies.get(strategy) or self._other_strategies.setdefault(
                strategy,
                load_strategy(strategy),  # names were checked when the key was loaded
            )
        built_in = any(factory is known for known in _BUILT_IN_FACTORIES)
        key: tuple[object, ...] = ()
        if built_in:  # everything the options below are made of
            key = (
                factory,
                summarizer_model,
                config.summary_role,
                config.summarizer.max_message_tokens,
                config.summarizer.context_tokens,
                config.summary_max_tokens,
                config.custom_instruction,
            )
            kept = self._compactions.get(key)
            if kept is not None:
                return kept[0]
        compaction = factory(
            StrategyOptions(
                rules=self.rules,
                summary_role=config.summary_role,
                max_message_tokens=config.summarizer.max_message_tokens,
                context_tokens=config.summarizer.context_tokens,
                summary_max_tokens=config.summary_max_tokens,
                custom_instruction=config.custom_instruction,
                count_tokens=lambda text: self.counter.count_text(summarizer_model, text),
            )
        )
        if built_in:
            if len(self._compactions) >= _COMPACTIONS:  # model names are client input
                self._compactions.clear()
                self._built_fingerprints.clear()
            self._compactions[key] = (compaction, compaction.fingerprint)
            self._built_fingerprints[id(compaction)] = self._compactions[key]
        return compaction

    def summarizer_for(self, model: str, client_headers: dict[str, str]) -> UpstreamSummarizer:
        """Defaults: the upstream's URL and the request's model; `client_headers` carry the
        credential and organization/project headers, so the summary is billed where the
        request is."""
        config = self.settings.compaction.summarizer
        upstream = self.settings.upstream
        return UpstreamSummarizer(
            self.client,
            base_url=config.base_url or upstream.base_url,
            model=model,
            headers=client_headers,
            max_tokens=self.settings.compaction.summary_max_tokens,
            timeout_s=config.timeout_s,
            retries=config.retries,
            backoff_base_s=config.backoff_base_s,
            breaker=self.breaker,
            on_result=self.metrics.summarizer_call,
        )

    def log_decision(self, outcome: Outcome, model: str, seconds: float) -> None:
        """One structured line per compaction decision; never any content."""
        log.info(
            "compaction %s",
            outcome.status,
            extra={
                "model": model,
                "status": outcome.status,
                "reason": outcome.reason,
                "tokens_before": outcome.tokens_before,
                "tokens_after": outcome.tokens_after,
                "budget": outcome.budget,
                "messages_summarized": outcome.summarized,
                "summary_input_tokens": outcome.usage.input_tokens,
                "summary_output_tokens": outcome.usage.output_tokens,
                "cache": outcome.cache,
                "duration_ms": round(seconds * 1000, 1),
            },
        )


class _Deferred:
    """A summarizer made on its first call: a turn served from the store makes none. Each
    call the upstream answered is added to `spend` as it answers."""

    __slots__ = ("_made", "_make", "_spend")

    def __init__(self, make: Callable[[], Summarizer], spend: Spend | None = None) -> None:
        self._make = make
        self._made: Summarizer | None = None
        self._spend = spend

    async def summarize(self, system_prompt: str, messages: list[Message]) -> Summary:
        if self._made is None:
            self._made = self._make()
        spend = self._spend
        if spend is None:
            return await self._made.summarize(system_prompt, messages)
        try:
            summary = await self._made.summarize(system_prompt, messages)
        except SummarizerError as error:
            spend.add(error.usage)
            raise
        spend.add(summary.usage)
        return summary


def _task_state(cut: Cut, summarized: int) -> Literal["verbatim", "summarized"] | None:
    """Whether the summary covered the first user message, and how it reached the model."""
    if cut.task is not None and cut.task < summarized:
        return "verbatim"
    if cut.task_summarized:
        return "summarized"
    return None
