"""What operators see per key and team: metrics labels, spend, /metrics behind a token,
usage by team and end user, the audit line; and no proxy key in a forwarded query string."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
import respx
from prometheus_client.parser import text_string_to_metric_families

from proxy.auth.query import forwarded_query
from proxy.quota.windows import day_of
from tests.keys.conftest import KEY_A, KEY_B, bearer, chat, key_entry, keyed_settings
from tests.upstream_fakes import REPLY

pytestmark = pytest.mark.usefixtures("upstream")

ADMIN_ENV = "TEST_OBSERVABILITY_ADMIN"
ADMIN = {"authorization": "Bearer obs-admin"}


def samples(text: str, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {
        frozenset(sample.labels.items()): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


async def test_request_token_spend_and_rejection_metrics_carry_key_and_team(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    usage = {"prompt_tokens": 1000, "completion_tokens": 500, "total_tokens": 1500}
    upstream.post("/chat/completions").respond(json={**REPLY, "usage": usage})
    app = await make_app(
        keyed_settings(
            key_entry("a", KEY_A, team="platform"),
            key_entry("b", KEY_B, requests_per_minute=1),
        )
    )
    app.state.quotas.clock = lambda: 1_800_000_010.0
    for key in (KEY_A, KEY_A, KEY_B, KEY_B):
        await app.client.post("/v1/chat/completions", json=chat("gpt-4o-mini"), headers=bearer(key))
    await app.state.meter.join()  # (token and spend series: at each flush of the usage batch)
    text = (await app.client.get("/metrics")).text
    requests = samples(text, "compaction_proxy_requests_total")
    chat_route = {("route", "/v1/chat/completions"), ("model", "gpt-4o-mini")}

    def count(**labels: str) -> float:
        wanted = chat_route | set(labels.items())
        return sum(v for found, v in requests.items() if wanted <= found)

    assert count(key_id="a", team="platform", status="200") == 2
    assert count(key_id="b", team="", status="200") == 1
    assert count(key_id="b", team="", status="429") == 1
    rejected = samples(text, "compaction_proxy_quota_rejected_total")
    assert rejected == {
        frozenset({("key_id", "b"), ("team", ""), ("reason", "requests_per_minute")}): 1.0
    }
    spend = samples(text, "compaction_proxy_spend_usd_total")
    price = (1000 * 0.15 + 500 * 0.60) / 1e6  # gpt-4o-mini's list price
    a = frozenset({("key_id", "a"), ("team", "platform"), ("model", "gpt-4o-mini")})
    assert spend[a] == pytest.approx(2 * price)
    tokens = samples(text, "compaction_proxy_usage_tokens_total")
    assert tokens[a | {("kind", "completion")}] == 1000
    assert tokens[a | {("kind", "prompt_forwarded")}] == 2000


async def test_key_and_team_labels_are_bounded(
    make_app: Any, upstream: respx.MockRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    from proxy import metrics as metrics_module

    monkeypatch.setattr(metrics_module, "MAX_KEYS", 1)
    upstream.post("/chat/completions").respond(json=REPLY)
    app = await make_app(keyed_settings(key_entry("a", KEY_A), key_entry("b", KEY_B)))
    for key in (KEY_A, KEY_B):
        await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(key))
    requests = samples((await app.client.get("/metrics")).text, "compaction_proxy_requests_total")
    assert {dict(labels)["key_id"] for labels in requests} == {"a", "other"}


async def test_metrics_behind_a_token(
    make_app: Any, upstream: respx.MockRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    from proxy.app import create_app
    from proxy.settings import ConfigError

    monkeypatch.setenv("TEST_METRICS_TOKEN", "scrape-me")
    app = await make_app(keyed_settings(server={"metrics_token_env": "TEST_METRICS_TOKEN"}))
    refused = await app.client.get("/metrics")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    wrong = await app.client.get("/metrics", headers=bearer("nope"))
    assert wrong.status_code == 401
    ok = await app.client.get("/metrics", headers=bearer("scrape-me"))
    assert ok.status_code == 200 and "compaction_proxy_requests_total" in ok.text
    monkeypatch.delenv("TEST_METRICS_TOKEN")
    with pytest.raises(ConfigError, match="TEST_METRICS_TOKEN is not set"):
        create_app(keyed_settings(server={"metrics_token_env": "TEST_METRICS_TOKEN"}))


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_usage_by_team_model_day_and_end_user(
    make_app: Any,
    upstream: respx.MockRouter,
    monkeypatch: pytest.MonkeyPatch,
    redis_prefix: str,
    backend: str,
) -> None:
    monkeypatch.setenv(ADMIN_ENV, "obs-admin")
    upstream.post("/chat/completions").respond(json=REPLY)
    quota = {"backend": "redis", "key_prefix": redis_prefix} if backend == "redis" else {}
    app = await make_app(
        keyed_settings(
            key_entry("a", KEY_A, team="platform"),
            key_entry("b", KEY_B, team="platform"),
            key_entry("c", "sk-proxy-c-000000000", team="search"),
            admin={"token_env": ADMIN_ENV},
            quota=quota,
        )
    )
    sends = [(KEY_A, "alice"), (KEY_A, "alice"), (KEY_B, "bob"), ("sk-proxy-c-000000000", None)]
    for key, user in sends:
        body = chat() if user is None else chat(user=user)
        reply = await app.client.post("/v1/chat/completions", json=body, headers=bearer(key))
        assert reply.status_code == 200
    await app.state.meter.join()

    async def usage(**params: str) -> list[dict[str, Any]]:
        reply = await app.client.get("/admin/usage", params=params, headers=ADMIN)
        assert reply.status_code == 200, reply.text
        return list(reply.json()["data"])

    by_team = await usage(group_by="team")
    assert [(row["team"], row["requests"]) for row in by_team] == [("platform", 3), ("search", 1)]
    by_user = await usage(group_by="user,key")
    assert {(row["user"], row["key"], row["requests"]) for row in by_user} == {
        ("alice", "a", 2),
        ("bob", "b", 1),
    }
    assert all(row["prompt_tokens_forwarded"] == 10 * row["requests"] for row in by_user)
    today = day_of(app.state.meter.clock())
    by_day = await usage(team="platform", group_by="day,model")
    assert by_day == [
        {**by_day[0], "day": today, "model": "gpt-4o-mini", "requests": 3},
    ]
    bad = await app.client.get("/admin/usage", params={"group_by": "user,model"}, headers=ADMIN)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "group_by"


async def test_every_admin_change_is_one_audit_line_without_secrets(
    make_app: Any,
    upstream: respx.MockRouter,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Any,
) -> None:
    monkeypatch.setenv(ADMIN_ENV, "obs-admin")
    app = await make_app(
        keyed_settings(
            auth={"api_keys": True, "api_keys_file": str(tmp_path / "k.json")},
            admin={"token_env": ADMIN_ENV},
        )
    )
    with caplog.at_level(logging.INFO, logger="proxy.admin.audit"):
        made = await app.client.post(
            "/admin/keys", json={"id": "k", "spend_usd_per_day": 2.5}, headers=ADMIN
        )
        rotated = await app.client.post("/admin/keys/k/rotate", json={}, headers=ADMIN)
        team = await app.client.put(
            "/admin/teams/platform", json={"requests_per_minute": 9}, headers=ADMIN
        )
    assert team.json()["requests_per_minute"] == 9 and team.json()["origin"] == "api"
    lines = [r for r in caplog.records if r.name == "proxy.admin.audit"]
    assert [r.audit_action for r in lines] == ["key.create", "key.rotate", "team.put"]
    assert lines[0].audit_changes == {"spend_usd_per_day": 2.5}
    assert lines[0].audit_actor == "admin" and lines[0].audit_client
    for secret in (made.json()["secret"], rotated.json()["secret"]):
        assert secret not in caplog.text


def test_credential_parameters_are_dropped_from_forwarded_queries() -> None:
    assert forwarded_query(b"") == b""
    assert forwarded_query(b"api-version=2024-06-01&limit=5") == b"api-version=2024-06-01&limit=5"
    assert forwarded_query(b"api-key=sk-x&limit=5") == b"limit=5"
    assert forwarded_query(b"limit=5&KEY=sk-x&after=a%20b") == b"limit=5&after=a%20b"
    assert forwarded_query(b"api%2Dkey=sk-x&monkey=1&key_id=3") == b"monkey=1&key_id=3"
    assert forwarded_query(b"access_token=t&token=u&api_key=v") == b""


async def test_a_proxy_key_in_the_query_string_never_goes_upstream(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    route = upstream.get("/models").respond(json={"data": []})
    chat_route = upstream.post("/chat/completions").respond(json=REPLY)
    app = await make_app(keyed_settings(key_entry("a", KEY_A)))
    listed = await app.client.get(
        f"/v1/models?api-key={KEY_A}&limit=2&key={KEY_A}", headers=bearer(KEY_A)
    )
    assert listed.status_code == 200
    sent: httpx.Request = route.calls.last.request
    assert KEY_A not in str(sent.url) and sent.url.query == b"limit=2"
    await app.client.post(
        f"/v1/chat/completions?api-key={KEY_A}", json=chat(), headers=bearer(KEY_A)
    )
    assert KEY_A not in str(chat_route.calls.last.request.url)


async def test_without_keys_the_query_string_goes_up_as_sent(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    from tests.conftest import make_settings

    route = upstream.get("/models").respond(json={"data": []})
    app = await make_app(make_settings())
    await app.client.get("/v1/models?key=abc&limit=2")
    assert route.calls.last.request.url.query == b"key=abc&limit=2"
