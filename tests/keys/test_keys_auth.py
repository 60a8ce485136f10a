"""Proxy keys: who gets in, with which models, and which credential goes upstream."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx
from hypothesis import given
from hypothesis import strategies as st

from proxy.cli import main
from proxy.store import scope_for
from tests.conftest import UPSTREAM, make_settings, until
from tests.keys.conftest import (
    KEY_A,
    KEY_B,
    bearer,
    chat,
    history_chat,
    key_entry,
    keyed_settings,
    sha,
)
from tests.upstream_fakes import REPLY, FakeUpstream

pytestmark = pytest.mark.usefixtures("upstream")


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


async def test_missing_key_is_401_invalid_api_key_and_nothing_goes_upstream(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    route = upstream.post("/chat/completions").respond(json=REPLY)
    app = await make_app(keyed_settings(key_entry("team-a", KEY_A)))
    response = await app.client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 401
    error = error_of(response)
    assert error["code"] == "invalid_api_key"
    assert error["type"] == "invalid_request_error"
    assert "Missing API key" in error["message"]
    assert not route.called


async def test_unknown_key_is_401_on_chat_and_on_passthrough(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    models = upstream.get("/models").respond(json={"data": []})
    app = await make_app(keyed_settings(key_entry("team-a", KEY_A)))
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
        response = await app.client.request(
            method, path, json=chat() if method == "POST" else None, headers=bearer("sk-guess")
        )
        assert response.status_code == 401
        assert error_of(response)["code"] == "invalid_api_key"
        assert "Incorrect API key" in error_of(response)["message"]
    assert not models.called


async def test_known_key_in_bearer_or_api_key_header_gets_through(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    upstream.post("/chat/completions").respond(json=REPLY)
    app = await make_app(keyed_settings(key_entry("team-a", KEY_A)))
    for headers in (bearer(KEY_A), {"api-key": KEY_A}):
        response = await app.client.post("/v1/chat/completions", json=chat(), headers=headers)
        assert response.status_code == 200, response.text


async def test_model_outside_allowed_globs_is_403_model_not_allowed(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    route = upstream.post("/chat/completions").respond(json=REPLY)
    embeddings = upstream.post("/embeddings").respond(json={"data": []})
    app = await make_app(
        keyed_settings(key_entry("team-a", KEY_A, allowed_models=["gpt-4o-mini*"]))
    )
    ok = await app.client.post(
        "/v1/chat/completions", json=chat("gpt-4o-mini-2024-07-18"), headers=bearer(KEY_A)
    )
    assert ok.status_code == 200
    denied = await app.client.post(
        "/v1/chat/completions", json=chat("gpt-4o"), headers=bearer(KEY_A)
    )
    assert denied.status_code == 403
    error = error_of(denied)
    assert error["code"] == "model_not_allowed"
    assert error["param"] == "model"
    assert "'gpt-4o'" in error["message"]
    other_route = await app.client.post(
        "/v1/embeddings", json={"model": "text-embedding-3-large", "input": "x"},
        headers=bearer(KEY_A),
    )  # fmt: skip
    assert other_route.status_code == 403
    assert route.call_count == 1
    assert not embeddings.called


def credentials_of(request: httpx.Request) -> list[str]:
    return [
        v for k, v in request.headers.multi_items() if k.lower() in ("authorization", "api-key")
    ]


async def test_proxy_key_never_upstream_on_chat_passthrough_and_summarizer(
    make_app: Any, upstream: respx.MockRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEAM_B_UPSTREAM", "sk-upstream-team-b")
    fake = FakeUpstream().install(upstream)
    models = upstream.get("/models").respond(json={"data": []})
    settings = keyed_settings(
        key_entry("team-a", KEY_A),
        key_entry("team-b", KEY_B, upstream_api_key_env="TEAM_B_UPSTREAM"),
        upstream={"api_key": "sk-org-secret"},
    )
    app = await make_app(settings)
    long_chat = history_chat()
    expectations = [(KEY_A, "Bearer sk-org-secret"), (KEY_B, "Bearer sk-upstream-team-b")]
    for n, (key, expected) in enumerate(expectations, 1):
        headers = {**bearer(key), "x-compaction": "force", "api-key": key}
        reply = await app.client.post("/v1/chat/completions", json=long_chat, headers=headers)
        assert reply.status_code == 200, reply.text
        listed = await app.client.get("/v1/models", headers=bearer(key))
        assert listed.status_code == 200
        assert reply.headers["x-compaction-status"] == "compacted"
        assert len(fake.summary_requests) == n
        sent = [fake.forwarded_requests[-1], models.calls.last.request, fake.summary_requests[-1]]
        for request in sent:
            assert credentials_of(request) == [expected]
            assert key not in str(request.headers)


async def test_without_any_upstream_key_the_proxy_key_is_dropped_not_forwarded(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    route = upstream.post("/chat/completions").respond(json=REPLY)
    app = await make_app(keyed_settings(key_entry("team-a", KEY_A)))
    await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert credentials_of(route.calls.last.request) == []


async def test_without_keys_the_client_credential_is_forwarded_as_before(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    route = upstream.post("/chat/completions").respond(json=REPLY)
    app = await make_app(make_settings())
    response = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer("sk-x"))
    assert response.status_code == 200
    assert credentials_of(route.calls.last.request) == ["Bearer sk-x"]


async def test_key_env_reads_the_key_from_the_environment(
    make_app: Any, upstream: respx.MockRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    upstream.post("/chat/completions").respond(json=REPLY)
    monkeypatch.setenv("TEAM_A_KEY", KEY_A)
    app = await make_app(keyed_settings({"id": "team-a", "key_env": "TEAM_A_KEY"}))
    ok = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert ok.status_code == 200


def write_keys(path: Path, *entries: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"keys": list(entries)}))
    os.replace(tmp, path)  # atomic, as an operator's deploy tool would


async def test_keys_file_rotation_takes_effect_without_restart(
    make_app: Any, upstream: respx.MockRouter, tmp_path: Path
) -> None:
    upstream.post("/chat/completions").respond(json=REPLY)
    keys_file = tmp_path / "keys.json"
    write_keys(keys_file, key_entry("team-a", KEY_A))
    app = await make_app(
        make_settings(auth={"keys_file": str(keys_file), "reload_interval_s": 0.01})
    )

    async def status(key: str) -> int:
        reply = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(key))
        return reply.status_code

    assert await status(KEY_A) == 200
    assert await status(KEY_B) == 401
    write_keys(keys_file, key_entry("team-a", KEY_B))  # same id, new material
    codes: list[int] = []

    async def rotated() -> bool:
        codes.append(await status(KEY_B))
        await app.state.gate.source.wait_reloaded()
        return codes[-1] == 200

    async with asyncio.timeout(10):
        while not await rotated():  # noqa: ASYNC110 - each round sends a request
            await asyncio.sleep(0.02)
    assert await status(KEY_A) == 401


async def test_a_broken_keys_file_keeps_the_previous_keys(
    make_app: Any, upstream: respx.MockRouter, tmp_path: Path
) -> None:
    upstream.post("/chat/completions").respond(json=REPLY)
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(f'[[keys]]\nid = "team-a"\nkey_sha256 = "{sha(KEY_A)}"\n')
    app = await make_app(make_settings(auth={"keys_file": str(keys_file)}))
    keys_file.write_text("[[keys]]\nid = 'team-a'\nkey_sha256 = 'not-hex'\n")
    source = app.state.gate.source
    source.request_reload()
    await source.wait_reloaded()
    assert source.generation == 1
    ok = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert ok.status_code == 200


async def test_sighup_reloads_the_keys_file(
    make_app: Any, upstream: respx.MockRouter, tmp_path: Path
) -> None:
    from proxy.auth.keys_file import reload_on_sighup

    upstream.post("/chat/completions").respond(json=REPLY)
    keys_file = tmp_path / "keys.json"
    write_keys(keys_file, key_entry("team-a", KEY_A))
    app = await make_app(make_settings(auth={"keys_file": str(keys_file)}))
    source = app.state.gate.source
    reload_on_sighup(source)
    try:
        write_keys(keys_file, key_entry("team-b", KEY_B))
        os.kill(os.getpid(), signal.SIGHUP)
        await until(lambda: source.generation == 2)
        await source.wait_reloaded()
    finally:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
    ok = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_B))
    assert ok.status_code == 200


def test_store_scope_follows_the_key_id_not_its_material() -> None:
    team = scope_for("Bearer sk-old", "credential", key_id="team-a")
    assert team == scope_for("Bearer sk-new", "credential", key_id="team-a")
    assert team != scope_for("Bearer sk-old", "credential", key_id="team-b")
    assert team != scope_for("Bearer sk-old", "global", key_id="team-b")


async def test_rotated_key_reuses_its_summaries_and_another_key_does_not(
    make_app: Any, upstream: respx.MockRouter, tmp_path: Path
) -> None:
    fake = FakeUpstream().install(upstream)
    keys_file = tmp_path / "keys.json"
    write_keys(keys_file, key_entry("team-a", KEY_A), key_entry("team-b", KEY_B))
    app = await make_app(make_settings(auth={"keys_file": str(keys_file)}))
    body = history_chat()
    force = {"x-compaction": "force"}

    async def send(key: str) -> str:
        reply = await app.client.post(
            "/v1/chat/completions", json=body, headers={**bearer(key), **force}
        )
        assert reply.status_code == 200, reply.text
        return reply.headers["x-compaction-status"]

    assert await send(KEY_A) == "compacted"
    rotated = "sk-proxy-team-a-rotated"
    write_keys(keys_file, key_entry("team-a", rotated), key_entry("team-b", KEY_B))
    app.state.gate.source.request_reload()
    await app.state.gate.source.wait_reloaded()
    assert await send(rotated) == "reused"
    assert len(fake.summary_calls) == 1
    assert await send(KEY_B) == "compacted"
    assert len(fake.summary_calls) == 2


async def test_per_key_budget_and_mode_override_the_defaults(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    FakeUpstream().install(upstream)
    settings = keyed_settings(
        key_entry("small", KEY_A, budget_tokens=400),
        key_entry("off", KEY_B, mode="off", budget_tokens=50),
    )
    app = await make_app(settings)
    body = history_chat(words=100)
    small = await app.client.post("/v1/chat/completions", json=body, headers=bearer(KEY_A))
    assert small.headers["x-compaction-budget"] == "400"
    assert small.headers["x-compaction-status"] == "compacted"
    off = await app.client.post("/v1/chat/completions", json=body, headers=bearer(KEY_B))
    assert off.headers["x-compaction-status"] == "off"
    # The request's own control header still wins over the key's default.
    header = await app.client.post(
        "/v1/chat/completions", json=body, headers={**bearer(KEY_A), "x-compaction": "off"}
    )
    assert header.headers["x-compaction-status"] == "off"


def test_serve_refuses_a_public_bind_with_an_upstream_key_and_no_keys(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COMPACTION_PROXY_UPSTREAM__API_KEY", "sk-org-secret")
    monkeypatch.setenv("COMPACTION_PROXY_UPSTREAM__BASE_URL", UPSTREAM)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--host", "0.0.0.0", "--port", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "refusing to serve 0.0.0.0" in err[0]
    assert "auth.allow_anonymous" in err[0]
    assert "sk-org-secret" not in err[0]


def test_exposure_check_allows_loopback_keys_or_explicit_anonymous() -> None:
    from proxy.auth import check_exposure

    public = {"host": "0.0.0.0"}
    secret = {"api_key": "sk-org"}
    assert check_exposure(make_settings(server=public, upstream=secret), False) is not None
    assert check_exposure(make_settings(server=public, upstream=secret), True) is None
    assert check_exposure(make_settings(upstream=secret), False) is None  # 127.0.0.1
    assert check_exposure(make_settings(server={"host": "::1"}, upstream=secret), False) is None
    anonymous = make_settings(server=public, upstream=secret, auth={"allow_anonymous": True})
    assert check_exposure(anonymous, False) is None
    assert check_exposure(make_settings(server=public), False) is None  # no upstream key


async def test_admin_keys_lists_ids_and_policy_never_key_material(
    make_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEAM_B_UPSTREAM", "sk-upstream-team-b")
    monkeypatch.setenv("ADMIN_TOKEN", "admin-secret")
    settings = keyed_settings(
        key_entry("team-a", KEY_A, allowed_models=["gpt-4o*"], requests_per_minute=10),
        key_entry("team-b", KEY_B, upstream_api_key_env="TEAM_B_UPSTREAM"),
        admin={"token_env": "ADMIN_TOKEN"},
    )
    app = await make_app(settings)
    assert (await app.client.get("/admin/keys")).status_code == 401
    assert (await app.client.get("/admin/keys", headers=bearer(KEY_A))).status_code == 401
    listed = await app.client.get("/admin/keys", headers=bearer("admin-secret"))
    assert listed.status_code == 200
    data = listed.json()["data"]
    assert [k["id"] for k in data] == ["team-a", "team-b"]
    assert data[0]["allowed_models"] == ["gpt-4o*"]
    assert data[0]["requests_per_minute"] == 10
    assert data[1]["upstream_credential"] is True
    for secret in (KEY_A, KEY_B, sha(KEY_A), sha(KEY_B), "sk-upstream-team-b"):
        assert secret not in listed.text


async def test_admin_routes_are_off_without_an_admin_token(make_app: Any) -> None:
    app = await make_app(keyed_settings(key_entry("team-a", KEY_A)))
    response = await app.client.get("/admin/usage", headers=bearer("anything"))
    assert response.status_code == 401
    assert "admin.token_env" in error_of(response)["message"]


async def test_per_key_strategy_picks_the_summarizer_prompt(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    from proxy.compaction.prompt import STRUCTURED_PROMPT

    fake = FakeUpstream().install(upstream)
    settings = keyed_settings(
        key_entry("structured", KEY_A, strategy="structured"), key_entry("simple", KEY_B)
    )
    app = await make_app(settings)
    force = {"x-compaction": "force"}
    for key in (KEY_A, KEY_B):
        reply = await app.client.post(
            "/v1/chat/completions", json=history_chat(), headers={**bearer(key), **force}
        )
        assert reply.status_code == 200, reply.text
    assert len(fake.summary_calls) == 2
    structured, simple = (json.dumps(body) for body in fake.summary_calls)
    assert json.dumps(STRUCTURED_PROMPT)[1:-1] in structured
    assert json.dumps(STRUCTURED_PROMPT)[1:-1] not in simple


def test_an_unknown_key_strategy_fails_at_start() -> None:
    from proxy.app import create_app
    from proxy.settings import ConfigError

    with pytest.raises(ConfigError, match=r"auth\.keys\[0\]\.strategy"):
        create_app(keyed_settings(key_entry("team-a", KEY_A, strategy="no-such-strategy")))


_HEADER_TEXT = st.lists(
    st.sampled_from([*" \t\x0b\x0c\x1c\x1f\x85\xa0é:,;", "Bearer", "bearer", "BEARER", "sk-x"])
    | st.characters(min_codepoint=0x21, max_codepoint=0x7E)
    | st.characters(min_codepoint=0x80, max_codepoint=0xFF),
    max_size=12,
).map("".join)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["authorization", "api-key", "Authorization", "host", "api-keys"]),
            _HEADER_TEXT,
        ),
        max_size=4,
    )
)
def test_the_key_read_from_the_wire_bytes_is_the_one_read_from_their_text(
    headers: list[tuple[str, str]],
) -> None:
    """Whatever the headers hold (odd whitespace, another scheme, bytes past ASCII, an empty
    value before a good one), the digest from the wire bytes is the digest of the key the
    text reading presents."""
    from proxy.auth import digest_of, presented_key
    from proxy.auth.keys import presented_digest
    from proxy.headers import as_text

    raw = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers]
    presented = presented_key(as_text(raw))
    assert presented_digest(raw) == (None if presented is None else digest_of(presented))


@pytest.mark.parametrize(
    "value",
    [
        b"Bearer sk-x",
        b"Bearer  sk-x \t",
        b"Bearer ",
        b"Bearer \x0b",
        b"Bearer a b",
        b"bearer sk-x",
        b"BEARER sk-x",
        b" Bearer sk-x",
        b"Bearer\tsk-x",
        b"Bearer",
        b"Basic sk-x",
        b"Bearer \xe9",
        b"sk-x",
    ],
)
@pytest.mark.parametrize("name", [b"authorization", b"Authorization"])
def test_the_bearer_forms_give_the_text_readings_digest(name: bytes, value: bytes) -> None:
    """The usual `Bearer <key>` (read without parsing the scheme) and its variants each give
    the digest of the key the text reading presents, or none; a header without a key lets a
    later one be read."""
    from proxy.auth import digest_of, presented_key
    from proxy.auth.keys import presented_digest
    from proxy.headers import as_text

    for raw in ([(name, value)], [(name, value), (b"api-key", b"sk-later")]):
        presented = presented_key(as_text(raw))
        assert presented_digest(raw) == (None if presented is None else digest_of(presented))
    assert presented_digest([(name, b"Bearer sk-x ")]) == hashlib.sha256(b"sk-x").digest()


async def test_a_key_is_recognised_again_after_a_reload_and_a_dropped_one_is_not(
    tmp_path: Path,
) -> None:
    """The callers kept per key digest follow the ring: a key taken out of the keys file is
    refused on the next request after the reload, however often it was let in before."""
    from proxy.auth import Gate, KeySource
    from proxy.errors import ProxyError

    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps([key_entry("a", KEY_A), key_entry("b", KEY_B)]))
    settings = make_settings(auth={"keys_file": str(keys_file), "reload_interval_s": 3600})
    gate = Gate(settings, KeySource(settings.auth))
    wire = [(b"authorization", f"Bearer {KEY_B}".encode())]
    first = gate.admit(wire)
    assert gate.admit(wire) is first and first.key_id == "b"
    keys_file.write_text(json.dumps([key_entry("a", KEY_A)]))
    gate.source.request_reload()
    await gate.source.wait_reloaded()
    with pytest.raises(ProxyError) as refused:
        gate.admit(wire)
    assert refused.value.status == 401
    assert gate.admit([(b"api-key", KEY_A.encode())]).key_id == "a"
