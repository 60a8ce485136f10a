"""The compaction step of the request path: decide, compact, and say what happened.

It owns the policy (budget, per-request control headers, no-progress guard, failure policy);
the algorithm lives behind `SimpleCompaction` in proxy/compaction/.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx

from proxy.compaction.prompt import PROMPT_VERSION
from proxy.compaction.protocol import Message, SummarizerError
from proxy.compaction.simple import Prepared, SimpleCompaction
from proxy.compaction.summarizer import CircuitBreaker, UpstreamSummarizer
from proxy.errors import ProxyError
from proxy.metrics import Metrics
from proxy.planner import SummaryPlanner
from proxy.report import Outcome
from proxy.settings import Settings
from proxy.store import SummaryFlight, SummaryStore, namespace_for

log = logging.getLogger("proxy.compaction")


class PromptCounter(Protocol):
    """What the request path needs from token counting (proxy.tokens.TokenCounter)."""

    @property
    def estimated(self) -> bool: ...

    def count_text(self, model: str, text: str) -> int: ...

    def count_messages(self, model: str, messages: list[Any]) -> int: ...

    def count_tools(self, model: str, body: dict[str, Any]) -> int: ...

    async def acount_request(self, body: dict[str, Any]) -> int: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Control:
    """Per-request overrides from the `x-compaction` / `x-compaction-budget` headers."""

    mode: Literal["auto", "off", "force"] = "auto"
    budget: int | None = None


def _last_user(messages: list[Message]) -> Message | None:
    return next((m for m in reversed(messages) if m.get("role") == "user"), None)


def model_of(body: dict[str, Any]) -> str:
    model = body.get("model")
    return model if isinstance(model, str) else ""


class Compactor:
    def __init__(
        self,
        settings: Settings,
        counter: PromptCounter,
        client: httpx.AsyncClient,
        store: SummaryStore,
        metrics: Metrics,
    ) -> None:
        self.settings = settings
        self.counter = counter
        self.client = client
        self.store = store
        self.metrics = metrics
        self.planner = SummaryPlanner(store, SummaryFlight(store))
        summarizer = settings.compaction.summarizer
        self.breaker = CircuitBreaker(
            summarizer.breaker_failures,
            summarizer.breaker_cooldown_s,
            on_change=metrics.breaker_changed,
        )

    async def run(
        self,
        body: dict[str, Any],
        control: Control,
        *,
        client_headers: dict[str, str],
        scope: str,
    ) -> Outcome:
        """`client_headers`: what the summarizer call carries, as
        `headers.summarizer_request_headers` decided it; `scope`: the summary store tenant."""
        started = time.perf_counter()
        config = self.settings.compaction
        model = model_of(body)
        if control.mode == "off" or not config.enabled:  # nothing to decide: not even counted
            outcome = Outcome(status="off")
            self.metrics.observe(outcome, time.perf_counter() - started)
            return outcome
        tokens = await self.counter.acount_request(body)
        budget = control.budget or config.budget_for(model)
        outcome = Outcome(tokens_before=tokens, budget=budget, estimated=self.counter.estimated)
        if tokens > budget or control.mode == "force":
            await self.decide(body, control, budget, outcome, client_headers, scope)
            self.log(outcome, model, time.perf_counter() - started)
        self.metrics.observe(outcome, time.perf_counter() - started)
        return outcome

    async def decide(
        self,
        body: dict[str, Any],
        control: Control,
        budget: int,
        outcome: Outcome,
        client_headers: dict[str, str],
        scope: str,
    ) -> None:
        """Over budget (or forced): skip when compaction can't help, else plan and compact."""
        config = self.settings.compaction
        model = model_of(body)

        messages: list[Message] = body["messages"]
        summarizer_model = config.summarizer.model or model
        force = control.mode == "force"
        compaction = self.compaction_for(summarizer_model)
        prepared = compaction.prepare(messages, custom_instruction=config.custom_instruction)
        carry: Message | None = None
        if (
            config.keep_last_user_message
            and not force
            and (not prepared.to_compact or self.kept_tokens(body, prepared, None) > budget)
        ):
            # Agent loop: everything since the latest user message is over budget. Cut where
            # SimpleCompaction would without that rule, and carry the user message verbatim
            # right after the summary, so the latest ask still reaches the model word for word.
            loop_compaction = self.compaction_for(summarizer_model, keep_last_user_message=False)
            loop = loop_compaction.prepare(messages, custom_instruction=config.custom_instruction)
            last_user = _last_user(messages)
            if any(m is last_user for m in loop.to_compact):
                compaction, prepared, carry = loop_compaction, loop, last_user
        if not prepared.to_compact:
            outcome.status, outcome.reason = "skipped", "nothing_to_compact"
        elif not force and self.kept_tokens(body, prepared, carry) > budget:
            # Pinned + tools + tail alone are over budget: a summary cannot help.
            outcome.status, outcome.reason = "skipped", "preserved_over_budget"
        else:
            await self.compact(
                body,
                prepared,
                compaction,
                outcome,
                summarizer_model,
                client_headers,
                scope=scope,
                budget=budget,
                force=force,
                carry=carry,
            )

    async def compact(
        self,
        body: dict[str, Any],
        prepared: Prepared,
        compaction: SimpleCompaction,
        outcome: Outcome,
        summarizer_model: str,
        client_headers: dict[str, str],
        scope: str,
        budget: int,
        force: bool,
        carry: Message | None,
    ) -> None:
        config = self.settings.compaction
        model = model_of(body)

        async def count(messages: list[Message]) -> int:
            return await self.counter.acount_request({**body, "messages": messages})

        try:
            plan = await self.planner.plan(
                prepared,
                compaction,
                self.summarizer_for(summarizer_model, client_headers),
                scope=scope,
                namespace=self.namespace(summarizer_model),
                budget=budget,
                force=force,
                count=count,
                count_text=lambda text: self.counter.count_text(model, text),
                custom_instruction=config.custom_instruction,
                carry=carry,
            )
        except SummarizerError as error:
            outcome.status, outcome.reason = "failed", error.reason
            outcome.cache = None if self.store.available else "none"
            if config.on_error == "reject":
                raise ProxyError(
                    502,
                    f"Compaction failed ({error.reason}): {error}",
                    type="upstream_error",
                    code="compaction_failed",
                    headers=outcome.headers(),
                ) from None
            return
        outcome.cache = plan.cache
        outcome.usage = plan.usage
        if not force and outcome.tokens_before is not None and plan.tokens >= outcome.tokens_before:
            # The summary is longer than what it replaces: forward the original instead.
            outcome.status, outcome.reason = "skipped", "no_gain"
            return
        outcome.status = plan.status
        outcome.messages = plan.messages
        outcome.summarized = plan.summarized
        outcome.tokens_after = plan.tokens

    def namespace(self, summarizer_model: str) -> str:
        """Everything that shapes a summary's text: a change starts a new set of keys."""
        config = self.settings.compaction
        return namespace_for(
            model=summarizer_model,
            base_url=config.summarizer.base_url or self.settings.upstream.base_url,
            prompt=PROMPT_VERSION,
            summary_max_tokens=config.summary_max_tokens,
            summary_role=config.summary_role,
            max_preserved_messages=config.max_preserved_messages,
            max_message_tokens=config.summarizer.max_message_tokens,
            context_tokens=config.summarizer.context_tokens,
            custom_instruction=config.custom_instruction,
        )

    def compaction_for(
        self, summarizer_model: str, *, keep_last_user_message: bool | None = None
    ) -> SimpleCompaction:
        config = self.settings.compaction
        if keep_last_user_message is None:
            keep_last_user_message = config.keep_last_user_message
        return SimpleCompaction(
            config.max_preserved_messages,
            keep_last_user_message=keep_last_user_message,
            summary_role=config.summary_role,
            max_message_tokens=config.summarizer.max_message_tokens,
            summarizer_context_tokens=config.summarizer.context_tokens,
            summary_max_tokens=config.summary_max_tokens,
            count_tokens=lambda text: self.counter.count_text(summarizer_model, text),
        )

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

    def kept_tokens(self, body: dict[str, Any], prepared: Prepared, carry: Message | None) -> int:
        """What the forwarded request would cost even with an empty summary."""
        model = model_of(body)
        kept = [*prepared.pinned, *([carry] if carry is not None else []), *prepared.to_preserve]
        return self.counter.count_messages(model, kept) + self.counter.count_tools(model, body)

    def log(self, outcome: Outcome, model: str, seconds: float) -> None:
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
