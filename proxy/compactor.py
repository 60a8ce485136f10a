"""The compaction step of the request path: count, decide, compact, and say what happened.

`Compactor.run` is the one entry point (the chat handler and the replay tool call it). It
owns the policy (budget, per-request control headers, the strategies to run, the failure
policy) and returns it as a value, an `Outcome`: it never raises for a failed compaction
and never answers HTTP. Under `compaction.on_error = "reject"` a failed outcome says
`rejected`, and the handler answers `compaction_error(outcome)`.

The strategies run as stages (proxy/compaction/pipeline.py): masking and a user's own
`compact` as they are, summarizing strategies through the summary store (proxy/planner.py).
Metrics hear about decisions and summarizer calls through the `CompactionObserver` given,
so this module imports nothing of the web layer.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal, Protocol

import httpx

from proxy.compaction.chat_format import ChatFormat
from proxy.compaction.conversation import Described, Format, describe
from proxy.compaction.cut import CutRules
from proxy.compaction.mask import MaskCompaction, MaskOptions
from proxy.compaction.offload import off_loop
from proxy.compaction.pipeline import (
    Counting,
    History,
    Job,
    MaskStage,
    MessageCounter,
    RewriteStage,
    Stage,
    compose,
)
from proxy.compaction.protocol import (
    Compaction,
    Message,
    Spend,
    Summarizer,
    SummarizerError,
    Summarizing,
    Summary,
)
from proxy.compaction.responses_format import ResponsesFormat
from proxy.compaction.strategies import (
    Loaded,
    StrategyOptions,
    fingerprint_for,
    load_strategy,
    stage_names,
)
from proxy.compaction.summarizer import CircuitBreaker, UpstreamSummarizer
from proxy.errors import ProxyError
from proxy.jsonspans import Parsed, Spans, spans_of
from proxy.planner import Prepared, SummaryOptions, SummaryPlanner, SummaryStage
from proxy.preparer import PrepareObserver, Preparer
from proxy.report import Decision, Outcome
from proxy.sessioncache import Ahead
from proxy.settings import ConfigError, Settings
from proxy.store import CHAIN_VERSION, NullStore, SummaryFlight, SummaryStore, namespace_for
from proxy.tokens.responses import ResponsesCounter, has_opaque

log = logging.getLogger("proxy.compaction")
_STAGES = 64  # rows of stages kept, one per (strategy, summarizer model): models are input


class PromptCounter(MessageCounter, Protocol):
    """What the request path needs from token counting (proxy.tokens.TokenCounter): the
    stages' counts, and whole requests."""

    @property
    def estimated(self) -> bool: ...

    def profile_key(self, model: str) -> str: ...

    def count_messages(self, model: str, messages: list[Any]) -> int: ...

    def count_tools(self, model: str, body: dict[str, Any]) -> int: ...

    async def acount_request(
        self, body: dict[str, Any], keys: Sequence[int | None] | None = None
    ) -> int: ...

    def close(self) -> None: ...


class CompactionObserver(PrepareObserver, Protocol):
    """Told what the compaction step did (proxy.metrics.Metrics is one)."""

    def observe(self, outcome: Outcome, seconds: float) -> None: ...

    def summarizer_call(self, seconds: float | None, failure: str | None) -> None: ...

    def breaker_changed(self, state: str) -> None: ...


@dataclass(frozen=True)
class Control:
    """Per-request overrides from the `x-compaction` / `x-compaction-budget` headers."""

    mode: Literal["auto", "off", "force"] = "auto"
    budget: int | None = None
    strategy: str | None = None  # a proxy key's own strategy; None: compaction.strategy
    # A proxy key's switch for summaries made ahead of need; None: no proxy key (then
    # compaction.prepare_keyless says).
    prepare: bool | None = None


@dataclass(frozen=True)
class Api:
    """What differs between the APIs whose requests carry a history: the body field that
    holds it, the adapter that reads its items (proxy/compaction/conversation.py) and the
    counter that prices them as that API bills them. Everything else is one core."""

    name: str  # "chat", "responses"
    field: str  # "messages", "input"
    format: Format
    counter: PromptCounter
    # Whether a body's count estimates something the tokenizer cannot read (encrypted items).
    opaque: Callable[[dict[str, Any]], bool] = lambda body: False

    def estimated(self, body: dict[str, Any]) -> bool:
        return self.counter.estimated or self.opaque(body)


def model_of(body: dict[str, Any]) -> str:
    model = body.get("model")
    return model if isinstance(model, str) else ""


