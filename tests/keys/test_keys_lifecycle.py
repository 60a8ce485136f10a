"""The key lifecycle API: keys made, rotated and revoked through /admin/keys, seen by every
replica sharing the store within a second, surviving restarts, audited without secrets."""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import respx

from tests.keys.conftest import KEY_A, App, bearer, chat, key_entry, keyed_settings
from tests.upstream_fakes import REPLY

pytestmark = pytest.mark.usefixtures("upstream")

ADMIN_ENV = "TEST_LIFECYCLE_ADMIN_TOKEN"
ADMIN = {"authorization": "Bearer admin-lifecycle-token", "x-admin-actor": "alice@laptop"}
# Replicas poll the key store twice a second: a change is everywhere within this.
WITHIN_S = 1.0


@pytest.fixture(autouse=True)
def admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_ENV, "admin-lifecycle-token")


def api_settings(quota: dict[str, Any] | None = None, **auth: Any) -> Any:
    return keyed_settings(
        auth={"api_keys": True, **auth},
        admin={"token_env": ADMIN_ENV},
        **({"quota": quota} if quota else {}),
    )


def redis_quota(prefix: str) -> dict[str, Any]:
    return {"backend": "redis", "key_prefix": prefix, "socket_timeout_s": 5.0}


async def status(app: App, secret: str) -> int:
    reply = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(secret))
    return reply.status_code


async def within(seconds: float, check: Callable[[], Awaitable[bool]]) -> float:
    """Poll `check` until it holds; how long that took (fails past `seconds`)."""
    start = time.monotonic()
    while not await check():
        elapsed = time.monotonic() - start
        assert elapsed < seconds, f"not within {seconds} s"
        await _tick()
    return time.monotonic() - start


async def _tick() -> None:
    import asyncio

    await asyncio.sleep(0.01)


async def test_create_rotate_revoke_across_two_replicas_sharing_redis(
    make_app: Any, upstream: respx.MockRouter, redis_prefix: str
) -> None:
    upstream.post("/chat/completions").respond(json=REPLY)
    settings = api_settings(redis_quota(redis_prefix))
    one, two = await make_app(settings), await make_app(settings)
    answers: list[str] = []

    async def admin(app: App, method: str, path: str, body: Any = None) -> Any:
        reply = await app.client.request(method, path, json=body, headers=ADMIN)
        answers.append(reply.text)
        assert reply.status_code < 300, reply.text
        return reply.json()

    made = await admin(one, "POST", "/admin/keys", {"id": "team-a", "team": "platform"})
    first = made["secret"]
    assert first.startswith("sk-cp-") and made["key"]["team"] == "platform"
    assert await status(one, first) == 200  # the replica that made it: at once
    await within(WITHIN_S, lambda: _is(two, first, 200))

    rotated = await admin(two, "POST", "/admin/keys/team-a/rotate", {"old_expires_in_s": 3600})
    second = rotated["secret"]
    await within(WITHIN_S, lambda: _is(one, second, 200))
    for app in (one, two):  # old and new overlap during the rotation
        assert await status(app, first) == 200
        assert await status(app, second) == 200

    old_id = made["secret_id"]
    await admin(one, "DELETE", f"/admin/keys/team-a/secrets/{old_id}")
    assert await status(one, first) == 401
    await within(WITHIN_S, lambda: _is(two, first, 401))
    assert await status(two, second) == 200

    revoked = await admin(two, "DELETE", "/admin/keys/team-a")
    assert revoked["revoked"] is True and revoked["in_force"] is False
    assert await status(two, second) == 401
    took = await within(WITHIN_S, lambda: _is(one, second, 401))
    assert took < WITHIN_S

    listed = await admin(one, "GET", "/admin/keys")
    [entry] = [key for key in listed["data"] if key["id"] == "team-a"]
    assert entry["revoked"] and {s["id"] for s in entry["secrets"]} == {
        old_id,
        rotated["secret_id"],
    }
    audit = await admin(one, "GET", "/admin/audit")
    actions = [item["action"] for item in audit["data"]]
    assert actions == ["key.revoke", "key.revoke_secret", "key.rotate", "key.create"]
    assert {item["actor"] for item in audit["data"]} == {"alice@laptop"}
    assert all(item["key_id"] == "team-a" and item["time"].endswith("Z") for item in audit["data"])
    # A secret is in the answer that made it, and nowhere else: not in any other answer,
    # the audit trail or the store.
    for secret in (first, second):
        assert sum(secret in text for text in answers) == 1
    stored = await one.state.gate.source.store.client.hgetall(
        one.state.gate.source.store.records_key
    )
    dump = json.dumps({k.decode(): v.decode() for k, v in stored.items()})
    assert first not in dump and second not in dump and "sha256" in dump

    # A new replica (a restart) starts with the store's keys: revoked stays revoked.
    three = await make_app(settings)
    assert await status(three, second) == 401
    assert (await three.client.get("/admin/keys/team-a", headers=ADMIN)).json()["revoked"]


async def _is(app: App, secret: str, expected: int) -> bool:
    return await status(app, secret) == expected


async def test_an_old_secret_expires_when_its_rotation_says(
    make_app: Any, upstream: respx.MockRouter, tmp_path: Path
) -> None:
    upstream.post("/chat/completions").respond(json=REPLY)
    app = await make_app(api_settings(api_keys_file=str(tmp_path / "keys.json")))
    made = (await app.client.post("/admin/keys", json={"id": "k"}, headers=ADMIN)).json()
    reply = await app.client.post(
        "/admin/keys/k/rotate", json={"old_expires_in_s": 60}, headers=ADMIN
    )
    new = reply.json()["secret"]
    source = app.state.gate.source
    assert await status(app, made["secret"]) == 200  # the caller is kept from here on
    source.wall = lambda: time.time() + 61  # a minute later
    refused = await app.client.post(
        "/v1/chat/completions", json=chat(), headers=bearer(made["secret"])
    )
    assert refused.status_code == 401
    assert "expired" in refused.json()["error"]["message"]
    assert await status(app, new) == 200


