"""`compaction-proxy usage`: the usage table, from a running proxy or straight from Redis."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
from typing import Any

import httpx

from proxy.settings import ConfigError, Settings, load_settings

COLUMNS = [
    ("day", "day"),
    ("key", "key"),
    ("model", "model"),
    ("requests", "requests"),
    ("sent", "prompt_tokens_sent"),
    ("forwarded", "prompt_tokens_forwarded"),
    ("cached", "cached_prompt_tokens"),
    ("completion", "completion_tokens"),
    ("summ. in", "summarizer_prompt_tokens"),
    ("summ. out", "summarizer_completion_tokens"),
    ("saved", "tokens_saved"),
    ("USD", "cost_usd"),
    ("estimated", "estimated_requests"),
]


def register_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    usage = subparsers.add_parser(
        "usage",
        help="print per-key usage (requests, tokens, dollars) by day and model",
        description=(
            "Print per-key usage by day and model. Asks a running proxy's /admin/usage "
            "(admin token from the env var admin.token_env names), or with --redis reads the "
            "quota store directly (quota.redis_url / cache.redis_url, quota.key_prefix)."
        ),
    )
    usage.add_argument("--config", metavar="PATH", help="TOML config file")
    usage.add_argument("--since", help="first day, YYYY-MM-DD (default: the 1st of this month)")
    usage.add_argument("--until", help="last day, YYYY-MM-DD (default: today, UTC)")
    usage.add_argument("--key", help="only this key id")
    usage.add_argument("--model", help="only this model")
    usage.add_argument(
        "--url", help="the proxy's base URL (default: http://server.host:server.port)"
    )
    usage.add_argument("--redis", action="store_true", help="read from Redis, not from a proxy")
    usage.add_argument("--json", action="store_true", help="print JSON instead of a table")
    usage.set_defaults(func=usage_command)


def _day(value: str | None, default: str) -> str:
    try:
        return dt.date.fromisoformat(value or default).isoformat()
    except ValueError:
        raise ConfigError(f"invalid date {value!r}: expected YYYY-MM-DD") from None


def usage_command(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    today = dt.datetime.now(dt.UTC).date().isoformat()
    since = _day(args.since, today[:8] + "01")
    until = _day(args.until, today)
    if args.redis:
        rows = asyncio.run(_from_redis(settings, since, until, args.key))
    else:
        rows = _from_proxy(settings, args.url, since, until, args.key)
    if args.model:
        rows = [row for row in rows if row.get("model") == args.model]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)
    return 0


def _from_proxy(
    settings: Settings, url: str | None, since: str, until: str, key: str | None
) -> list[dict[str, Any]]:
    env = settings.admin.token_env
    token = os.environ.get(env) if env else None
    if not token:
        raise ConfigError(
            "no admin token: set admin.token_env (config or COMPACTION_PROXY_ADMIN__TOKEN_ENV) "
            "to the name of an env var holding it, or use --redis"
        )
    host = settings.server.host
    host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    base = (url or f"http://{host}:{settings.server.port}").rstrip("/")
    params = {"since": since, "until": until, **({"key": key} if key else {})}
    try:
        reply = httpx.get(
            f"{base}/admin/usage",
            params=params,
            headers={"authorization": f"Bearer {token}"},
            timeout=30,
        )
    except httpx.HTTPError as exc:
        raise ConfigError(f"could not reach the proxy at {base}: {type(exc).__name__}") from None
    if reply.status_code != 200:
        try:
            message = reply.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = reply.text[:200]
        raise ConfigError(f"{base}/admin/usage answered {reply.status_code}: {message}")
    return list(reply.json()["data"])


async def _from_redis(
    settings: Settings, since: str, until: str, key: str | None
) -> list[dict[str, Any]]:
    from proxy.quota.ledger import LedgerUnavailable
    from proxy.quota.redis import RedisLedger
    from proxy.store.connect import connect

    quota = settings.quota
    url = quota.redis_url if quota.redis_url is not None else settings.cache.redis_url
    client = connect(url, socket_timeout_s=max(quota.socket_timeout_s, 5.0))
    ledger = RedisLedger(client, quota.key_prefix, retention_days=quota.usage_retention_days)
    try:
        rows = await ledger.usage(None if key is None else [key], since, until)
    except LedgerUnavailable as exc:
        raise ConfigError(f"could not read usage from Redis: {exc}") from None
    finally:
        await ledger.close()
    return [row.as_json() for row in rows]


def print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("no usage in this period", file=sys.stderr)
        return
    totals: dict[str, Any] = {"day": "total", "key": "", "model": ""}
    for _, field in COLUMNS[3:]:
        totals[field] = sum(row.get(field, 0) for row in rows)
    table = [[name for name, _ in COLUMNS]]
    for row in [*rows, totals]:
        cells = []
        for _, field in COLUMNS:
            value = row.get(field, "")
            cells.append(f"{value:.4f}" if field == "cost_usd" else str(value))
        table.append(cells)
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    for n, line in enumerate(table):
        print(
            "  ".join(
                c.ljust(w) if i < 3 else c.rjust(w)
                for i, (c, w) in enumerate(zip(line, widths, strict=True))
            )
        )
        if n == 0 or n == len(table) - 2:
            print("  ".join("-" * w for w in widths))
