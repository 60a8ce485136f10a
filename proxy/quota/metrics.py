"""Quota and usage counters for /metrics, read from their owners at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.quota.quotas import Quotas
from proxy.usage.meter import Meter


class QuotaCollector(Collector):
    def __init__(self, quotas: Quotas, meter: Meter) -> None:
        self.quotas = quotas
        self.meter = meter

    def collect(self) -> Iterator[Metric]:
        backend = self.quotas.ledger.name
        errors = CounterMetricFamily(
            "compaction_proxy_quota_errors",
            "Quota/usage store operations that failed.",
            labels=["backend"],
        )
        errors.add_metric([backend], self.quotas.ledger.errors)
        yield errors
        failed_open = CounterMetricFamily(
            "compaction_proxy_quota_failed_open",
            "Requests let through unmetered because the quota store was unreachable.",
            labels=["backend"],
        )
        failed_open.add_metric([backend], self.quotas.failed_open)
        yield failed_open
        lost = CounterMetricFamily(
            "compaction_proxy_usage_unrecorded", "Replies whose usage could not be recorded."
        )
        lost.add_metric([], self.meter.errors)
        yield lost
        dropped = CounterMetricFamily(
            "compaction_proxy_usage_dropped_rows",
            "Usage rows dropped while the ledger was unavailable: past the cap of held rows.",
        )
        dropped.add_metric([], self.meter.dropped_rows)
        yield dropped
        held = GaugeMetricFamily(
            "compaction_proxy_usage_held_rows",
            "Usage rows whose write failed, held for the next flush.",
        )
        held.add_metric([], self.meter.held_rows)
        yield held
