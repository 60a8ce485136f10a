"""Per-key quotas (requests and prompt tokens per minute/day, spend per day/month) and the
ledger that holds them and the per-day usage, in memory or in Redis (single node or cluster).
"""

from __future__ import annotations

from proxy.quota.ledger import USAGE_FIELDS, Ledger, LedgerUnavailable, UsageCounts, UsageRow
from proxy.quota.memory import MemoryLedger
from proxy.quota.quotas import Quotas, Verdict
from proxy.settings import Settings
from proxy.store import redis_required

__all__ = [
    "USAGE_FIELDS",
    "Ledger",
    "LedgerUnavailable",
    "MemoryLedger",
    "Quotas",
    "UsageCounts",
    "UsageRow",
    "Verdict",
    "create_ledger",
]


def create_ledger(settings: Settings) -> Ledger:
    """Redis when quota.backend says so (or "auto" and cache.backend = "redis"), else memory."""
    quota = settings.quota
    backend = quota.backend
    if backend == "auto":
        backend = "redis" if settings.cache.backend == "redis" else "memory"
    if backend == "memory":
        return MemoryLedger(quota.usage_retention_days)
    with redis_required("quota.backend"):
        from proxy.quota.redis import RedisLedger
        from proxy.store.connect import connect
    url = quota.redis_url if quota.redis_url is not None else settings.cache.redis_url
    client = connect(url, socket_timeout_s=quota.socket_timeout_s)
    return RedisLedger(client, quota.key_prefix, retention_days=quota.usage_retention_days)
