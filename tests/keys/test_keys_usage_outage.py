"""The meter across a Redis outage: a batch whose write failed is held and written once
Redis answers again, a batch that landed but whose reply was lost is not counted twice, and
what is kept for a retry is capped."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from redis.asyncio import Redis

from proxy.quota.ledger import UsageCounts
from proxy.quota.redis import _RECORD_LUA, RedisLedger
from proxy.quota.windows import day_of
from proxy.store.connect import connect
from proxy.usage import Meter, Pricing
from tests.conftest import make_settings
from tests.keys.conftest import KEY_A, key_entry, keyed_settings
from tests.keys.test_keys_quota import redis_quota

REDIS_URL = "redis://127.0.0.1:6379/0"


class _Outage:
    """A TCP relay in front of Redis that can go down (its port refuses connections and
    open ones are cut) and come back on the same port. `lose_reply_then_down`: the first
    EVALSHA reaches Redis, its reply is thrown away and the relay goes down at once, so the
    ledger's resend is refused too: a write that landed, seen as failed."""

    def __init__(self) -> None:
        self.port = 0
        self.server: asyncio.Server | None = None
        self.open: set[asyncio.StreamWriter] = set()
        self.lose_reply_then_down = False
        self.lost = False

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        self.port = int(self.server.sockets[0].getsockname()[1])
        return self.port

    def down(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        for writer in list(self.open):
            writer.transport.abort()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", 6379)
        self.open.add(writer)
        sent_script = asyncio.Event()

        async def to_redis() -> None:
            while data := await reader.read(65536):
                if b"EVALSHA" in data:
                    sent_script.set()
                up_writer.write(data)
                await up_writer.drain()

        async def to_client() -> None:
            while data := await up_reader.read(65536):
                if self.lose_reply_then_down and sent_script.is_set() and not self.lost:
                    self.lost = True
                    self.down()
                    return
                writer.write(data)
                await writer.drain()

        tasks = [asyncio.create_task(to_redis()), asyncio.create_task(to_client())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            self.open.discard(writer)
            writer.close()
            up_writer.close()


class _Rig:
    """A meter writing to the Redis ledger through the relay; its clocks are the test's."""

    def __init__(self, relay: _Outage, prefix: str) -> None:
        self.relay = relay
        self.now = [0.0]  # the ledger's back-off clock
        client = connect(f"redis://127.0.0.1:{relay.port}/0", socket_timeout_s=2)
        self.ledger = RedisLedger(client, prefix, clock=lambda: self.now[0])
        settings = make_settings()
        self.meter = Meter(settings, self.ledger, Pricing(settings.pricing))
        self.meter.flush_s = 3600.0  # flushed by the test, not in the background

    async def flush(self) -> None:
        self.now[0] += 2.0  # past the ledger's back-off after a failure (1 s)
        await self.meter.flush()

    async def used(self, key_id: str = "k") -> dict[str, UsageCounts]:
        """Per model, what Redis holds (read directly, not through the relay)."""
        ledger = RedisLedger(connect(REDIS_URL, socket_timeout_s=2), self.ledger.prefix)
        try:
            day = day_of(self.meter.clock())
            rows = await ledger.usage([key_id], day, day)
        finally:
            await ledger.close()
        return {row.model: row.counts for row in rows}

    async def close(self) -> None:
        self.relay.down()
        await self.meter.join()
        await self.ledger.close()


def _counts(requests: int, tokens: int) -> UsageCounts:
    return UsageCounts(requests=requests, prompt_tokens_forwarded=tokens, cost_nano_usd=5 * tokens)


@pytest.fixture
async def rig(redis_prefix: str) -> Any:
    relay = _Outage()
    await relay.start()
    made = _Rig(relay, redis_prefix)
    yield made
    await made.close()


async def test_usage_written_during_an_outage_appears_once_after_redis_returns(rig: _Rig) -> None:
    meter = rig.meter
    rig.meter.add("k", "gpt-4o", _counts(1, 100))
    await rig.flush()
    assert await rig.used() == {"gpt-4o": _counts(1, 100)}  # Redis up: written at once
    rig.relay.down()
    meter.add("k", "gpt-4o", _counts(2, 300))
    meter.add("k", "gpt-4o-mini", _counts(1, 50))
    for _ in range(3):  # three flushes while Redis is away: nothing is lost, nothing written
        await rig.flush()
        meter.add("k", "gpt-4o", _counts(1, 10))  # usage goes on during the outage
    assert meter.held_rows >= 1
    assert await rig.used() == {"gpt-4o": _counts(1, 100)}
    await rig.relay.start()
    await rig.flush()
    await rig.flush()  # a held row first, the usage recorded behind it next
    expected = {"gpt-4o": _counts(1 + 2 + 3, 100 + 300 + 30), "gpt-4o-mini": _counts(1, 50)}
    assert await rig.used() == expected
    assert (meter.held_rows, meter.dropped_rows, meter.errors) == (0, 0, 0)
    await rig.flush()
    assert await rig.used() == expected  # written once


async def test_shutdown_with_redis_away_says_what_was_not_written(
    rig: _Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.relay.down()
    for model in ("a", "b", "c"):
        rig.meter.add("k", model, _counts(2, 10))
    rig.now[0] += 2.0
    with caplog.at_level(logging.WARNING, logger="proxy.usage"):
        await rig.meter.join()  # one held after the failed write, two unsent behind it
    assert "3 rows (6 replies) still not written" in caplog.text


async def test_a_batch_that_landed_but_whose_reply_was_lost_is_not_counted_twice(
    rig: _Rig,
) -> None:
    """The script ran, the reply was lost and the resend refused (Redis went away): the
    batch is held under its id, and written again with it once Redis is back."""
    direct = Redis.from_url(REDIS_URL)
    await direct.script_load(_RECORD_LUA)  # so the first send runs it (no NOSCRIPT first)
    await direct.aclose()
    rig.relay.lose_reply_then_down = True
    rig.meter.add("k", "gpt-4o", _counts(2, 200))
    await rig.flush()
    assert rig.relay.lost and rig.meter.held_rows == 1
    assert await rig.used() == {"gpt-4o": _counts(2, 200)}  # it did land
    rig.meter.add("k", "gpt-4o", _counts(1, 7))  # more usage while it is held
    await rig.flush()  # still down
    await rig.relay.start()
    await rig.flush()
    await rig.flush()
    assert await rig.used() == {"gpt-4o": _counts(3, 207)}
    assert rig.meter.held_rows == 0


async def test_a_batch_that_landed_is_counted_once_however_long_redis_stays_away(
    rig: _Rig,
) -> None:
    """The script ran, the reply was lost, and Redis stays away for minutes: the held batch
    is resent under its id when Redis is back, and counted once; the usage recorded while it
    was held goes out after it, under a later id, and is counted too."""
    direct = Redis.from_url(REDIS_URL)
    await direct.script_load(_RECORD_LUA)  # so the first send runs it (no NOSCRIPT first)
    await direct.aclose()
    rig.relay.lose_reply_then_down = True
    rig.meter.add("k", "gpt-4o", _counts(2, 200))
    await rig.flush()
    assert rig.relay.lost and rig.meter.held_rows == 1
    [held] = rig.meter._held.values()
    for _ in range(3):
        rig.meter.add("k", "gpt-4o", _counts(1, 7))
        rig.now[0] += 100.0  # the ledger's and the meter's clocks, minutes on
        await rig.flush()  # still down
        assert [row.record_id for row in rig.meter._held.values()] == [held.record_id]
    await rig.relay.start()
    await rig.flush()
    await rig.flush()
    assert await rig.used() == {"gpt-4o": _counts(2 + 3, 200 + 21)}
    assert rig.meter.held_rows == 0


async def test_rows_kept_for_an_outage_are_capped_counted_and_warned_once(
    make_app: Any, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    relay = _Outage()
    port = await relay.start()
    quota = redis_quota(redis_prefix, f"redis://127.0.0.1:{port}/0")
    app = await make_app(keyed_settings(key_entry("team-a", KEY_A), quota=quota))
    meter: Meter = app.state.meter
    meter.flush_s = 3600.0
    meter.max_held_rows = 3
    now = [0.0]
    ledger = app.state.quotas.ledger
    ledger._clock = lambda: now[0]
    relay.down()
    with caplog.at_level(logging.WARNING, logger="proxy.usage"):
        for round_ in range(3):
            for model in ("m1", "m2", "m3", "m4", "m5"):
                meter.add("team-a", f"{model}-{round_}", UsageCounts(requests=1))
            now[0] += 2.0
            await meter.flush()
            assert meter.held_rows + len(meter._batch) <= 3
    assert meter.dropped_rows == 15 - 3
    assert meter.errors == 12  # the dropped rows' replies
    capped = [r for r in caplog.records if "the cap" in r.getMessage()]
    assert len(capped) == 1
    metrics = (await app.client.get("/metrics")).text
    assert "compaction_proxy_usage_dropped_rows_total 12.0" in metrics
    assert "compaction_proxy_usage_unrecorded_total 12.0" in metrics
    await relay.start()
    now[0] += 2.0
    await meter.join()  # as at shutdown: what was kept is written
    day = day_of(meter.clock())
    rows = await ledger.usage(["team-a"], day, day)
    assert sorted(row.model for row in rows) == ["m1-0", "m2-0", "m3-0"]
    assert all(row.counts.requests == 1 for row in rows)
    relay.down()
