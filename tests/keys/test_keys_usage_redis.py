"""The Redis ledger's usage writes (the meter's batch): a batch resent after its reply was
lost is counted once, and a dropped connection is not an outage."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from proxy.quota.ledger import UsageCounts
from proxy.quota.redis import _RECORD_LUA, RedisLedger
from proxy.quota.windows import windows_at
from proxy.store.connect import connect
from tests.keys.test_keys_quota import _LoseOneReply

NOW = 1_800_000_010.0
COUNTS = UsageCounts(requests=3, prompt_tokens_sent=1200, completion_tokens=40, cost_nano_usd=7)


def _expected(times: int) -> dict[str, Any]:
    return {
        "requests": 3 * times,
        "prompt_tokens_sent": 1200 * times,
        "completion_tokens": 40 * times,
        "cost_usd": 7 * times / 1e9,
    }


async def _usage(ledger: RedisLedger, key_id: str, model: str = "gpt-4o-mini") -> dict[str, Any]:
    day = windows_at(NOW).day
    [row] = [row for row in await ledger.usage([key_id], day, day) if row.model == model]
    got = row.as_json()
    return {name: got[name] for name in _expected(1)}


async def test_a_usage_write_whose_reply_was_lost_is_resent_and_counted_once(
    redis_prefix: str,
) -> None:
    """The script ran, its reply never arrived: the ledger sends the batch again on a new
    connection, the script sees its id and adds nothing; the write succeeds, no outage."""
    direct = Redis.from_url("redis://127.0.0.1:6379/0")
    await direct.script_load(_RECORD_LUA)  # so the first send runs it (no NOSCRIPT first)
    relay = _LoseOneReply()
    port = await relay.start()
    ledger = RedisLedger(connect(f"redis://127.0.0.1:{port}/0", socket_timeout_s=5), redis_prefix)
    w = windows_at(NOW)
    try:
        await ledger.record("k", "gpt-4o-mini", COUNTS, NOW)
        assert relay.lost and relay.evalshas == 2  # sent, reply lost, sent again
        assert (ledger.errors, ledger.last_error) == (0, None)
        assert await _usage(ledger, "k") == _expected(1)
        for window in (w.day, w.month):  # spend, which the quota checks read, once too
            assert await direct.get(ledger.key("k", "spend", window)) == b"7"
        assert await direct.sismember(ledger.index_key, "k")
    finally:
        relay.close()
        await ledger.close()
        await direct.aclose()


@pytest.mark.parametrize("where", ["single", "cluster"])
async def test_a_usage_write_resent_with_the_same_id_is_counted_once(
    redis_prefix: str, redis_cluster: list[str], where: str
) -> None:
    url: str | list[str] = redis_cluster if where == "cluster" else "redis://127.0.0.1:6379/0"
    ledger = RedisLedger(connect(url, socket_timeout_s=5), redis_prefix)
    w = windows_at(NOW)
    try:
        await ledger.record("k", "gpt-4o-mini", COUNTS, NOW, record_id=("a", 1))
        await ledger.record("k", "gpt-4o-mini", COUNTS, NOW, record_id=("a", 1))
        assert await _usage(ledger, "k") == _expected(1)
        await ledger.record("k", "gpt-4o-mini", COUNTS, NOW, record_id=("a", 2))
        await ledger.record("k", "gpt-4o-mini", COUNTS, NOW, record_id=("b", 1))  # another writer
        await ledger.record("k", "gpt-4o", COUNTS, NOW, record_id=("a", 1))  # another model
        await ledger.record("k", "gpt-4o-mini", COUNTS, NOW)  # an id of its own
        assert await _usage(ledger, "k", "gpt-4o-mini") == _expected(4)
        assert await _usage(ledger, "k", "gpt-4o") == _expected(1)
        # An earlier number of a writer that went on since: a resend, whatever its age.
        await ledger.record("k", "gpt-4o-mini", COUNTS, NOW, record_id=("a", 1))
        assert await _usage(ledger, "k", "gpt-4o-mini") == _expected(4)
        assert await ledger.client.get(ledger.key("k", "spend", w.month)) == b"35"
        writes = ledger.key("k", "writes", w.day)
        assert 86400 < await ledger.client.ttl(writes) <= 2 * 86400  # no minute-long id
        assert await ledger.client.hlen(writes) == 4  # one field per writer and model
        if where == "cluster":  # beside the key's usage: one script, one node
            slot = ledger.client.cluster_keyslot
            assert await slot(writes) == await slot(ledger.key("k", "usage", w.day))
        assert ledger.errors == 0
    finally:
        if where == "cluster":
            keys = [ledger.key("k", "usage", w.day), ledger.index_key]
            keys += [ledger.key("k", "spend", window) for window in (w.day, w.month)]
            keys += [ledger.key("k", "writes", w.day)]
            for key in keys:
                await ledger.client.delete(key)
        await ledger.close()


async def test_a_usage_write_after_redis_forgot_the_script_loads_it_again(
    redis_prefix: str,
) -> None:
    client = Redis.from_url("redis://127.0.0.1:6379/0", socket_timeout=5)
    ledger = RedisLedger(client, redis_prefix)
    # A script text of its own that this Redis has never seen, as after SCRIPT FLUSH or a
    # restart.
    ledger._record = client.register_script(f"{_RECORD_LUA}\n-- {redis_prefix}")
    try:
        await ledger.record("k", "gpt-4o-mini", COUNTS, NOW)
        assert ledger.errors == 0
        assert await _usage(ledger, "k") == _expected(1)
    finally:
        await ledger.close()
