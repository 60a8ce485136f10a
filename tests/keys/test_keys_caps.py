"""Spend caps that hold: each request reserves its price before it goes upstream and settles
with the upstream's usage, so a cap is passed by at most one request's price, however many
requests are in flight and on however many replicas; team quotas span their keys."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
import respx

from proxy.quota.windows import day_of
from tests.conftest import until
from tests.keys.conftest import KEY_A, KEY_B, App, bearer, key_entry, keyed_settings

pytestmark = pytest.mark.usefixtures("upstream")

MODEL = "capped-model"
PRICE = {MODEL: {"input": 10.0, "output": 10.0}}  # $10 per 1M tokens: $0.00001 a token
# Each reply: 10 prompt + 100 completion tokens = $0.0011. Each request asks for at most 200
# completion tokens, so its reservation (its prompt as counted, ~8 tokens, + 200) bounds it.
USAGE = {"prompt_tokens": 10, "completion_tokens": 100, "total_tokens": 110}
COST = 110 * 10.0 / 1e6
CAP = 0.01


def body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 200}


def reply() -> dict[str, Any]:
    return {
        "id": "chatcmpl-cap",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
        "usage": USAGE,
    }


def capped(*keys: dict[str, Any], **sections: Any) -> Any:
    return keyed_settings(*keys, pricing=PRICE, **sections)


def redis_quota(prefix: str) -> dict[str, Any]:
    return {"backend": "redis", "key_prefix": prefix, "socket_timeout_s": 5.0}


async def spent(app: App, key: str = "team-a") -> float:
    """What the usage ledger says the key spent (every replica's, once written)."""
    today = day_of(app.state.meter.clock())
    rows = await app.state.meter.ledger.usage([key], today, today)
    return sum(row.counts.cost_nano_usd for row in rows) / 1e9


class Gated:
    """An upstream that holds every request until released: all admitted requests are in
    flight at once, the worst case for a cap."""

    def __init__(self) -> None:
        self.arrived = 0
        self.release = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.arrived += 1
        await self.release.wait()
        return httpx.Response(200, json=reply())


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_twenty_concurrent_requests_on_two_replicas_stay_under_the_cap(
    make_app: Any, upstream: respx.MockRouter, redis_prefix: str, backend: str
) -> None:
    gated = Gated()
    upstream.post("/chat/completions").mock(side_effect=gated)
    quota = redis_quota(redis_prefix) if backend == "redis" else {}
    settings = capped(key_entry("team-a", KEY_A, spend_usd_per_day=CAP), quota=quota)
    replicas = [await make_app(settings), await make_app(settings)]
    answered: list[int] = []

    async def send(i: int) -> int:
        client = replicas[i % 2].client
        response = await client.post("/v1/chat/completions", json=body(), headers=bearer(KEY_A))
        answered.append(response.status_code)
        return response.status_code

    tasks = [asyncio.create_task(send(i)) for i in range(20)]
    # Every request either reached the upstream (admitted, held there) or was refused.
    await until(lambda: gated.arrived + len(answered) == 20)
    gated.release.set()
    codes = await asyncio.gather(*tasks)
    for replica in replicas:
        await replica.state.meter.join()
    admitted = codes.count(200)
    assert codes.count(429) == 20 - admitted
    total = await spent(replicas[0]) if backend == "redis" else sum(
        [await spent(replica) for replica in replicas]
    )  # fmt: skip
    per_instance = 1 if backend == "redis" else 2  # memory: each replica its own ledger
    assert total <= CAP + per_instance * COST + 1e-12
    assert admitted >= 2  # not refusing everything: reservations, not a lock
    if backend == "redis":  # every reservation settled: the counter is what was spent
        ledger = replicas[0].state.quotas.ledger
        counters, _ = await ledger.peek("team-a", None, _windows(replicas[0]))
        assert counters.spend_day_nano == round(total * 1e9)


def _windows(app: App) -> Any:
    from proxy.quota.windows import windows_at

    return windows_at(app.state.quotas.clock())


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_twenty_back_to_back_requests_on_two_replicas_pass_the_cap_by_one_at_most(
    make_app: Any, upstream: respx.MockRouter, redis_prefix: str, backend: str
) -> None:
    upstream.post("/chat/completions").respond(json=reply())
    quota = redis_quota(redis_prefix) if backend == "redis" else {}
    settings = capped(key_entry("team-a", KEY_A, spend_usd_per_day=CAP), quota=quota)
    replicas = [await make_app(settings), await make_app(settings)]
    codes = []
    for i in range(20):
        client = replicas[i % 2].client
        response = await client.post("/v1/chat/completions", json=body(), headers=bearer(KEY_A))
        codes.append(response.status_code)
    for replica in replicas:
        await replica.state.meter.join()
    if backend == "redis":
        total = await spent(replicas[0])
        assert total <= CAP + COST + 1e-12
        # Settled as they end, so the cap is used, not refused early by estimates: 9 fit,
        # the 10th crosses it (spent + reserved was under the cap when it came).
        assert codes.count(200) >= 9, codes
        assert codes[-1] == 429
    else:  # each replica keeps its own ledger: each holds the cap on its own
        for replica in replicas:
            assert await spent(replica) <= CAP + COST + 1e-12
        assert codes.count(200) == 20  # 10 each: the 10th crosses its replica's cap


async def test_the_issues_numbers_a_cent_cap_and_back_to_back_requests(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    """With a $0.01 daily cap, eight back-to-back requests of $0.0048 used to all pass
    ($0.0384, usage written in batches); now the cap is passed by one request at most."""
    usage = {"prompt_tokens": 160, "completion_tokens": 320, "total_tokens": 480}
    upstream.post("/chat/completions").respond(json={**reply(), "usage": usage})
    app = await make_app(capped(key_entry("team-a", KEY_A, spend_usd_per_day=0.01)))
    codes = [
        (await app.client.post("/v1/chat/completions", json=body(), headers=bearer(KEY_A)))
        for _ in range(8)
    ]
    await app.state.meter.join()
    assert await spent(app) <= 0.01 + 0.0048 + 1e-12
    assert [r.status_code for r in codes].count(200) == 3  # $0.0048, $0.0096, then over
    refusal = codes[-1].json()["error"]
    assert refusal["code"] == "insufficient_quota"
    assert "daily cap of $0.01 " in refusal["message"]


async def test_a_refusal_shows_the_cap_with_its_real_precision(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    upstream.post("/chat/completions").respond(json=reply())
    app = await make_app(capped(key_entry("team-a", KEY_A, spend_usd_per_day=0.001)))
    first = await app.client.post("/v1/chat/completions", json=body(), headers=bearer(KEY_A))
    assert first.status_code == 200
    second = await app.client.post("/v1/chat/completions", json=body(), headers=bearer(KEY_A))
    assert second.status_code == 429
    assert "has spent $0.0011 of its daily cap of $0.001 " in second.json()["error"]["message"]


async def test_a_stream_and_a_refused_upstream_settle_their_reservations(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    """The counter ends at what was billed: a stream's usage event, and nothing for an
    upstream that refused the request (its reservation given back)."""
    events = (
        b'data: {"choices":[{"delta":{"content":"ok"}}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":100,'
        b'"total_tokens":110}}\n\n'
        b"data: [DONE]\n\n"
    )
    route = upstream.post("/chat/completions")
    route.side_effect = [
        httpx.Response(200, content=events, headers={"content-type": "text/event-stream"}),
        httpx.Response(500, json={"error": {"message": "boom"}}),
    ]
    app = await make_app(capped(key_entry("team-a", KEY_A, spend_usd_per_day=CAP)))
    streamed = await app.client.post(
        "/v1/chat/completions", json={**body(), "stream": True}, headers=bearer(KEY_A)
    )
    assert streamed.status_code == 200 and b'"usage"' not in streamed.content
    failed = await app.client.post("/v1/chat/completions", json=body(), headers=bearer(KEY_A))
    assert failed.status_code == 500
    await app.state.meter.join()
    counters, _ = await app.state.quotas.ledger.peek("team-a", None, _windows(app))
    assert counters.spend_day_nano == round(COST * 1e9) == round(await spent(app) * 1e9)


async def test_team_quotas_span_the_teams_keys(
    make_app: Any, upstream: respx.MockRouter, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    upstream.post("/chat/completions").respond(json=reply())
    settings = capped(
        key_entry("a", KEY_A, team="platform"),
        key_entry("b", KEY_B, team="platform", requests_per_minute=100),
        auth={"teams": {"platform": {"requests_per_minute": 3, "spend_usd_per_day": 1.0}}},
        quota=redis_quota(redis_prefix),
    )
    one, two = await make_app(settings), await make_app(settings)
    for app in (one, two):
        app.state.quotas.clock = lambda: 1_800_000_010.0  # no minute turns meanwhile
    codes = []
    with caplog.at_level(logging.INFO, logger="proxy.access"):
        for app, key in ((one, KEY_A), (two, KEY_B), (one, KEY_B), (two, KEY_A)):
            reply_ = await app.client.post("/v1/chat/completions", json=body(), headers=bearer(key))
            codes.append(reply_)
    assert [r.status_code for r in codes] == [200, 200, 200, 429]
    refusal = codes[-1]
    error = refusal.json()["error"]
    assert error["code"] == "rate_limit_exceeded"
    assert "team 'platform' (key 'a')" in error["message"] and "Limit 3, Used 3" in error["message"]
    assert refusal.headers["x-ratelimit-limit-requests"] == "3"
    # A key without its own request limit shows its team's on replies.
    assert codes[0].headers["x-compaction-ratelimit-limit-requests"] == "3"
    assert codes[1].headers["x-compaction-ratelimit-limit-requests"] == "100"
    [line] = [r for r in caplog.records if getattr(r, "status", None) == 429]
    assert (line.key_id, line.team, line.limit) == ("a", "platform", "team_requests_per_minute")
    metrics = (await two.client.get("/metrics")).text
    assert (
        'compaction_proxy_quota_rejected_total{key_id="a",reason="team_requests_per_minute",'
        'team="platform"} 1.0'
    ) in metrics
    for app in (one, two):
        await app.state.meter.join()
    by_team = await two.client.get(
        "/admin/usage", params={"group_by": "team"}, headers={"authorization": "Bearer x"}
    )
    assert by_team.status_code == 401  # (the admin API needs its token)
    today = day_of(one.state.meter.clock())
    rows = await one.state.meter.ledger.usage(None, today, today)
    assert {(row.key, row.team) for row in rows} == {("a", "platform"), ("b", "platform")}
    assert sum(row.counts.requests for row in rows) == 3


async def test_team_spend_cap_holds_across_keys_and_replicas_under_concurrency(
    make_app: Any, upstream: respx.MockRouter, redis_prefix: str
) -> None:
    gated = Gated()
    upstream.post("/chat/completions").mock(side_effect=gated)
    settings = capped(
        key_entry("a", KEY_A, team="platform"),
        key_entry("b", KEY_B, team="platform"),
        auth={"teams": {"platform": {"spend_usd_per_day": CAP}}},
        quota=redis_quota(redis_prefix),
    )
    replicas = [await make_app(settings), await make_app(settings)]
    answered: list[int] = []

    async def send(i: int) -> int:
        key = (KEY_A, KEY_B)[(i // 2) % 2]
        response = await replicas[i % 2].client.post(
            "/v1/chat/completions", json=body(), headers=bearer(key)
        )
        answered.append(response.status_code)
        return response.status_code

    tasks = [asyncio.create_task(send(i)) for i in range(20)]
    await until(lambda: gated.arrived + len(answered) == 20)
    gated.release.set()
    codes = await asyncio.gather(*tasks)
    for replica in replicas:
        await replica.state.meter.join()
    total = await spent(replicas[0], "a") + await spent(replicas[0], "b")
    assert total <= CAP + COST + 1e-12
    assert codes.count(200) >= 2
    _, team = await replicas[0].state.quotas.ledger.peek("a", "platform", _windows(replicas[0]))
    assert team.spend_day_nano == round(total * 1e9)


async def test_a_teams_keys_and_counters_share_one_slot_on_a_cluster(
    make_app: Any, upstream: respx.MockRouter, redis_cluster: list[str]
) -> None:
    import os

    upstream.post("/chat/completions").respond(json=reply())
    quota = {**redis_quota(f"test-teams-{os.urandom(4).hex()}:"), "redis_url": redis_cluster}
    settings = capped(
        key_entry("a", KEY_A, team="platform", spend_usd_per_day=1.0),
        key_entry("b", KEY_B, team="platform"),
        auth={"teams": {"platform": {"requests_per_minute": 3}}},
        quota=quota,
    )
    one, two = await make_app(settings), await make_app(settings)
    clock = 1_800_000_010.0
    for app in (one, two):
        app.state.quotas.clock = app.state.meter.clock = lambda: clock
    codes = []
    for app, key in ((one, KEY_A), (two, KEY_B), (one, KEY_B), (two, KEY_A)):
        response = await app.client.post("/v1/chat/completions", json=body(), headers=bearer(key))
        codes.append(response.status_code)
    assert codes == [200, 200, 200, 429]
    for app in (one, two):
        await app.state.meter.join()
    ledger = one.state.quotas.ledger
    w = _windows(one)
    slots = {
        await ledger.client.cluster_keyslot(name)
        for name in (
            ledger.holder_key("a", "platform", "rpm", w.minute),
            ledger.holder_key("a", "platform", "spend", w.day),
            ledger.holder_key("b", "platform", "usage", w.day),
            ledger.team_key("platform", "rpm", w.minute),
            ledger.team_key("platform", "spend", w.month),
        )
    }
    assert len(slots) == 1
    rows = await ledger.usage(None, w.day, w.day)
    assert {(row.key, row.team, row.counts.requests) for row in rows} == {
        ("a", "platform", 1),
        ("b", "platform", 2),
    }
    _, team = await ledger.peek("a", "platform", w)
    assert team.requests == 3 and team.spend_day_nano == round(3 * COST * 1e9)


async def test_a_reservation_of_a_request_given_up_on_its_charges_way_is_given_back() -> None:
    """The client leaves while its charge is on its way to Redis: the charge still lands
    (and counts the request), and its reservation is released at once, not left counted."""
    from proxy.auth.keys import Limits, ProxyKey
    from proxy.quota import Quotas
    from proxy.quota.ledger import Charge, Counters, Reservation

    class Held:
        name, errors, remote = "held", 0, True

        def __init__(self) -> None:
            self.asked = asyncio.Event()
            self.answer: asyncio.Future[Charge] = asyncio.get_running_loop().create_future()

        async def charge(self, *args: Any, **kwargs: Any) -> Charge:
            self.asked.set()
            return await self.answer

    ledger = Held()
    released: list[Reservation] = []
    told: list[bool] = []
    quotas = Quotas(ledger, release=released.append)  # type: ignore[arg-type]
    key = ProxyKey("k", b"", limits=Limits(spend_usd_per_day=1.0))
    waiting = asyncio.create_task(quotas.charge(key, 10, reserve_nano=5_000, given_up=told.append))
    await ledger.asked.wait()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    ledger.answer.set_result(Charge(None, Counters(requests=1)))
    await until(lambda: bool(told))
    assert told == [True]
    [reservation] = released
    assert (reservation.key_id, reservation.nano) == ("k", 5_000)
