"""Per-key quotas: requests and prompt tokens per minute/day, spend caps, across replicas."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import respx

from proxy.quota.ledger import LimitArgs
from proxy.quota.windows import duration_text, windows_at
from tests.keys.conftest import (
    KEY_A,
    KEY_B,
    bearer,
    chat,
    free_port,
    history_chat,
    key_entry,
    keyed_settings,
)
from tests.upstream_fakes import REPLY, FakeUpstream

pytestmark = pytest.mark.usefixtures("upstream")


def redis_quota(prefix: str, url: str | list[str] = "redis://127.0.0.1:6379/0") -> dict[str, Any]:
    # A generous timeout: on a loaded machine a slow reply must not read as an outage.
    return {"backend": "redis", "redis_url": url, "key_prefix": prefix, "socket_timeout_s": 5.0}


async def test_requests_per_minute_gives_openai_429_with_retry_and_ratelimit_headers(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    route = upstream.post("/chat/completions").respond(
        json=REPLY, headers={"x-ratelimit-remaining-requests": "4999"}
    )
    app = await make_app(keyed_settings(key_entry("team-a", KEY_A, requests_per_minute=2)))
    app.state.quotas.clock = lambda: 1_800_000_030.0  # 30 s into a minute
    first = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert first.status_code == 200
    # The upstream's own rate-limit headers pass through untouched; ours sit beside them.
    assert first.headers["x-ratelimit-remaining-requests"] == "4999"
    assert first.headers["x-compaction-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-compaction-ratelimit-limit-requests"] == "2"
    second = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert second.status_code == 200
    third = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert third.status_code == 429
    error = third.json()["error"]
    assert error["code"] == "rate_limit_exceeded"
    assert error["type"] == "requests"
    assert "Limit 2, Used 2, Requested 1" in error["message"]
    assert third.headers["retry-after"] == "30"
    assert third.headers["x-ratelimit-limit-requests"] == "2"
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    assert third.headers["x-ratelimit-reset-requests"] == "30s"
    assert route.call_count == 2
    app.state.quotas.clock = lambda: 1_800_000_060.0  # the next minute
    again = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert again.status_code == 200


async def test_limits_are_per_key(make_app: Any, upstream: respx.MockRouter) -> None:
    upstream.post("/chat/completions").respond(json=REPLY)
    app = await make_app(
        keyed_settings(
            key_entry("team-a", KEY_A, requests_per_minute=1),
            key_entry("team-b", KEY_B, requests_per_minute=1),
        )
    )
    app.state.quotas.clock = lambda: 1_800_000_010.0  # no minute turns between the requests
    for key in (KEY_A, KEY_B):
        reply = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(key))
        assert reply.status_code == 200
    denied = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert denied.status_code == 429


async def test_prompt_tokens_count_as_forwarded_so_compaction_saves_quota(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    FakeUpstream().install(upstream)
    body = history_chat(words=100)  # about 1000 prompt tokens before compaction
    settings = keyed_settings(
        key_entry("team-a", KEY_A, prompt_tokens_per_day=700, budget_tokens=400)
    )
    app = await make_app(settings)
    compacted = await app.client.post("/v1/chat/completions", json=body, headers=bearer(KEY_A))
    assert compacted.status_code == 200, compacted.text
    before = int(compacted.headers["x-compaction-tokens-before"])
    after = int(compacted.headers["x-compaction-tokens-after"])
    assert after < 700 < before
    remaining = int(compacted.headers["x-compaction-ratelimit-remaining-tokens"])
    assert remaining == 700 - after
    uncompacted = await app.client.post(
        "/v1/chat/completions", json=body, headers={**bearer(KEY_A), "x-compaction": "off"}
    )
    assert uncompacted.status_code == 429
    error = uncompacted.json()["error"]
    assert error["code"] == "rate_limit_exceeded"
    assert error["type"] == "tokens"
    assert "prompt tokens per day" in error["message"]
    assert "This request alone is over the limit" in error["message"]


async def test_spend_cap_refuses_the_next_request_with_insufficient_quota(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    usage = {"prompt_tokens": 1_000_000, "completion_tokens": 0, "total_tokens": 1_000_000}
    upstream.post("/chat/completions").respond(json={**REPLY, "usage": usage})
    app = await make_app(keyed_settings(key_entry("team-a", KEY_A, spend_usd_per_day=0.10)))
    first = await app.client.post(
        "/v1/chat/completions", json=chat("gpt-4o-mini"), headers=bearer(KEY_A)
    )
    assert first.status_code == 200
    assert first.headers["x-compaction-cost-usd"] == "0.150000"  # 1M input tokens at $0.15
    await app.state.meter.join()
    second = await app.client.post(
        "/v1/chat/completions", json=chat("gpt-4o-mini"), headers=bearer(KEY_A)
    )
    assert second.status_code == 429
    error = second.json()["error"]
    assert error["code"] == "insufficient_quota"
    assert error["type"] == "insufficient_quota"
    assert "$0.1500 of its daily cap of $0.10" in error["message"]
    assert int(second.headers["retry-after"]) > 0


async def test_two_replicas_sharing_redis_let_exactly_n_of_n_plus_k_through(
    make_app: Any, upstream: respx.MockRouter, redis_prefix: str
) -> None:
    upstream.post("/chat/completions").respond(json=REPLY)
    settings = keyed_settings(
        key_entry("team-a", KEY_A, requests_per_minute=7), quota=redis_quota(redis_prefix)
    )
    replicas = [await make_app(settings), await make_app(settings)]
    for replica in replicas:
        replica.state.quotas.clock = lambda: 1_800_000_010.0

    async def send(i: int) -> int:
        client = replicas[i % 2].client
        reply = await client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
        return reply.status_code

    codes = await asyncio.gather(*(send(i) for i in range(7 + 5)))
    assert sorted(codes) == [200] * 7 + [429] * 5


async def test_spend_recorded_by_one_replica_caps_the_other(
    make_app: Any, upstream: respx.MockRouter, redis_prefix: str
) -> None:
    usage = {"prompt_tokens": 1_000_000, "completion_tokens": 0, "total_tokens": 1_000_000}
    upstream.post("/chat/completions").respond(json={**REPLY, "usage": usage})
    settings = keyed_settings(
        key_entry("team-a", KEY_A, spend_usd_per_month=0.10), quota=redis_quota(redis_prefix)
    )
    one, two = await make_app(settings), await make_app(settings)
    ok = await one.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert ok.status_code == 200
    await one.state.meter.join()
    capped = await two.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert capped.status_code == 429
    assert capped.json()["error"]["code"] == "insufficient_quota"
    assert "monthly cap" in capped.json()["error"]["message"]


async def test_redis_down_fails_open_with_a_metric_and_one_warning(
    make_app: Any, upstream: respx.MockRouter, caplog: pytest.LogCaptureFixture
) -> None:
    upstream.post("/chat/completions").respond(json=REPLY)
    dead = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    settings = keyed_settings(
        key_entry("team-a", KEY_A, requests_per_minute=1), quota=redis_quota("p:", dead)
    )
    app = await make_app(settings)
    with caplog.at_level(logging.WARNING, logger="proxy.quota"):
        for _ in range(3):
            reply = await app.client.post(
                "/v1/chat/completions", json=chat(), headers=bearer(KEY_A)
            )
            assert reply.status_code == 200  # over the limit of 1, but unmetered
    warnings = [r for r in caplog.records if r.name == "proxy.quota"]
    assert len(warnings) == 1
    assert "unmetered" in warnings[0].getMessage()
    assert "hunter2" not in caplog.text
    metrics = (await app.client.get("/metrics")).text
    assert 'compaction_proxy_quota_failed_open_total{backend="redis"} 3.0' in metrics


async def test_redis_down_fails_closed_when_configured(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    route = upstream.post("/chat/completions").respond(json=REPLY)
    dead = f"redis://127.0.0.1:{free_port()}/0"
    quota = {**redis_quota("p:", dead), "on_redis_error": "closed"}
    app = await make_app(
        keyed_settings(key_entry("team-a", KEY_A, requests_per_minute=10), quota=quota)
    )
    reply = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "quota_unavailable"
    assert not route.called


async def test_keys_without_limits_never_touch_the_ledger(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    upstream.post("/chat/completions").respond(json=REPLY)
    dead = f"redis://127.0.0.1:{free_port()}/0"
    app = await make_app(keyed_settings(key_entry("team-a", KEY_A), quota=redis_quota("p:", dead)))
    reply = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert reply.status_code == 200
    assert "x-compaction-ratelimit-remaining-requests" not in reply.headers
    assert app.state.quotas.ledger.errors == 0


async def test_cluster_two_replicas_exactly_n_and_one_slot_per_key(
    make_app: Any, upstream: respx.MockRouter, redis_cluster: list[str]
) -> None:
    upstream.post("/chat/completions").respond(json=REPLY)
    prefix = "test-cluster:"
    settings = keyed_settings(
        key_entry("team-a", KEY_A, requests_per_minute=5, prompt_tokens_per_day=10_000),
        key_entry("team-b", KEY_B, requests_per_minute=5),
        quota=redis_quota(prefix, redis_cluster),
    )
    replicas = [await make_app(settings), await make_app(settings)]
    clock = 1_800_000_000.0 + 3600 * 7 + 12
    for replica in replicas:
        replica.state.quotas.clock = replica.state.meter.clock = lambda: clock

    async def send(i: int, key: str) -> int:
        client = replicas[i % 2].client
        reply = await client.post("/v1/chat/completions", json=chat(), headers=bearer(key))
        return reply.status_code

    codes = await asyncio.gather(*(send(i, KEY_A) for i in range(5 + 4)))
    assert sorted(codes) == [200] * 5 + [429] * 4
    codes_b = await asyncio.gather(*(send(i, KEY_B) for i in range(6)))
    assert sorted(codes_b) == [200] * 5 + [429]
    await replicas[0].state.meter.join()
    await replicas[1].state.meter.join()
    rows = await replicas[0].state.meter.ledger.usage(None, "2027-01-15", "2027-01-15")
    assert {r.key: r.counts.requests for r in rows} == {"team-a": 5, "team-b": 5}
    ledger = replicas[0].state.quotas.ledger
    # A charge that timed out may have run: the cluster client never sends it again (a
    # retry would count it twice and refuse one request too many).
    assert ledger.client.retry.get_retries() == 0
    w = windows_at(clock)
    slots = {
        await ledger.client.cluster_keyslot(ledger.key("team-a", *parts))
        for parts in (("rpm", w.minute), ("tpd", w.day), ("spend", w.month), ("usage", w.day))
    }
    assert len(slots) == 1


def test_limit_args_and_reset_texts() -> None:
    from proxy.auth.keys import Limits

    args = LimitArgs.of(Limits(requests_per_minute=3, spend_usd_per_day=1.5))
    assert (args.requests, args.tokens_minute, args.spend_day_nano) == (3, 0, 1_500_000_000)
    assert duration_text(0.25) == "250ms"
    assert duration_text(1) == "1s"
    assert duration_text(360) == "6m0s"
    assert duration_text(7384) == "2h3m4s"
    w = windows_at(1_800_000_030.0)
    assert (w.day, w.month, w.minute_reset_s) == ("2027-01-15", "2027-01", 30.0)


async def test_passthrough_routes_count_requests_too(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    upstream.get("/models").respond(json={"data": []})
    app = await make_app(keyed_settings(key_entry("team-a", KEY_A, requests_per_minute=1)))
    app.state.quotas.clock = lambda: 1_800_000_010.0  # no minute turns between the requests
    assert (await app.client.get("/v1/models", headers=bearer(KEY_A))).status_code == 200
    denied = await app.client.get("/v1/models", headers=bearer(KEY_A))
    assert denied.status_code == 429


async def test_summary_store_on_the_cluster_reuses_a_summary_across_replicas(
    make_app: Any, upstream: respx.MockRouter, redis_cluster: list[str]
) -> None:
    fake = FakeUpstream().install(upstream)
    cache = {
        "backend": "redis",
        "redis_url": redis_cluster,
        "key_prefix": f"test-cluster-store-{id(fake)}:",
    }
    settings = keyed_settings(key_entry("team-a", KEY_A), cache=cache)
    one, two = await make_app(settings), await make_app(settings)
    body, force = history_chat(), {"x-compaction": "force"}
    first = await one.client.post(
        "/v1/chat/completions", json=body, headers={**bearer(KEY_A), **force}
    )
    assert first.headers["x-compaction-status"] == "compacted"
    second = await two.client.post(
        "/v1/chat/completions", json=body, headers={**bearer(KEY_A), **force}
    )
    assert second.headers["x-compaction-status"] == "reused"
    assert len(fake.summary_calls) == 1
    assert one.state.compactor.store.errors == 0


async def test_memory_spend_written_after_midnight_never_turns_todays_counters_back() -> None:
    from proxy.auth.keys import Limits
    from proxy.quota import MemoryLedger, UsageCounts

    ledger = MemoryLedger()
    limits = LimitArgs.of(Limits(requests_per_minute=100, prompt_tokens_per_day=1_000))
    today = 1_800_000_000.0 + 86400
    await ledger.charge("k", limits, 400, windows_at(today))
    # Yesterday's batch, flushed late: spend of yesterday, today's counters untouched.
    await ledger.record("k", "m", UsageCounts(requests=1, cost_nano_usd=5), today - 86400)
    charge = await ledger.charge("k", limits, 400, windows_at(today + 1))
    assert (charge.denied, charge.key.requests, charge.key.tokens_day) == (None, 2, 800)
    assert charge.key.spend_day_nano == 0
    assert (await ledger.charge("k", limits, 400, windows_at(today + 2))).denied == "tokens_day"


async def test_concurrent_charges_stay_exact_across_replicas(
    make_app: Any, upstream: respx.MockRouter, redis_prefix: str
) -> None:
    upstream.post("/chat/completions").respond(json=REPLY)
    settings = keyed_settings(
        key_entry("team-a", KEY_A, requests_per_minute=30, prompt_tokens_per_day=10**9),
        quota=redis_quota(redis_prefix),
    )
    replicas = [await make_app(settings), await make_app(settings)]
    for replica in replicas:
        replica.state.quotas.clock = lambda: 1_800_000_010.0

    async def send(i: int) -> int:
        client = replicas[i % 2].client
        reply = await client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
        return reply.status_code

    codes = await asyncio.gather(*(send(i) for i in range(30 + 25)))
    assert sorted(codes) == [200] * 30 + [429] * 25
    assert all(replica.state.quotas.ledger.errors == 0 for replica in replicas)


@pytest.mark.parametrize("together", [1, 5], ids=["alone", "pipelined"])
async def test_a_charge_after_redis_forgot_the_script_loads_it_again(
    redis_prefix: str, together: int
) -> None:
    """Alone (the registered script's own call) or with others in one pipeline."""
    from redis.asyncio import Redis

    from proxy.auth.keys import Limits
    from proxy.quota.redis import _CHARGE_LUA, RedisLedger

    client = Redis.from_url("redis://127.0.0.1:6379/0", socket_timeout=5)
    ledger = RedisLedger(client, redis_prefix)
    # A script text of its own that this Redis has never seen, as after SCRIPT FLUSH or a
    # restart.
    ledger._charge = client.register_script(f"{_CHARGE_LUA}\n-- {redis_prefix}")
    try:
        limits = LimitArgs.of(Limits(requests_per_minute=5))
        w = windows_at(1_800_000_010.0)
        charges = await asyncio.gather(*(ledger.charge("k", limits, 0, w) for _ in range(together)))
        assert sorted(charge.key.requests for charge in charges) == list(range(1, together + 1))
        assert all(charge.denied is None for charge in charges) and ledger.errors == 0
    finally:
        await ledger.close()


async def test_a_hung_redis_fails_open_after_the_socket_timeout(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    upstream.post("/chat/completions").respond(json=REPLY)
    received: list[bytes] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.read(65536))
        await reader.read()  # until the proxy gives up and closes

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    quota = {**redis_quota("p:", f"redis://127.0.0.1:{port}/0"), "socket_timeout_s": 0.2}
    app = await make_app(
        keyed_settings(key_entry("team-a", KEY_A, requests_per_minute=1), quota=quota)
    )
    try:
        reply = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
        assert reply.status_code == 200  # unmetered, not stuck
        assert app.state.quotas.failed_open == 1
        assert app.state.quotas.ledger.errors == 1
        assert received  # it did ask
    finally:
        server.close()


async def test_charges_reconnect_after_redis_drops_the_connection(redis_prefix: str) -> None:
    from redis.asyncio import Redis

    from proxy.auth.keys import Limits
    from proxy.quota import LedgerUnavailable
    from proxy.quota.redis import RedisLedger

    name = redis_prefix.replace(":", "")
    client = Redis.from_url("redis://127.0.0.1:6379/0", socket_timeout=5, client_name=name)
    admin = Redis.from_url("redis://127.0.0.1:6379/0")
    now = [0.0]
    ledger = RedisLedger(client, redis_prefix, clock=lambda: now[0])
    limits = LimitArgs.of(Limits(requests_per_minute=10))
    w = windows_at(1_800_000_010.0)
    try:
        assert (await ledger.charge("k", limits, 0, w)).key.requests == 1
        # Only the ledger's own connections (by their name): Redis is shared.
        ours = [c for c in await admin.client_list() if c.get("name") == name]
        assert ours
        for connection in ours:
            await admin.client_kill_filter(_id=connection["id"])
        outcomes: list[int | str] = []
        for _ in range(3):  # a charge sent as the connection went is unmetered, no more
            now[0] += 10  # past the outage back-off
            try:
                outcomes.append((await ledger.charge("k", limits, 0, w)).key.requests)
                break
            except LedgerUnavailable:
                outcomes.append("unavailable")
        assert outcomes in ([2], ["unavailable", 2])
        assert ledger.errors == outcomes.count("unavailable")
    finally:
        await ledger.close()
        await admin.aclose()


class _LoseOneReply:
    """A TCP relay in front of Redis that forwards the first EVALSHA it sees, then throws
    Redis's reply away and closes the client's connection: a reply lost after the script
    ran. Every later connection is relayed untouched."""

    def __init__(self) -> None:
        self.evalshas = 0
        self.lost = False
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", 6379)
        drop_next = asyncio.Event()

        async def to_redis() -> None:
            while data := await reader.read(65536):
                if b"EVALSHA" in data:
                    self.evalshas += data.count(b"EVALSHA")
                    if not self.lost:
                        drop_next.set()
                up_writer.write(data)
                await up_writer.drain()

        async def to_client() -> None:
            while data := await up_reader.read(65536):
                if drop_next.is_set() and not self.lost:
                    self.lost = True
                    writer.transport.abort()
                    return
                writer.write(data)
                await writer.drain()

        tasks = [asyncio.create_task(to_redis()), asyncio.create_task(to_client())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            writer.close()
            up_writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def test_a_charge_whose_reply_was_lost_is_resent_and_counted_once(
    redis_prefix: str,
) -> None:
    """The script ran but its reply never arrived: the ledger's resend finds the charge
    already made and returns it; nothing fails open."""
    from redis.asyncio import Redis

    from proxy.auth.keys import Limits
    from proxy.quota.redis import _CHARGE_LUA, RedisLedger
    from proxy.store.connect import connect

    direct = Redis.from_url("redis://127.0.0.1:6379/0")
    await direct.script_load(_CHARGE_LUA)  # so the first send runs it (no NOSCRIPT first)
    relay = _LoseOneReply()
    port = await relay.start()
    ledger = RedisLedger(connect(f"redis://127.0.0.1:{port}/0", socket_timeout_s=5), redis_prefix)
    limits = LimitArgs.of(Limits(requests_per_minute=2))
    w = windows_at(1_800_000_010.0)
    try:
        first = await ledger.charge("k", limits, 0, w)
        assert (first.denied, first.key.requests, ledger.errors) == (None, 1, 0)
        assert relay.lost and relay.evalshas == 2  # sent, reply lost, sent again
        assert await direct.get(ledger.key("k", "rpm", w.minute)) == b"1"
        second = await ledger.charge("k", limits, 0, w)
        assert (second.denied, second.key.requests) == (None, 2)
        assert (await ledger.charge("k", limits, 0, w)).denied == "requests"
    finally:
        relay.close()
        await ledger.close()
        await direct.aclose()


@pytest.mark.parametrize("where", ["single", "cluster"])
async def test_a_charge_resent_with_the_same_id_is_counted_once(
    redis_prefix: str, redis_cluster: list[str], where: str
) -> None:
    from proxy.auth.keys import Limits
    from proxy.quota.redis import RedisLedger
    from proxy.store.connect import connect

    url: str | list[str] = redis_cluster if where == "cluster" else "redis://127.0.0.1:6379/0"
    ledger = RedisLedger(connect(url, socket_timeout_s=5), redis_prefix)
    limits = LimitArgs.of(Limits(requests_per_minute=2, prompt_tokens_per_day=1000))
    w = windows_at(1_800_000_010.0)
    try:
        first = await ledger.charge("k", limits, 300, w, charge_id="a" * 32)
        again = await ledger.charge("k", limits, 300, w, charge_id="a" * 32)
        assert (first.denied, *first.key) == (again.denied, *again.key) == (None, 1, 0, 300, 0, 0)
        other = await ledger.charge("k", limits, 300, w, charge_id="b" * 32)
        assert (other.denied, *other.key) == (None, 2, 0, 600, 0, 0)
        denied = await ledger.charge("k", limits, 300, w, charge_id="c" * 32)
        assert denied.denied == "requests"
        # A refusal resent is the same refusal, and still counts nothing.
        assert await ledger.charge("k", limits, 300, w, charge_id="c" * 32) == denied
        ttl = await ledger.client.ttl(ledger.key("k", "charge", "a" * 32))
        assert 0 < ttl <= 60
        if where == "cluster":  # beside the key's counters: one script, one node
            slot = ledger.client.cluster_keyslot
            charge_key = ledger.key("k", "charge", "a" * 32)
            assert await slot(charge_key) == await slot(ledger.key("k", "rpm", w.minute))
    finally:
        if where == "cluster":
            keys = [ledger.key("k", "rpm", w.minute), ledger.key("k", "tpd", w.day)]
            keys += [ledger.key("k", "charge", c * 32) for c in "abc"]
            for key in keys:
                await ledger.client.delete(key)
        await ledger.close()


@pytest.mark.parametrize(
    "policy",
    [
        {"requests_per_minute": 5},
        {"prompt_tokens_per_minute": 100},
        {"prompt_tokens_per_day": 1000},
        {"requests_per_minute": 5, "prompt_tokens_per_minute": 100, "prompt_tokens_per_day": 9},
        {"requests_per_minute": 2, "prompt_tokens_per_day": 1000},
        {"spend_usd_per_day": 1.0},
    ],
)
@pytest.mark.parametrize("now", [1_800_000_030.0, 1_800_000_059.75, 1_800_000_000.5])
async def test_reply_quota_headers_are_the_429s_under_the_compaction_names(
    policy: dict[str, Any], now: float
) -> None:
    """A reply's quota headers say what a 429's would, under the compaction names;
    remaining is floored at 0 (a key over its limit after a reload)."""
    from proxy.auth.keys import Limits, ProxyKey
    from proxy.quota import Quotas
    from proxy.quota.quotas import rate_limit_headers

    ledger, seen = recording_ledger()
    quotas = Quotas(ledger, clock=lambda: now)
    key = ProxyKey("k", b"", limits=Limits(**policy))
    limits = LimitArgs.of(key.limits)
    w = windows_at(now)
    for tokens in (0, 7, 60, 0, 0):
        verdict = await quotas.charge(key, tokens)
        if verdict.refusal is not None:
            refused = rate_limit_headers(limits, seen[-1].key, w)
            assert refused.items() <= verdict.refusal.headers.items()
            continue
        expected = rate_limit_headers(limits, seen[-1].key, w)
        assert verdict.headers == {
            f"x-compaction-{name[2:]}": value for name, value in expected.items()
        }
    # A key over its limits (they were lowered by a reload): nothing negative is shown.
    counted = (await ledger.charge("k", LimitArgs.of(Limits()), 10**6, w)).key
    over = counted._replace(requests=10**6)
    shown = rate_limit_headers(limits, over, w)
    assert all(not value.startswith("-") for value in shown.values())
    assert shown.get("x-ratelimit-remaining-requests", "0") == "0"


@pytest.mark.parametrize(
    "policy",
    [
        {"requests_per_minute": 100, "prompt_tokens_per_minute": 10_000},
        {"prompt_tokens_per_day": 10_000},
    ],
)
async def test_reply_quota_headers_stay_exact_as_the_clock_moves_through_seconds(
    policy: dict[str, Any],
) -> None:
    """Every reply says what `rate_limit_headers` says at its own time, the last instants
    of a second, of a minute (reset in ms) and of a day included."""
    from proxy.auth.keys import Limits, ProxyKey
    from proxy.quota import Quotas
    from proxy.quota.quotas import rate_limit_headers

    ledger, seen = recording_ledger()
    now = 1_800_000_030.0
    quotas = Quotas(ledger, clock=lambda: now)
    key = ProxyKey("k", b"", limits=Limits(**policy))
    limits = LimitArgs.of(key.limits)
    midnight = 1_800_057_600.0  # a UTC midnight
    times = [30.0, 30.1, 30.5, 30.9979, 30.9985, 30.9999, 31.0, 31.2, 58.0, 58.9, 59.0, 59.25]
    times += [59.75, 59.9995, 60.0, 60.3]
    times = [1_800_000_000.0 + t for t in times]
    times += [midnight - 2.5, midnight - 1.5, midnight - 1.0, midnight - 0.4, midnight + 0.2]
    for at in times:
        now = at
        verdict = await quotas.charge(key, 7)
        expected = rate_limit_headers(limits, seen[-1].key, windows_at(at))
        assert verdict.headers == {
            f"x-compaction-{name[2:]}": value for name, value in expected.items()
        }, at


def test_the_charge_scripts_result_reads_as_a_charge() -> None:
    """The script's result is one string: a JSON array, the denial then the counters."""
    from proxy.quota.ledger import Charge, Counters
    from proxy.quota.redis import _charge_of

    assert _charge_of(b'["",1,20,20,0,-5]') == Charge(None, Counters(1, 20, 20, 0, -5))
    assert _charge_of('["tokens_day",3,0,9,0,0]') == Charge("tokens_day", Counters(3, 0, 9, 0, 0))


async def test_counters_expire_from_the_charge_that_creates_them(redis_prefix: str) -> None:
    """Each counter gets its window's expiry when a charge creates it, also one first
    touched by a later charge (tokens after a charge of none), and never loses it."""
    from redis.asyncio import Redis

    from proxy.auth.keys import Limits
    from proxy.quota.redis import _DAY_TTL_S, _MINUTE_TTL_S, RedisLedger

    client = Redis.from_url("redis://127.0.0.1:6379/0", socket_timeout=5)
    ledger = RedisLedger(client, redis_prefix)
    policy = Limits(requests_per_minute=10, prompt_tokens_per_minute=1000, prompt_tokens_per_day=10)
    limits = LimitArgs.of(policy)
    w = windows_at(1_800_000_010.0)
    try:
        assert (await ledger.charge("k", limits, 0, w)).key.requests == 1
        assert await client.exists(ledger.key("k", "tpm", w.minute)) == 0
        charge = await ledger.charge("k", limits, 4, w)
        assert (charge.denied, *charge.key[:3]) == (None, 2, 4, 4)
        charge = await ledger.charge("k", limits, 5, w)
        assert (charge.denied, *charge.key[:3]) == (None, 3, 9, 9)
        assert (await ledger.charge("k", limits, 5, w)).denied == "tokens_day"  # 9 + 5 > 10
        for part, ttl in (("rpm", _MINUTE_TTL_S), ("tpm", _MINUTE_TTL_S), ("tpd", _DAY_TTL_S)):
            window = w.day if part == "tpd" else w.minute
            assert ttl - 30 < await client.ttl(ledger.key("k", part, window)) <= ttl, part
        assert await client.get(ledger.key("k", "tpd", w.day)) == b"9"
    finally:
        await ledger.close()


def recording_ledger() -> tuple[Any, list[Any]]:
    """A memory ledger that also keeps what each of its charges returned, in order."""
    from proxy.quota import MemoryLedger

    ledger = MemoryLedger()
    seen: list[Any] = []
    charge_of = ledger.charge

    async def charge(*args: Any) -> Any:
        seen.append(await charge_of(*args))
        return seen[-1]

    ledger.charge = charge  # type: ignore[method-assign]
    return ledger, seen


async def test_a_memory_verdict_is_a_value_counted_or_refused() -> None:
    """Allowed: counted, with the key's remaining quota for the reply. Refused: the 429
    with OpenAI's headers, not counted, and nothing charged to the ledger."""
    from proxy.auth.keys import Limits, ProxyKey
    from proxy.quota import MemoryLedger, Quotas

    now = 1_800_000_030.0
    ledger = MemoryLedger()
    quotas = Quotas(ledger, clock=lambda: now)
    key = ProxyKey("k", b"", limits=Limits(requests_per_minute=2))
    first = await quotas.charge(key, 5)
    assert (first.counted, first.refusal) == (True, None)
    assert first.headers["x-compaction-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-compaction-ratelimit-reset-requests"] == "30s"
    second = await quotas.charge(key, 5)
    assert second.headers["x-compaction-ratelimit-remaining-requests"] == "0"
    refused = await quotas.charge(key, 5)
    assert not refused.counted and refused.headers == {}
    assert refused.refusal is not None and refused.refusal.status == 429
    assert refused.refusal.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.refusal.headers["retry-after"] == "30"
    assert quotas.rejected == 1
    unlimited = await quotas.charge(ProxyKey("free", b""), 5)
    assert (unlimited.counted, unlimited.headers, unlimited.refusal) == (False, {}, None)
    after = await ledger.charge("k", LimitArgs.of(key.limits), 0, windows_at(now))
    assert (after.denied, after.key.requests) == ("requests", 2)


class _HeldLedger:
    """A ledger that answers over the network: each charge waits until the test answers it
    (`answer`), as a Redis reply on its way."""

    name, errors, remote = "held", 0, True

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.answers: asyncio.Queue[Any] = asyncio.Queue()

    async def charge(self, *args: Any) -> Any:
        self.asked.set()
        answer = await self.answers.get()
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.mark.parametrize(
    ("answer", "counted"),
    [("allowed", True), ("refused", False), ("unavailable", False)],
)
async def test_a_remote_charge_given_up_on_its_way_settles_and_says_how(
    answer: str, counted: bool
) -> None:
    """The request is given up (its task cancelled) while the ledger's answer is on its
    way: the charge goes on, and `given_up` is told whether it counted the request, once."""
    from proxy.auth.keys import Limits, ProxyKey
    from proxy.quota import LedgerUnavailable, Quotas
    from proxy.quota.ledger import Charge, Counters

    ledger = _HeldLedger()
    quotas = Quotas(ledger)  # type: ignore[arg-type]
    key = ProxyKey("k", b"", limits=Limits(requests_per_minute=1))
    told: list[bool] = []
    settled = asyncio.Event()

    def given_up(counted: bool) -> None:
        told.append(counted)
        settled.set()

    waiting = asyncio.create_task(quotas.charge(key, 0, given_up=given_up))
    await ledger.asked.wait()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert told == []  # not decided yet
    reply = {
        "allowed": Charge(None, Counters(requests=1)),
        "refused": Charge("requests", Counters(requests=1)),
        "unavailable": LedgerUnavailable("down"),
    }[answer]
    ledger.answers.put_nowait(reply)
    await settled.wait()
    assert told == [counted]
    # Answered in time, the same charge is the caller's verdict, and nobody else is told.
    ledger.answers.put_nowait(Charge(None, Counters(requests=1)))
    verdict = await quotas.charge(key, 0, given_up=given_up)
    assert verdict.counted and told == [counted]
