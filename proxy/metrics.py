"""Prometheus metrics: one registry per app, or shared files across `serve --workers N`.

Per request the web layer's record (proxy/exchange.py) feeds the request families once the
response is over (and the quota rejections, by the limit that refused); the compaction step
feeds the compaction families with its Outcome; the usage meter feeds the per-key token and
spend families at each flush of its batch (every 0.5 s); the summarizer and its circuit
breaker report through small hooks. Label values are bounded: routes are route templates,
statuses are numbers, and model names beyond the first `MAX_MODELS` seen (per process)
count as "other", so a client sending random model names cannot grow the series without
limit; key ids and teams (the operator's names) likewise past `MAX_KEYS` and `MAX_TEAMS`.

`/metrics` answers anyone unless `server.metrics_token_env` names a token it then asks for.

With several worker processes (`PROMETHEUS_MULTIPROC_DIR` set before prometheus_client is
first imported, as `serve --workers` does), every process writes its values to files in that
directory and a scrape, answered by whichever worker, reads them all: counters and histograms
add up, gauges say how they combine (`multiprocess_mode`). Process metrics are per worker
then (a `pid` label), refreshed every few seconds by each worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from starlette.requests import Request
from starlette.responses import Response

from proxy.errors import ProxyError
from proxy.preparer import Result
from proxy.quota.ledger import UsageCounts
from proxy.record import Record
from proxy.report import Outcome, Usage
from proxy.store import SummaryStore

_Mode = Literal["livesum", "all"]
MAX_MODELS = 50
MAX_KEYS = 500
MAX_TEAMS = 100
# The usage meter's counts behind each `kind` of compaction_proxy_usage_tokens_total.
USAGE_TOKEN_KINDS = (
    ("prompt_sent", "prompt_tokens_sent"),
    ("prompt_forwarded", "prompt_tokens_forwarded"),
    ("prompt_cached", "cached_prompt_tokens"),
    ("completion", "completion_tokens"),
    ("saved", "tokens_saved"),
    ("summarizer_prompt", "summarizer_prompt_tokens"),
    ("summarizer_completion", "summarizer_completion_tokens"),
)
_CHILD_CACHE = 4096  # labelled series kept at hand (client model names can be anything)
_MODEL_CHARS = 64
_PREFIX = "compaction_proxy_"
# Proxy overhead is sub-millisecond when passing through, seconds when a summary is made.
_OVERHEAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5, 30, 120)
_UPSTREAM_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_BREAKER_STATES = ("closed", "open", "half_open")
PROCESS_REFRESH_S = 5.0


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def _bounded(value: str | None, seen: set[str], limit: int) -> str:
    """`value` as a label: "" for none, "other" past the first `limit` distinct ones."""
    if not value:
        return ""
    value = value[:_MODEL_CHARS]
    if value in seen:
        return value
    if len(seen) < limit:
        seen.add(value)
        return value
    return "other"


def _bearer_is(request: Request, token: str) -> bool:
    scheme, _, presented = request.headers.get("authorization", "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        presented.strip().encode("utf-8", "surrogatepass"), token.encode("utf-8")
    )


class Metrics:
    """Every family the proxy exports (docs/operations.md, "Metrics", lists them with their
    labels)."""

    def __init__(self, store: SummaryStore, token: str | None = None) -> None:
        self.store = store
        self.token = token  # what /metrics asks for (Authorization: Bearer), None: nothing
        self.multiprocess = multiprocess_dir() is not None
        self.registry = CollectorRegistry()
        if not self.multiprocess:
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
        self._models: set[str] = set()
        self._keys: set[str] = set()
        self._teams: set[str] = set()
        self._requests: dict[tuple[str, int | None, str | None, str | None, str | None], Any] = {}
        # (key id, team, model) -> the usage token series by kind, and the spend series
        self._usage: dict[tuple[str, str | None, str], tuple[list[Any], Any]] = {}
        self._by_route: dict[str, tuple[Any, Any, Any]] = {}
        self._children: dict[tuple[str, ...], Any] = {}  # other labelled series, by family
        self._store_errors_seen = 0
        r = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(_PREFIX + name, doc, labels, registry=r)

        def histogram(
            name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]
        ) -> Histogram:
            return Histogram(_PREFIX + name, doc, labels, registry=r, buckets=buckets)

        def gauge(name: str, doc: str, labels: tuple[str, ...], mode: _Mode) -> Gauge:
            return Gauge(_PREFIX + name, doc, labels, registry=r, multiprocess_mode=mode)

        self.requests = counter(
            "requests",
            "Requests answered, by route, status sent, model, and the proxy key and team.",
            ("route", "status", "model", "key_id", "team"),
        )  # fmt: skip
        self.rejected = counter(
            "quota_rejected",
            "Requests refused over a quota (429; 503 quota_unavailable when failing closed), "
            "by key, team and the limit that refused (team_...: the team's).",
            ("key_id", "team", "reason"),
        )  # fmt: skip
        self.spend = counter(
            "spend_usd",
            "Dollars spent through the proxy (replies and summarizer calls, at the pricing "
            "table's prices), by key, team and model.",
            ("key_id", "team", "model"),
        )  # fmt: skip
        self.usage_tokens = counter(
            "usage_tokens",
            "Tokens of keyed requests by key, team, model and kind: prompt_sent (before "
            "compaction), prompt_forwarded, prompt_cached, completion, saved (by compaction), "
            "summarizer_prompt, summarizer_completion.",
            ("key_id", "team", "model", "kind"),
        )  # fmt: skip
        self.overhead = histogram(
            "overhead_seconds",
            "Time from a request's arrival until it went upstream (reading, counting, "
            "compacting), for requests forwarded upstream.",
            ("route",), _OVERHEAD_BUCKETS,
        )  # fmt: skip
        self.upstream_ttfb = histogram(
            "upstream_ttfb_seconds",
            "Upstream time to first byte: from sending until its status and headers arrived.",
            ("route",), _UPSTREAM_BUCKETS,
        )  # fmt: skip
        self.duration = histogram(
            "request_duration_seconds",
            "Time from a request's arrival until its last byte was sent (or the client left).",
            ("route",), _UPSTREAM_BUCKETS,
        )  # fmt: skip
        self.upstream_responses = counter(
            "upstream_responses", "Upstream replies, by route and the upstream's status code.",
            ("route", "status"),
        )  # fmt: skip
        self.in_flight = gauge("in_flight_requests", "Requests being handled now.", (), "livesum")
        self.in_flight_streams = gauge(
            "in_flight_streams", "Streaming (stream: true) responses being relayed now.", (),
            "livesum",
        )  # fmt: skip
        self.compactions = counter(
            "compaction_outcomes",
            "Chat requests by what the compaction step did (status) and why (reason).",
            ("status", "reason"),
        )
        self.prompt_tokens = counter(
            "prompt_tokens",
            "Prompt tokens counted: as clients sent them (before), as forwarded (after).",
            ("stage",),
        )
        self.tokens_saved = counter(
            "prompt_tokens_saved", "Prompt tokens compaction removed (before - after)."
        )
        self.summarizer_tokens = counter(
            "summarizer_tokens", "Tokens spent on summarizer calls.", ("direction",)
        )
        self.compaction_seconds = histogram(
            "compaction_seconds",
            "Time spent compacting (summarizer included), for requests that compacted.",
            (), (0.005, 0.05, 0.25, 1, 2.5, 5, 10, 30, 60, 120),
        )  # fmt: skip
        self.summarizer_calls = counter(
            "summarizer_calls", "Summarizer calls (retries included), by result: ok or error.",
            ("result",),
        )  # fmt: skip
        self.summarizer_seconds = histogram(
            "summarizer_call_seconds", "Summarizer call latency, retries and backoff included.",
            (), (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )  # fmt: skip
        self.summarizer_failures = counter(
            "summarizer_failures", "Failed summarizer calls, by reason.", ("reason",)
        )
        self.breaker_state = gauge(
            "summarizer_breaker_state",
            "Summarizer circuit breaker: 1 for the state it is in (with several workers: how "
            "many workers are in each state).",
            ("state",), "livesum",
        )  # fmt: skip
        self.prepared_summaries = counter(
            "prepared_summaries",
            "Summaries made ahead of need, by result: started, done (made and stored), "
            "skipped (none needed), failed, dropped (at compaction.prepare_max_concurrent), "
            "cancelled (shutdown), used (a request was first forwarded with one). "
            "done - used: made for sessions that have not crossed their budget (yet).",
            ("result",),
        )
        self.prepared_tokens = counter(
            "prepared_summary_tokens",
            "Summarizer tokens (input + output) of summaries made ahead of need: spent, and "
            "used (those of summaries a request was then forwarded with).",
            ("use",),
        )
        self.preparing = gauge(
            "prepared_summaries_running", "Summaries being made ahead of need now.", (),
            "livesum",
        )  # fmt: skip
        self.store_lookups = counter(
            "store_lookups",
            "Summary store lookups of compacting requests: hit, partial (extended), miss, or "
            "none (no store, or it was failing).",
            ("result",),
        )
        self.store_errors = counter(
            "store_errors",
            "Summary store operations that failed (requests went on without the store).",
            ("backend",),
        )
        self.store_errors.labels(store.name)
        self._tokens_before = self.prompt_tokens.labels("before")
        self._tokens_after = self.prompt_tokens.labels("after")
        self.breaker_changed("closed")
        self._process = self._process_gauges() if self.multiprocess else {}

    # The web layer's record: an ExchangeSink.

    def started(self, record: Record) -> None:
        self.in_flight.inc()

    def responding(self, record: Record) -> None:
        if record.stream:
            self.in_flight_streams.inc()

    def finished(self, record: Record) -> None:
        route = record.route
        self.in_flight.dec()
        if record.stream and record.status is not None:
            self.in_flight_streams.dec()
        key = (route, record.status, record.model, record.key_id, record.team)
        requests = self._requests.get(key)
        if requests is None:  # labels() validates its arguments: once per series, not per call
            status = str(record.status) if record.status is not None else "none"
            requests = self.requests.labels(
                route, status, self.model_label(record.model), self.key_label(record.key_id),
                self.team_label(record.team),
            )  # fmt: skip
            if len(self._requests) < _CHILD_CACHE:
                self._requests[key] = requests
        requests.inc()
        if record.limit is not None:
            self._child(
                self.rejected, "rejected", self.key_label(record.key_id),
                self.team_label(record.team), record.limit,
            ).inc()  # fmt: skip
        histograms = self._by_route.get(route)
        if histograms is None:
            histograms = self._route_histograms(route)
        duration, overhead, ttfb = histograms
        if record.duration_s is not None:
            duration.observe(record.duration_s)
        if record.overhead_s is not None:
            overhead.observe(record.overhead_s)
        if record.upstream_status is not None:
            self._child(
                self.upstream_responses, "upstream", route, str(record.upstream_status)
            ).inc()
            if record.upstream_ttfb_s is not None:
                ttfb.observe(record.upstream_ttfb_s)
        errors = self.store.errors
        if errors != self._store_errors_seen:
            self.store_errors.labels(self.store.name).inc(errors - self._store_errors_seen)
            self._store_errors_seen = errors

    def _route_histograms(self, route: str) -> tuple[Any, Any, Any]:
        histograms = self._by_route.get(route)
        if histograms is None:
            histograms = self._by_route[route] = (
                self.duration.labels(route),
                self.overhead.labels(route),
                self.upstream_ttfb.labels(route),
            )
        return histograms

    def prime(self, routes: Sequence[str]) -> None:
        """The per-route histograms of `routes` created now, empty (count 0): they show in
        a scrape from the start instead of appearing with the first request, which then does
        not build them (a histogram series is ~40 us of prometheus_client's work)."""
        for route in routes:
            self._route_histograms(route)

    def _child(self, family: Any, name: str, *labels: str) -> Any:
        """`family.labels(*labels)`, kept at hand (labels() validates on every call)."""
        key = (name, *labels)
        child = self._children.get(key)
        if child is None:
            child = family.labels(*labels)
            if len(self._children) < _CHILD_CACHE:
                self._children[key] = child
        return child

    def key_label(self, key_id: str | None) -> str:
        return _bounded(key_id, self._keys, MAX_KEYS)

    def team_label(self, team: str | None) -> str:
        return _bounded(team, self._teams, MAX_TEAMS)

    def usage_observed(
        self, key_id: str, team: str | None, model: str, counts: UsageCounts
    ) -> None:
        """A keyed reply's usage, as the meter accounts it (see Meter.observer)."""
        series = self._usage.get((key_id, team, model))
        if series is None:
            series = self._usage_series(key_id, team, model)
        tokens, spend = series
        for child, (_, field) in zip(tokens, USAGE_TOKEN_KINDS, strict=True):
            amount = getattr(counts, field)
            if amount:
                child.inc(amount)
        if counts.cost_nano_usd:
            spend.inc(counts.cost_nano_usd / 1e9)

    def _usage_series(self, key_id: str, team: str | None, model: str) -> tuple[list[Any], Any]:
        key, team_name = self.key_label(key_id), self.team_label(team)
        model_name = self.model_label(model)
        series = (
            [
                self.usage_tokens.labels(key, team_name, model_name, kind)
                for kind, _ in USAGE_TOKEN_KINDS
            ],
            self.spend.labels(key, team_name, model_name),
        )
        if len(self._usage) < _CHILD_CACHE:
            self._usage[(key_id, team, model)] = series
        return series

    def model_label(self, model: str | None) -> str:
        if not model:
            return ""
        model = model[:_MODEL_CHARS]
        if model in self._models:
            return model
        if len(self._models) < MAX_MODELS:
            self._models.add(model)
            return model
        return "other"

    # The compaction step, the summarizer and its breaker.

    def observe(self, outcome: Outcome, seconds: float) -> None:
        self._child(self.compactions, "compactions", outcome.status, outcome.reason or "").inc()
        if outcome.tokens_before is not None:
            after = (
                outcome.tokens_after if outcome.tokens_after is not None else outcome.tokens_before
            )
            self._tokens_before.inc(outcome.tokens_before)
            self._tokens_after.inc(after)
            if after < outcome.tokens_before:
                self.tokens_saved.inc(outcome.tokens_before - after)
        if outcome.usage.input_tokens or outcome.usage.output_tokens:
            self.summarizer_tokens.labels("input").inc(outcome.usage.input_tokens)
            self.summarizer_tokens.labels("output").inc(outcome.usage.output_tokens)
        if outcome.cache is not None:
            self._child(self.store_lookups, "store_lookups", outcome.cache).inc()
        if outcome.status in ("compacted", "extended", "reused", "over_budget"):
            self.compaction_seconds.observe(seconds)

    def summarizer_call(self, seconds: float | None, failure: str | None) -> None:
        """A summarizer call ended (`seconds` None: refused by the open breaker, no call);
        `failure` is its reason, None when it succeeded."""
        if seconds is not None:
            self.summarizer_seconds.observe(seconds)
            self.summarizer_calls.labels("ok" if failure is None else "error").inc()
        if failure is not None:
            self.summarizer_failures.labels(failure).inc()

    def prepared(self, result: Result, usage: Usage, running: int) -> None:
        """A summary made ahead of need (proxy/preparer.py) changed state."""
        self._child(self.prepared_summaries, "prepared", result).inc()
        tokens = usage.input_tokens + usage.output_tokens
        if tokens:
            if result == "used":
                self._child(self.prepared_tokens, "prepared_tokens", "used").inc(tokens)
            else:
                self._child(self.prepared_tokens, "prepared_tokens", "spent").inc(tokens)
                self.summarizer_tokens.labels("input").inc(usage.input_tokens)
                self.summarizer_tokens.labels("output").inc(usage.output_tokens)
        self.preparing.set(running)

    def breaker_changed(self, state: str) -> None:
        for name in _BREAKER_STATES:
            self.breaker_state.labels(name).set(1 if name == state else 0)

    # Process metrics with several workers, and the scrape endpoint.

    def _process_gauges(self) -> dict[str, Gauge]:
        gauges: dict[str, Gauge] = {}
        for family in ProcessCollector(registry=None).collect():
            for sample in family.samples:
                gauges[sample.name] = Gauge(
                    sample.name, family.documentation, registry=self.registry,
                    multiprocess_mode="all",
                )  # fmt: skip
        return gauges

    def refresh_process(self) -> None:
        for family in ProcessCollector(registry=None).collect():
            for sample in family.samples:
                gauge = self._process.get(sample.name)
                if gauge is not None:
                    gauge.set(sample.value)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """For the app's lifespan: per-worker process gauges kept fresh; on a clean exit the
        worker's live gauges (in flight, breaker) are dropped from the shared files."""
        if not self.multiprocess:
            yield
            return
        self.refresh_process()
        task = asyncio.create_task(self._refresh_forever())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(PROCESS_REFRESH_S)
            self.refresh_process()

    async def endpoint(self, request: Request) -> Response:
        if self.token is not None and not _bearer_is(request, self.token):
            return ProxyError(
                401,
                "/metrics needs the metrics token (Authorization: Bearer <token>; see "
                "server.metrics_token_env).",
                code="invalid_api_key",
            ).response()
        registry: Any = self.registry
        if self.multiprocess:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