def compaction_error(outcome: Outcome) -> ProxyError:
    """The 502 a handler answers for an outcome that says `rejected`."""
    return ProxyError(
        502,
        f"Compaction failed ({outcome.reason}): {outcome.error}",
        type="upstream_error",
        code="compaction_failed",
        headers=outcome.headers(),
    )


class Compactor:
    def __init__(
        self,
        settings: Settings,
        counter: PromptCounter,
        client: httpx.AsyncClient,
        store: SummaryStore,
        observer: CompactionObserver | None = None,
    ) -> None:
        """Raises ConfigError when `compaction.strategy` cannot be loaded."""
        self.settings = settings
        self.counter = counter
        self.client = client
        self.store = store
        self.observer = observer
        config = settings.compaction
        self.preparer = Preparer(store, config.prepare_max_concurrent, observer)
        self.planner = SummaryPlanner(store, SummaryFlight(store), self.preparer.claim)
        unstored = NullStore()
        self.unstored_planner = SummaryPlanner(unstored, SummaryFlight(unstored))
        summarizer = config.summarizer
        self.breaker = CircuitBreaker(
            summarizer.breaker_failures,
            summarizer.breaker_cooldown_s,
            on_change=None if observer is None else observer.breaker_changed,
        )
        injected = tuple(config.injected_user_patterns)
        self.format = ChatFormat(injected)
        self.chat = Api("chat", "messages", self.format, counter)
        self.responses = Api(
            "responses",
            "input",
            ResponsesFormat(injected),
            ResponsesCounter(counter, settings),
            lambda body: has_opaque(body.get("input")),
        )
        self.rules = CutRules(
            config.max_preserved_messages,
            "carry" if config.keep_last_user_message else "off",
            config.task_max_tokens if config.protect_task else None,
            config.user_messages_max_tokens,
        )
        self._rules: dict[int, CutRules] = {}
        self._loaded: dict[tuple[str, ...], tuple[Loaded, ...]] = {}
        self._stages: dict[tuple[tuple[str, ...], str, str], tuple[Stage, ...]] = {}
        try:
            self.loaded = self._load(config.strategy)
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
        api: Api | None = None,
    ) -> Outcome:
        """Count `body` (a parsed chat completions request; with `api` = `self.responses`, a
        Responses API request) and compact it when it is over its budget (or `control`
        forces it). Returns what to forward and what happened; never
        raises for a failed compaction (see `Outcome.rejected`).

        `control`: the request's `x-compaction*` headers (and its key's defaults);
        `client_headers`: what a summarizer call carries, as
        `headers.summarizer_request_headers` decided it; `scope`: the summary store tenant
        (None: no store); `parsed`: the client's bytes and, once known, where its messages
        are in them and the session's cache (proxy.jsonspans): kept messages are forwarded
        as the client's bytes and a turn derives only what its new messages add. When they
        are needed and not known yet, they are found and `parsed.spans` set (and
        `body["messages"]` replaced by the same values read from those bytes). `spend`: told
        what each summarizer call costs as it answers.

        When the outcome's `prepared` says "started", a summary is being made ahead of need
        in the background (proxy/preparer.py): it reads `body`'s messages, so the caller
        must not empty that list in place; its summarizer calls are accounted through
        `spend.detached()`."""
        started = time.perf_counter()
        config = self.settings.compaction
        api = api or self.chat
        counter, field = api.counter, api.field
        model = model_of(body)
        if control.mode == "off" or not config.enabled:  # nothing to decide: not even counted
            return self._report(Outcome(status="off"), model, started)
        spans = parsed.spans if parsed is not None else None
        if spans is not None and body.get(field) is not spans.messages:
            spans = parsed = None  # not this body's messages
        tools: int | None = None
        counts: list[int] | None = None
        if spans is not None:  # each message's count, kept with the spans for the next turn
            counts = await self.message_counts(model, spans, counter)
            tools = counter.count_tools(model, body)
            tokens = counter.request_tokens(sum(counts), tools)
        else:
            tokens = await counter.acount_request(body)
        budget = control.budget or config.budget_for(model)
        force = control.mode == "force"
        estimated = api.estimated(body)
        ahead = partial(
            self._ahead,
            control=control,
            body=body,
            parsed=parsed,
            client_headers=client_headers,
            scope=scope,
            spend=spend,
            api=api,
        )
        if not (tokens > budget or force):
            outcome = self._outcome(Decision("passthrough"), tokens, budget, estimated)
            return self._report(ahead(outcome), model, started)
        if parsed is not None and spans is None:
            # The store keys hash the client's bytes of each message, whatever the body's size.
            spans = parsed.spans = await spans_of(parsed.raw, field)
            if spans is not None:
                body[field] = spans.messages  # the same values, read from the same bytes
        if tools is None:
            tools = counter.count_tools(model, body)
        decision = await self._decide(
            body[field],
            tokens,
            Job(
                model=model,
                budget=budget,
                force=force,
                counting=Counting(counter, model, tools, spans, counts),
                summarizer=_Deferred(
                    partial(self.summarizer_for, self._summarizer_model(model), client_headers),
                    spend,
                ),
                format=api.format,
                rules=self.rules_for(budget),
                scope=scope,
                spans=spans,
                cache=None if spans is None else spans.cache,
            ),
            control.strategy,
        )
        return self._report(
            ahead(self._outcome(decision, tokens, budget, estimated)), model, started
        )

    def rules_for(self, budget: int) -> CutRules:
        """The cut rules for a request of this budget: the user's older asks carried after a
        summary total at most a tenth of it (and `user_messages_max_tokens`), so they never
        crowd out the tail a summary makes room for."""
        rules = self.rules
        asks = min(rules.asks_max_tokens, budget // 10)
        if asks == rules.asks_max_tokens:
            return rules
        found = self._rules.get(asks)
        if found is None:
            if len(self._rules) >= _STAGES:  # budgets are client input (a header)
                self._rules.clear()
            found = self._rules[asks] = CutRules(
                rules.max_preserved_messages, rules.latest_user, rules.task_max_tokens, asks
            )
        return found

    def skipped(self, reason: str, model: str) -> Outcome:
        """A request the compaction step leaves alone without counting it (its history is
        not all in the request: the Responses API's `previous_response_id`; a client's own
        compaction request), reported as every decision is."""
        return self._report(Outcome(status="skipped", reason=reason), model, time.perf_counter())

    # -- summaries made ahead of need ---------------------------------------------------------

    def _ahead(
        self,
        outcome: Outcome,
        *,
        control: Control,
        body: dict[str, Any],
        parsed: Parsed | None,
        client_headers: dict[str, str],
        scope: str | None,
        spend: Spend | None,
        api: Api,
    ) -> Outcome:
        """`outcome`, and a summary started ahead of need when its request is forwarded
        with at least `compaction.prepare_at` of its budget (see proxy/preparer.py).
        Only cheap checks here: the work, cut included, runs in the background."""
        config = self.settings.compaction
        share = config.prepare_share
        allowed = control.prepare if control.prepare is not None else config.prepare_keyless
        if (
            share is None
            or not allowed
            or control.mode != "auto"
            or scope is None
            or self.store.backend is None
            or not self.store.available
            or outcome.status not in _PREPARE_AFTER
            or outcome.budget is None
            or outcome.tokens_before is None
        ):
            return outcome
        forwarded = outcome.tokens_after
        if forwarded is None:  # forwarded as sent
            forwarded = outcome.tokens_before
        threshold = math.ceil(share * outcome.budget)
        spans = None if parsed is None else parsed.spans
        cache = None if spans is None else spans.cache
        started = None if cache is None else cache.ahead
        if forwarded < threshold:
            if started is not None:  # out of the band (crossed, or masked): next time anew
                started.live = False
            return outcome
        if started is not None and started.live and started.basis == outcome.summarized:
            return outcome  # an earlier turn of the session started it
        model = model_of(body)
        try:
            stages = _preparable(self.stages_for(model, control.strategy, api.format))
        except ValueError:  # a key's strategy that no longer loads: said by the decision
            return outcome
        if stages is None:
            return outcome
        summarizer = _Deferred(
            partial(self.summarizer_for, self._summarizer_model(model), client_headers),
            None if spend is None else spend.detached(),
        )
        work = partial(
            self._prepare,
            stages,
            body=body,
            parsed=parsed,
            model=model,
            tokens=outcome.tokens_before,
            budget=outcome.budget,
            threshold=threshold,
            summarizer=summarizer,
            scope=scope,
            api=api,
        )
        marker = Ahead(outcome.summarized)
        result = self.preparer.start(partial(_marked, marker, work))
        if result == "started" and cache is not None:
            cache.ahead = marker  # (this body's cache, and every later turn's)
        return replace(outcome, prepared=(*outcome.prepared, result))

    async def _prepare(
        self,
        stages: tuple[Stage, ...],
        *,
        body: dict[str, Any],
        parsed: Parsed | None,
        model: str,
        tokens: int,
        budget: int,
        threshold: int,
        summarizer: Summarizer,
        scope: str,
        api: Api,
    ) -> Prepared:
        """In the background: the history as the stages before the summarizing one would
        forward it once over budget, then that stage's summary made ahead of need."""
        counter, field = api.counter, api.field
        messages = body[field]
        spans = parsed.spans if parsed is not None else None
        if spans is not None and messages is not spans.messages:
            spans = None
        if spans is None and parsed is not None:  # (the request path found none: not needed)
            spans = await spans_of(parsed.raw, field)
            if spans is not None:
                messages = spans.messages  # the same values, read from the same bytes
        counts = None if spans is None else await self.message_counts(model, spans, counter)
        job = Job(
            model=model,
            budget=budget,
            force=False,
            counting=Counting(counter, model, counter.count_tools(model, body), spans, counts),
            summarizer=summarizer,
            format=api.format,
            rules=self.rules_for(budget),
            scope=scope,
            spans=spans,
            cache=None if spans is None else spans.cache,
        )
        described = await off_loop(len(messages), self._described, messages, job)
        history = History(messages, tokens, described)
        *before, last = stages
        for stage in before:  # masking: deterministic, no LLM call
            result = await stage.run(history, job)
            if result.history is not None:
                history = result.history
        assert isinstance(last, SummaryStage)
        return await last.prepare(history, job, threshold)

    async def aclose(self) -> None:
        """Cancel the summaries being made ahead of need (the app's shutdown)."""
        await self.preparer.close()

    async def _decide(
        self, messages: list[Message], tokens: int, job: Job, strategy: str | None = None
    ) -> Decision:
        """Run the strategy's stages on an over-budget (or forced) history."""
        try:
            stages = self.stages_for(job.model, strategy, job.format)
        except ValueError as exc:  # a key's strategy that no longer loads
            return Decision("failed", "strategy_error", error=str(exc))
        described = await off_loop(len(messages), self._described, messages, job)
        history = History(messages, tokens, described)
        return await compose(stages, history, job)

    def _described(self, messages: list[Message], job: Job) -> Described:
        """The history's structure: from the session's previous turn plus the new messages
        (kept for its next turn), or described afresh."""
        cache = job.cache
        if cache is None or job.spans is None or messages is not job.spans.messages:
            return describe(job.format, messages)
        known = cache.described if isinstance(cache.described, Described) else None
        described = describe(job.format, messages, known)
        cache.described = described
        return described

    def _outcome(self, decision: Decision, tokens: int, budget: int, estimated: bool) -> Outcome:
        rejected = decision.status == "failed" and self.settings.compaction.on_error == "reject"
        return Outcome.of(
            decision,
            tokens_before=tokens,
            budget=budget,
            estimated=estimated,
            rejected=rejected,
        )

    def _report(self, outcome: Outcome, model: str, started: float) -> Outcome:
        seconds = time.perf_counter() - started
        outcome = replace(outcome, seconds=seconds)
        if outcome.status not in ("passthrough", "off"):
            self.log_decision(outcome, model, seconds)
        if self.observer is not None:
            self.observer.observe(outcome, seconds)
        return outcome

    async def message_counts(
        self, model: str, spans: Spans, counter: PromptCounter | None = None
    ) -> list[int]:
        """The tokens of each of the body's messages: those of the body it extends from the
        session's cache (kept by an earlier turn), the others counted (and kept). `counter`:
        the API's (default: chat completions')."""
        counter = counter or self.counter
        profile = counter.profile_key(model)
        cache = spans.cache
        kept = cache.counts.get(profile)
        total = len(spans.messages)
        if kept is not None and len(kept) == total:
            return kept
        known = kept if kept is not None and len(kept) < total else []
        start = len(known)
        keys = spans.keys()
        counts = known + await counter.acount_each(
            model, spans.messages[start:], keys[start:], counted=sum(known)
        )
        cache.keep_counts(profile, counts)
        return counts

    # -- strategies ---------------------------------------------------------------------------

    def _load(self, spec: str | Sequence[str]) -> tuple[Loaded, ...]:
        names = stage_names(spec)
        loaded = self._loaded.get(names)
        if loaded is None:
            loaded = self._loaded[names] = load_strategy(names, self.options(""))
        return loaded

    def stages_for(
        self, model: str, strategy: str | None = None, format: Format | None = None
    ) -> tuple[Stage, ...]:
        """The stages of `strategy` (default `compaction.strategy`), made once per
        summarizer model and API adapter (`format`, default chat's). Raises ValueError when
        a key's strategy does not load."""
        summarizer_model = self._summarizer_model(model)
        format = format or self.format
        loaded = self.loaded if strategy is None else self._load(strategy)
        key = (tuple(item.name for item in loaded), summarizer_model, format.key)
        stages = self._stages.get(key)
        if stages is None:
            if len(self._stages) >= _STAGES:
                self._stages.clear()
            stages = self._stages[key] = tuple(
                self._stage(item, summarizer_model, format) for item in loaded
            )
        return stages

    def fingerprint(self, model: str, strategy: str | None = None) -> str | None:
        """The fingerprint of the strategy a request of `model` is compacted with (the store
        keys on it; audit records and replay reports name it), None when it cannot be told."""
        try:
            return "+".join(stage.fingerprint for stage in self.stages_for(model, strategy))
        except Exception:  # a strategy of the user's own that fails to build: no fingerprint
            return None

    def options(self, summarizer_model: str) -> StrategyOptions:
        config = self.settings.compaction
        mask = config.mask
        return StrategyOptions(
            summary_role=config.summary_role,
            max_message_tokens=config.summarizer.max_message_tokens,
            context_tokens=config.summarizer.context_tokens,
            summary_max_tokens=config.summary_max_tokens,
            custom_instruction=config.custom_instruction,
            count_tokens=lambda text: self.counter.count_text(summarizer_model, text),
            mask=MaskOptions(mask.keep_last, mask.clear_at_least, tuple(mask.exclude_tools)),
        )

    def _stage(self, loaded: Loaded, summarizer_model: str, format: Format) -> Stage:
        config = self.settings.compaction
        strategy = loaded.factory(self.options(summarizer_model))
        if loaded.kind == "mask":
            assert isinstance(strategy, MaskCompaction)
            mask = MaskCompaction(strategy.options, format)
            return MaskStage(mask, loaded.name, mask.fingerprint)
        if loaded.kind == "compact":
            assert isinstance(strategy, Compaction)
            fingerprint = fingerprint_for(loaded.name, strategy, config.fingerprints)
            return RewriteStage(strategy, loaded.name, fingerprint)
        assert isinstance(strategy, Summarizing)
        fingerprint = strategy.fingerprint
        namespace = namespace_for(
            model=summarizer_model,
            base_url=config.summarizer.base_url or self.settings.upstream.base_url,
            strategy=fingerprint,
            chain=CHAIN_VERSION,
        )
        return SummaryStage(
            loaded.name,
            strategy,
            fingerprint,
            namespace,
            self.planner,
            self.unstored_planner,
            SummaryOptions(config.keep_recent_ratio, config.summary_max_tokens),
        )

    def _summarizer_model(self, model: str) -> str:
        return self.settings.compaction.summarizer.model or model

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
            on_result=None if self.observer is None else self.observer.summarizer_call,
            api=config.api,
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
                "messages_masked": outcome.masked,
                "summary_input_tokens": outcome.usage.input_tokens,
                "summary_output_tokens": outcome.usage.output_tokens,
                "cache": outcome.cache,
                "duration_ms": round(seconds * 1000, 1),
            },
        )


# Outcomes after which a request may start a summary ahead of need: forwarded whole, or
# within the budget by a summary or masking (over_budget: no summary would fit).
_PREPARE_AFTER = frozenset({"passthrough", "compacted", "extended", "reused"})


async def _marked(marker: Ahead, work: Callable[[], Awaitable[Prepared]]) -> Prepared:
    """`work()`; the session's `marker` dies when nothing came of it (not needed yet,
    nothing to summarize, a failure), so a later turn of the session tries again."""
    try:
        prepared = await work()
    except BaseException:
        marker.live = False
        raise
    if prepared.status in ("ahead", "nothing"):
        marker.live = False
    return prepared


def _preparable(stages: tuple[Stage, ...]) -> tuple[Stage, ...] | None:
    """The stages up to the first summarizing one, when only masking comes before it (which
    the background can run as the request path would, with no LLM call); else None."""
    for index, stage in enumerate(stages):
        if isinstance(stage, SummaryStage):
            return stages[: index + 1]
        if not isinstance(stage, MaskStage):
            return None
    return None


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
