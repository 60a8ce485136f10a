"""The keys in force, for /metrics: how many by origin, and reloads that were refused."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.auth.source import KeySource


class KeysCollector(Collector):
    def __init__(self, source: KeySource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        keys = GaugeMetricFamily(
            "compaction_proxy_keys",
            "Proxy keys in force, by where they come from: config, file (auth.keys_file) or "
            "api (the admin API's key store).",
            labels=["origin"],
        )
        by_origin = Counter(key.origin for key in self.source.ring.proxy_keys())
        for origin in ("config", "file", "api"):
            keys.add_metric([origin], by_origin[origin])
        yield keys
        failures = CounterMetricFamily(
            "compaction_proxy_keys_reload_failures",
            "Reloads of the keys that were not applied (the previous keys kept): the keys "
            "file unreadable, not parsing, invalid or without keys (file), the key store "
            "unreachable (store).",
            labels=["source"],
        )
        for where in ("file", "store"):
            failures.add_metric([where], self.source.reload_failures[where])
        yield failures
