"""The summarizer calls of a keyed request are in its key's usage whenever the upstream
answered them: the request refused by its quota after compaction, a summarizer reply
without a usable summary (the compaction step failed, the request went on uncompacted)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import respx

from proxy.quota import UsageCounts
from tests.keys.conftest import KEY_A, bearer, chat, history_chat, key_entry, keyed_settings
from tests.upstream_fakes import is_summarizer_call

NOW = 1_800_000_030.0
FORCE = {"x-compaction": "force"}


def upstream_with(summary: dict[str, Any]) -> Any:
    """Summarizer calls answered with `summary` (its usage: 500 + 20), others with usage."""

    def answer(request: httpx.Request) -> httpx.Response:
        if is_summarizer_call(json.loads(request.content)):
            return httpx.Response(
                200, json={**summary, "usage": {"prompt_tokens": 500, "completion_tokens": 20}}
            )
        usage = {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107}
        return httpx.Response(200, json={"id": "c", "choices": [], "usage": usage})

    return answer


SUMMARY = {"choices": [{"message": {"role": "assistant", "content": "SUMMARY: ok"}}]}
EMPTY = {"choices": [{"message": {"role": "assistant", "content": ""}}]}


async def usage_row(app: Any) -> UsageCounts:
    await app.state.meter.join()
    [row] = await app.state.meter.ledger.usage(None, "2000-01-01", "2100-01-01")
    return row.counts


async def test_a_request_refused_after_compaction_has_its_summary_in_usage(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    upstream.post("/chat/completions").mock(side_effect=upstream_with(SUMMARY))
    app = await make_app(keyed_settings(key_entry("team-a", KEY_A, requests_per_minute=1)))
    app.state.quotas.clock = app.state.meter.clock = lambda: NOW
    ok = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert ok.status_code == 200
    refused = await app.client.post(
        "/v1/chat/completions", json=history_chat(), headers={**bearer(KEY_A), **FORCE}
    )
    assert refused.status_code == 429
    assert refused.headers["x-compaction-summary-input-tokens"] == "500"
    counts = await usage_row(app)
    assert counts.requests == 1  # as the quota counted: the refused one is not a request
    assert counts.summarizer_prompt_tokens == 500  # but its summary was billed
    assert counts.summarizer_completion_tokens == 20
    assert counts.prompt_tokens_forwarded == 100


async def test_a_summarizer_reply_without_a_summary_is_in_usage(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    upstream.post("/chat/completions").mock(side_effect=upstream_with(EMPTY))
    app = await make_app(keyed_settings(key_entry("team-a", KEY_A)))
    reply = await app.client.post(
        "/v1/chat/completions", json=history_chat(), headers={**bearer(KEY_A), **FORCE}
    )
    assert reply.status_code == 200
    assert reply.headers["x-compaction-status"] == "failed"
    assert reply.headers["x-compaction-reason"] == "summarizer_empty"
    counts = await usage_row(app)
    assert counts.requests == 1
    assert counts.summarizer_prompt_tokens == 500  # answered, so billed
    assert counts.summarizer_completion_tokens == 20
    assert counts.prompt_tokens_forwarded == 100


async def test_a_compacted_request_counts_its_summary_once(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    upstream.post("/chat/completions").mock(side_effect=upstream_with(SUMMARY))
    app = await make_app(keyed_settings(key_entry("team-a", KEY_A)))
    reply = await app.client.post(
        "/v1/chat/completions", json=history_chat(), headers={**bearer(KEY_A), **FORCE}
    )
    assert reply.headers["x-compaction-status"] == "compacted"
    counts = await usage_row(app)
    assert (counts.requests, counts.summarizer_prompt_tokens) == (1, 500)
