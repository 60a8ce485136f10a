"""Prometheus metrics, one registry per app (so several apps in one process don't collide)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from proxy.report import Outcome
from proxy.store import SummaryStore


class _StoreCollector(Collector):
    """Reads the store's own failure count at scrape time."""

    def __init__(self, store: SummaryStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "compaction_proxy_store_errors",
            "Summary store operations that failed (requests went on without the store).",
            labels=["backend"],
        )
        family.add_metric([self.store.name], self.store.errors)
        yield family


class Metrics:
    def __init__(self, store: SummaryStore) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StoreCollector(store))
        self.chat_requests = Counter(
            "compaction_proxy_chat_requests",
            "Chat completion requests, by compaction status.",
            ["status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "compaction_proxy_prompt_tokens",
            "Prompt tokens counted: as clients sent them (before), as forwarded (after).",
            ["stage"],
            registry=self.registry,
        )
        self.summarizer_tokens = Counter(
            "compaction_proxy_summarizer_tokens",
            "Tokens spent on summarizer calls.",
            ["direction"],
            registry=self.registry,
        )
        self.compaction_seconds = Histogram(
            "compaction_proxy_compaction_seconds",
            "Time spent compacting (summarizer included), for requests that compacted.",
            buckets=(0.005, 0.05, 0.25, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )

    def observe(self, outcome: Outcome, seconds: float) -> None:
        self.chat_requests.labels(outcome.status).inc()
        if outcome.tokens_before is not None:
            self.prompt_tokens.labels("before").inc(outcome.tokens_before)
            after = (
                outcome.tokens_after if outcome.tokens_after is not None else outcome.tokens_before
            )
            self.prompt_tokens.labels("after").inc(after)
        self.summarizer_tokens.labels("input").inc(outcome.usage.input_tokens)
        self.summarizer_tokens.labels("output").inc(outcome.usage.output_tokens)
        if outcome.status in ("compacted", "extended", "reused"):
            self.compaction_seconds.observe(seconds)

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
