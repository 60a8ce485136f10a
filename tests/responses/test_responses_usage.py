"""A proxy key's usage on /v1/responses: read from the JSON reply and from the stream's
`response.completed`, cached tokens included; the key's budget and mode apply."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from proxy.testing import FakeOpenAI, Reply, make_app
from tests.responses.shapes import codex_history, responses_body

KEY = "sk-proxy-team-r-0123456789"
ADMIN = {"authorization": "Bearer admin-token"}
USAGE = {
    "input_tokens": 1200,
    "input_tokens_details": {"cached_tokens": 1024},
    "output_tokens": 40,
    "output_tokens_details": {"reasoning_tokens": 12},
    "total_tokens": 1240,
}


@pytest.fixture
async def client(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Client]:
    monkeypatch.setenv("ADMIN_TOKEN", "admin-token")
    entry = {
        "id": "team-r",
        "key_sha256": hashlib.sha256(KEY.encode()).hexdigest(),
        "budget_tokens": 3000,
        "team": "codex-users",
    }
    app = make_app(auth={"keys": [entry]}, admin={"token_env": "ADMIN_TOKEN"})
    fake = FakeOpenAI()
    with fake.mock():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
                yield Client(http, fake, app.state.proxy)


@dataclass
class Client:
    http: httpx.AsyncClient
    fake: FakeOpenAI
    state: Any  # the app's ProxyState


async def usage_rows(http: httpx.AsyncClient, app_state: Any) -> list[dict[str, Any]]:
    await app_state.meter.join()
    reply = await http.get("/admin/usage", headers=ADMIN)
    rows: list[dict[str, Any]] = reply.json()["data"]
    return rows


@pytest.mark.parametrize("stream", [False, True])
async def test_usage_is_read_from_the_reply_cached_tokens_included(
    client: Client, stream: bool
) -> None:
    http, fake = client.http, client.fake
    fake.replies = [Reply("ok", usage=USAGE)]
    body = responses_body(codex_history(30), stream=stream)
    reply = await http.post("/v1/responses", json=body, headers={"authorization": f"Bearer {KEY}"})
    await reply.aread()
    assert reply.status_code == 200
    # The key's budget (3000) applies: compacted, and the tokens it saved are accounted.
    assert reply.headers["x-compaction-budget"] == "3000"
    assert reply.headers["x-compaction-status"] == "compacted"
    (row,) = await usage_rows(http, client.state)
    assert row["key"] == "team-r" and row["requests"] == 1
    assert row["prompt_tokens_forwarded"] == 1200
    assert row["cached_prompt_tokens"] == 1024
    assert row["completion_tokens"] == 40
    assert row["estimated_requests"] == 0
    before = int(reply.headers["x-compaction-tokens-before"])
    after = int(reply.headers["x-compaction-tokens-after"])
    assert row["tokens_saved"] == before - after > 0
    assert row["summarizer_prompt_tokens"] > 0  # the summary call, billed to the key


async def test_usage_names_the_keys_team_and_the_requests_end_user(client: Client) -> None:
    """`user`, or its newer name `safety_identifier`, says whom a request is for."""
    http, fake = client.http, client.fake
    fake.replies = [Reply("ok", usage=USAGE)] * 3
    bodies = [
        {**responses_body([]), "user": "alice"},
        {**responses_body([]), "safety_identifier": "bob"},
        responses_body([]),
    ]
    for body in bodies:
        auth = {"authorization": f"Bearer {KEY}"}
        reply = await http.post("/v1/responses", json=body, headers=auth)
        assert reply.status_code == 200
    await client.state.meter.join()
    grouped = await http.get("/admin/usage", params={"group_by": "team,user"}, headers=ADMIN)
    assert grouped.status_code == 200, grouped.text
    rows = {(row["team"], row["user"]): row["requests"] for row in grouped.json()["data"]}
    assert rows == {("codex-users", "alice"): 1, ("codex-users", "bob"): 1}


async def test_a_key_without_a_credential_is_refused(client: Client) -> None:
    http, fake = client.http, client.fake
    reply = await http.post("/v1/responses", json=json.loads(json.dumps(responses_body([]))))
    assert reply.status_code == 401
    assert not fake.calls
