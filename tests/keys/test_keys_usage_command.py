"""`compaction-proxy usage --redis`: the table straight from the quota store."""

from __future__ import annotations

import asyncio
import secrets
import time

import pytest
from redis.asyncio import Redis

from proxy.cli import main
from proxy.quota.ledger import UsageCounts
from proxy.quota.redis import RedisLedger
from proxy.quota.windows import day_of
from proxy.store.connect import connect

REDIS_URL = "redis://127.0.0.1:6379/0"


async def _record(prefix: str) -> None:
    ledger = RedisLedger(connect(REDIS_URL, socket_timeout_s=2), prefix)
    now = time.time()
    counts = UsageCounts(requests=3, prompt_tokens_forwarded=1200, cost_nano_usd=4_500_000)
    await ledger.record("team-a", "gpt-4o", counts, now)
    await ledger.record("team-b", "gpt-4o-mini", UsageCounts(requests=1), now)
    await ledger.close()


async def _cleanup(prefix: str) -> None:
    client = Redis.from_url(REDIS_URL)
    keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


def test_usage_command_prints_the_table_from_redis(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = f"test-keys-cli-{secrets.token_hex(6)}:"
    asyncio.run(_record(prefix))
    try:
        monkeypatch.setenv("COMPACTION_PROXY_QUOTA__KEY_PREFIX", prefix)
        with pytest.raises(SystemExit) as done:
            main(["usage", "--redis", "--key", "team-a"])
        assert done.value.code == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split()[:4] == ["day", "key", "model", "requests"]
        row = lines[2].split()
        assert row[:5] == [day_of(time.time()), "team-a", "gpt-4o", "3", "0"]
        assert row[5] == "1200"
        assert "0.0045" in lines[2]
        assert not any("team-b" in line for line in lines)
        assert lines[-1].split()[:2] == ["total", "3"]
    finally:
        asyncio.run(_cleanup(prefix))


def test_usage_command_without_an_admin_token_says_how_to_set_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["usage"])
    assert done.value.code == 2
    assert "admin.token_env" in capsys.readouterr().err
