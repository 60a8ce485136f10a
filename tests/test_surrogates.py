"""Lone surrogates (`"\\ud800"`, valid JSON) in a history that is compacted."""

from __future__ import annotations

import json

import httpx
import pytest

from proxy.testing import FakeOpenAI, make_settings
from proxy.tokens import TokenCounter
from tests.test_compaction_path import request_body

pytestmark = pytest.mark.compaction_proxy(
    compaction={"budget_tokens": 1000}, cache={"backend": "none"}
)


def body_with_surrogates() -> bytes:
    body = request_body()
    body["messages"][1]["content"] += " old \ud800 lone"  # summarized
    body["messages"][-1]["content"] += " new \udfff tail"  # preserved, forwarded as sent
    raw = json.dumps(body).encode("ascii")  # ensure_ascii: the surrogates travel as escapes
    assert b"\\ud800" in raw and b"\\udfff" in raw
    return raw


async def test_compacted_history_with_lone_surrogates_is_forwarded_as_escapes(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    raw = body_with_surrogates()
    response = await proxy_client.post(
        "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-compaction-status"] == "compacted"

    (forwarded,) = [call.request.content for call in fake_openai.chat_calls]
    forwarded.decode("utf-8")  # valid UTF-8: no raw surrogate bytes
    assert b"new \\udfff tail" in forwarded  # the client's escape, unchanged
    tail = json.loads(raw)["messages"][-1]
    assert json.loads(forwarded)["messages"][-1] == tail

    (summary_call,) = fake_openai.summarizer_calls
    text = summary_call.request.content.decode("utf-8")
    assert "\\ud800" not in text
    assert "old \ufffd lone" in json.loads(text)["messages"][1]["content"]


async def test_under_budget_surrogates_are_forwarded_byte_for_byte(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    raw = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "\ud800"}]})
    response = await proxy_client.post(
        "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200
    assert [call.request.content for call in fake_openai.chat_calls] == [raw.encode()]


def test_counter_counts_lone_surrogates_without_falling_back() -> None:
    counter = TokenCounter(make_settings())
    counter.load()
    body = json.loads(body_with_surrogates())
    clean = json.loads(json.dumps(body).replace("\\ud800", "x").replace("\\udfff", "x"))
    assert counter.count_request(body) > 0
    assert counter.fallbacks == 0
    assert abs(counter.count_request(body) - counter.count_request(clean)) <= 4
