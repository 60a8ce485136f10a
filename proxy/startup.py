"""What a starting proxy says is active: the fields of its one start-up line.

An operator reading the log of a fresh replica should see, without opening its config, which
budget and strategy apply, whether proxy keys are on, where summaries and quota counters
live and whether the admin API answers. Nothing here is a secret: URLs are redacted, keys
are counted, and env vars are named, never read.
"""

from __future__ import annotations

from proxy.redact import redact_url
from proxy.settings import Settings


def strategy_name(strategy: str | list[str]) -> str:
    """A strategy setting as one word: a list of stages is written `mask+simple`."""
    return strategy if isinstance(strategy, str) else "+".join(strategy)


def startup_fields(settings: Settings) -> dict[str, str | int]:
    """The fields of the start-up line (`log.info(..., extra=startup_fields(settings))`)."""
    compaction = settings.compaction
    cache = settings.cache
    quota = settings.quota
    fields: dict[str, str | int] = {
        "compaction": "on" if compaction.enabled else "off",
        "budget_tokens": compaction.budget_tokens,
        "strategy": strategy_name(compaction.strategy),
        "keys": len(settings.auth.keys),
    }
    if compaction.models:
        fields["model_budgets"] = len(compaction.models)
    if settings.auth.keys_file:
        fields["keys_file"] = settings.auth.keys_file
    if settings.auth.api_keys:
        fields["api_keys"] = "redis" if quota_backend(settings) == "redis" else "file"
    if settings.auth.teams:
        fields["teams"] = len(settings.auth.teams)
    fields["store"] = cache.backend
    if cache.backend == "redis":
        fields["store_url"] = _where(cache.redis_url)
    fields["quota"] = quota_backend(settings)
    if fields["quota"] == "redis":
        fields["quota_url"] = _where(quota.redis_url or cache.redis_url)
        fields["quota_on_redis_error"] = quota.on_redis_error
    fields["upstream_api_key"] = "set" if settings.upstream.api_key is not None else "unset"
    fields["admin"] = f"on ({settings.admin.token_env})" if settings.admin.token_env else "off"
    fields["metrics_token"] = "on" if settings.server.metrics_token_env else "off"
    fields["workers"] = settings.server.workers
    return fields


def quota_backend(settings: Settings) -> str:
    """`quota.backend` resolved: "auto" is redis when the summary store is."""
    backend = settings.quota.backend
    if backend == "auto":
        return "redis" if settings.cache.backend == "redis" else "memory"
    return backend


def _where(url: str | list[str]) -> str:
    """A Redis setting as one printable address: the first node of a list, redacted."""
    first = url[0] if isinstance(url, list) and url else url
    return redact_url(first) if isinstance(first, str) and "://" in first else str(first)
