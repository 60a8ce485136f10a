"""Log lines as an operator reads them: one JSON object each, an access line per request, the
request id on every line a request causes (and on the summarizer call upstream)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import logging.config
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import respx

from proxy import __version__
from proxy.logs import TextFormatter, log_config
from tests.conftest import make_settings, respx_app
from tests.test_compaction_path import request_body
from tests.upstream_fakes import FakeUpstream

ACCESS_FIELDS = {
    "time", "level", "logger", "message", "request_id", "method", "path", "route", "status",
    "model", "stream", "tokens_before", "tokens_after", "compaction", "compaction_reason",
    "cache", "upstream_status", "upstream_ttfb_ms", "duration_ms", "client", "key_id", "team",
    "limit",
}  # fmt: skip

Lines = Callable[[], list[dict[str, Any]]]


@pytest.fixture
def json_lines(monkeypatch: pytest.MonkeyPatch, preserved_logging: None) -> Lines:
    """Logging configured as `serve --log-format json` does, stderr captured and parsed."""
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    logging.config.dictConfig(log_config("info", "json"))
    return lambda: [json.loads(line) for line in stream.getvalue().splitlines()]


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    settings = make_settings(compaction={"budget_tokens": 1000}, cache={"backend": "none"})
    app = respx_app(settings)
    transport = httpx.ASGITransport(app=app, client=("203.0.113.7", 41000))
    async with httpx.AsyncClient(transport=transport, base_url="http://p") as c:
        yield c


@pytest.fixture
def fake(upstream: respx.MockRouter) -> FakeUpstream:
    return FakeUpstream().install(upstream)


def access_lines(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in lines if line["logger"] == "proxy.access"]


async def test_compacted_request_one_access_line_and_one_request_id_throughout(
    client: httpx.AsyncClient, fake: FakeUpstream, json_lines: Lines
) -> None:
    response = await client.post(
        "/v1/chat/completions?api-version=secret-query",
        json=request_body(),
        headers={"authorization": "Bearer sk-secret-key", "x-request-id": "req-abc"},
    )
    assert response.status_code == 200
    lines = json_lines()
    (access,) = access_lines(lines)
    assert set(access) == ACCESS_FIELDS
    assert access["request_id"] == "req-abc"
    assert access["method"] == "POST"
    assert access["path"] == "/v1/chat/completions"
    assert access["route"] == "/v1/chat/completions"
    assert access["status"] == 200 and access["upstream_status"] == 200
    assert access["model"] == "gpt-4o-mini" and access["stream"] is False
    assert access["compaction"] == "compacted" and access["cache"] == "none"
    assert access["tokens_before"] > access["tokens_after"] > 0
    assert access["tokens_before"] == int(response.headers["x-compaction-tokens-before"])
    assert 0 <= access["upstream_ttfb_ms"] <= access["duration_ms"]
    assert access["client"] == "203.0.113.7:41000"
    assert access["key_id"] is None
    (compaction,) = [line for line in lines if line["logger"] == "proxy.compaction"]
    assert compaction["request_id"] == "req-abc"
    assert compaction["status"] == "compacted" and compaction["messages_summarized"] > 0
    # Every line this request caused carries its id; none carries content or secrets.
    assert {line["request_id"] for line in lines} == {"req-abc"}
    assert not [line for line in lines if line["logger"].startswith("httpx")]
    text = json.dumps(lines)
    assert "sk-secret" not in text and "secret-query" not in text and "refactor" not in text
    # The summarizer call upstream is tied to the same request, and says who is calling.
    (summary_request,) = fake.summary_requests
    assert summary_request.headers["x-request-id"] == "req-abc"
    assert summary_request.headers["user-agent"] == f"compaction-proxy/{__version__}"


async def test_generated_request_id_is_the_one_logged_and_returned(
    client: httpx.AsyncClient, fake: FakeUpstream, json_lines: Lines
) -> None:
    response = await client.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    (access,) = access_lines(json_lines())
    assert access["request_id"] == response.headers["x-request-id"]
    assert access["request_id"].startswith("req_")
    assert access["stream"] is True and access["compaction"] == "passthrough"
    assert access["tokens_before"] == access["tokens_after"]


async def test_error_and_passthrough_and_unknown_routes_each_get_an_access_line(
    client: httpx.AsyncClient, upstream: respx.MockRouter, json_lines: Lines
) -> None:
    upstream.get("/models").respond(200, json={"data": []})
    await client.post("/v1/chat/completions", content=b"{not json")
    await client.get("/v1/models")
    await client.get("/nowhere")
    bad, models, nowhere = access_lines(json_lines())
    assert (bad["status"], bad["route"], bad["upstream_status"]) == (
        400,
        "/v1/chat/completions",
        None,
    )
    assert bad["compaction"] is None and bad["model"] is None
    assert (models["status"], models["route"], models["upstream_status"]) == (
        200,
        "/v1/{path:path}",
        200,
    )
    assert models["path"] == "/v1/models" and models["upstream_ttfb_ms"] is not None
    assert (nowhere["status"], nowhere["path"]) == (404, "/nowhere")


def test_text_lines_carry_the_same_fields_as_key_value() -> None:
    record = logging.LogRecord("proxy.access", logging.INFO, __file__, 1, "GET %s", ("/x",), None)
    record.request_id = "req-1"
    record.status = 200
    record.model = "gpt 4o"
    record.upstream_status = None
    line = TextFormatter().format(record)
    assert line.endswith('INFO proxy.access GET /x request_id=req-1 status=200 model="gpt 4o"')


async def test_access_line_names_the_proxy_key_never_the_key_itself(
    fake: FakeUpstream, json_lines: Lines
) -> None:
    key = "pk-team-a-secret"
    entry = {"id": "team-a", "key_sha256": hashlib.sha256(key.encode()).hexdigest()}
    app = respx_app(make_settings(auth={"keys": [entry]}))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://p") as client:
        ok = await client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": f"Bearer {key}"},
        )
        refused = await client.get("/v1/models", headers={"authorization": "Bearer pk-wrong"})
    assert ok.status_code == 200 and refused.status_code == 401
    good, bad = access_lines(json_lines())
    assert good["key_id"] == "team-a" and good["status"] == 200
    assert bad["key_id"] is None and bad["status"] == 401
    assert key not in json.dumps(json_lines())