async def test_file_store_survives_a_restart_and_holds_hashes_only(
    make_app: Any, upstream: respx.MockRouter, tmp_path: Path
) -> None:
    upstream.post("/chat/completions").respond(json=REPLY)
    path = tmp_path / "state" / "keys.json"
    settings = api_settings(api_keys_file=str(path))
    app = await make_app(settings)
    body = {"id": "team-b", "requests_per_minute": 5, "allowed_models": ["gpt-4o-mini*"]}
    made = await app.client.post("/admin/keys", json=body, headers=ADMIN)
    assert made.status_code == 201, made.text
    secret = made.json()["secret"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text() + path.with_name("keys.json.audit.jsonl").read_text()
    assert secret not in text and secret[-20:] not in text
    restarted = await make_app(settings)
    assert await status(restarted, secret) == 200
    denied = await restarted.client.post(
        "/v1/chat/completions", json=chat("gpt-4o"), headers=bearer(secret)
    )
    assert denied.status_code == 403  # its policy came back too
    updated = await restarted.client.patch(
        "/admin/keys/team-b", json={"allowed_models": ["*"]}, headers=ADMIN
    )
    assert updated.json()["allowed_models"] == ["*"]
    assert updated.json()["requests_per_minute"] == 5  # the fields not sent are kept
    assert await status(restarted, secret) == 200


async def test_config_keys_are_not_the_apis_and_bad_bodies_are_400(
    make_app: Any, upstream: respx.MockRouter, tmp_path: Path
) -> None:
    upstream.post("/chat/completions").respond(json=REPLY)
    settings = keyed_settings(
        key_entry("team-a", KEY_A),
        auth={"api_keys": True, "api_keys_file": str(tmp_path / "k.json")},
        admin={"token_env": ADMIN_ENV},
    )
    app = await make_app(settings)
    taken = await app.client.post("/admin/keys", json={"id": "team-a"}, headers=ADMIN)
    assert (taken.status_code, taken.json()["error"]["code"]) == (409, "key_exists")
    patched = await app.client.patch("/admin/keys/team-a", json={"team": "x"}, headers=ADMIN)
    assert (patched.status_code, patched.json()["error"]["code"]) == (409, "key_not_managed")
    listed = (await app.client.get("/admin/keys", headers=ADMIN)).json()["data"]
    assert [(k["id"], k["origin"]) for k in listed] == [("team-a", "config")]
    for body, param in (
        ({"requests_per_minute": -1}, "requests_per_minute"),
        ({"colour": "red"}, "colour"),
        ({"id": "no spaces"}, "id"),
    ):
        bad = await app.client.post("/admin/keys", json=body, headers=ADMIN)
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == param
    missing = await app.client.post("/admin/keys/nobody/rotate", json={}, headers=ADMIN)
    assert missing.status_code == 404
    unset = await app.client.post(
        "/admin/keys", json={"upstream_api_key_env": "NOT_SET_ANYWHERE_X"}, headers=ADMIN
    )
    assert unset.status_code == 400 and "NOT_SET_ANYWHERE_X" in unset.text
    assert (await app.client.post("/admin/keys", json={})).status_code == 401


async def test_without_api_keys_the_api_says_how_to_turn_it_on(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    app = await make_app(keyed_settings(key_entry("a", KEY_A), admin={"token_env": ADMIN_ENV}))
    reply = await app.client.post("/admin/keys", json={}, headers=ADMIN)
    assert reply.status_code == 409
    assert "auth.api_keys = true" in reply.json()["error"]["message"]


async def test_api_keys_on_and_none_made_yet_every_request_needs_one(
    make_app: Any, upstream: respx.MockRouter, tmp_path: Path
) -> None:
    route = upstream.post("/chat/completions").respond(json=REPLY)
    app = await make_app(api_settings(api_keys_file=str(tmp_path / "k.json")))
    assert (await app.client.post("/v1/chat/completions", json=chat())).status_code == 401
    made = await app.client.post("/admin/keys", json={}, headers=ADMIN)
    assert made.json()["key"]["id"].startswith("key_")
    await app.client.delete(f"/admin/keys/{made.json()['key']['id']}", headers=ADMIN)
    # The last key revoked: the proxy stays closed, it never opens up.
    assert (await app.client.post("/v1/chat/completions", json=chat())).status_code == 401
    assert not route.called


async def test_a_key_store_not_answered_yet_is_503_for_unknown_keys_not_401(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    from tests.keys.conftest import free_port

    upstream.post("/chat/completions").respond(json=REPLY)
    dead = {"backend": "redis", "redis_url": f"redis://127.0.0.1:{free_port()}/0"}
    settings = keyed_settings(
        key_entry("team-a", KEY_A),
        auth={"api_keys": True},
        admin={"token_env": ADMIN_ENV},
        quota={**dead, "key_prefix": "p:"},
    )
    app = await make_app(settings)
    unknown = await app.client.post(
        "/v1/chat/completions", json=chat(), headers=bearer("sk-cp-maybe")
    )
    assert unknown.status_code == 503
    assert unknown.json()["error"]["code"] == "keys_unavailable"
    assert unknown.headers["retry-after"] == "1"
    assert await status(app, KEY_A) == 200  # configured keys do not wait for the store
    metrics = (await app.client.get("/metrics")).text
    assert 'compaction_proxy_keys_reload_failures_total{source="store"}' in metrics
