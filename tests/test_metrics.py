"""/metrics after a mix of traffic, parsed with prometheus_client's own parser."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import respx
from prometheus_client.parser import text_string_to_metric_families

from proxy import metrics as metrics_module
from tests.agent_sim import TOOLS, agent_turns
from tests.conftest import make_settings, respx_app
from tests.test_compaction_path import request_body
from tests.upstream_fakes import FakeUpstream

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
CHAT = "/v1/chat/completions"


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (a family's other
    labels, such as key_id and team on the request counts, summed over)."""
    wanted = frozenset(labels.items())
    return sum(v for (n, found), v in samples.items() if n == name and wanted <= found)


async def open_client(**sections: Any) -> AsyncIterator[httpx.AsyncClient]:
    compaction = {"budget_tokens": 1000, **sections.pop("compaction", {})}
    app = respx_app(make_settings(compaction=compaction, **sections))
    transport = httpx.ASGITransport(app=app)
    # A credential: key-less clients get no summary store (cache.anonymous).
    headers = {"authorization": "Bearer sk-metrics"}
    async with httpx.AsyncClient(
        transport=transport, base_url="http://p", headers=headers
    ) as client:
        yield client
    await app.state.proxy.upstream.client.aclose()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async for c in open_client():
        yield c


@pytest.fixture
def fake(upstream: respx.MockRouter) -> FakeUpstream:
    return FakeUpstream().install(upstream)


async def scrape(client: httpx.AsyncClient) -> Samples:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return parse(response.text)


async def test_every_family_counts_a_mix_of_traffic(
    client: httpx.AsyncClient, fake: FakeUpstream, upstream: respx.MockRouter
) -> None:
    upstream.get("/models").respond(200, json={"data": []})
    upstream.get("/files").respond(503, json={"error": {"message": "busy"}})
    first = await client.post(CHAT, json=request_body())
    again = await client.post(CHAT, json=request_body())  # same history: the stored summary
    small = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    await client.post(CHAT, json={**small, "stream": True})
    await client.post(CHAT, content=b"{broken")
    await client.get("/v1/models")
    await client.get("/v1/files")
    assert first.headers["x-compaction-status"] == "compacted"
    assert again.headers["x-compaction-status"] == "reused"
    before = int(first.headers["x-compaction-tokens-before"])
    after = int(first.headers["x-compaction-tokens-after"])

    s = await scrape(client)
    requests = "compaction_proxy_requests_total"
    assert value(s, requests, route=CHAT, status="200", model="gpt-4o-mini") == 2
    assert value(s, requests, route=CHAT, status="200", model="gpt-4o") == 1
    assert value(s, requests, route=CHAT, status="400", model="") == 1
    assert value(s, requests, route="/v1/{path:path}", status="200", model="") == 1
    assert value(s, requests, route="/v1/{path:path}", status="503", model="") == 1

    upstream_responses = "compaction_proxy_upstream_responses_total"
    assert value(s, upstream_responses, route=CHAT, status="200") == 3
    assert value(s, upstream_responses, route="/v1/{path:path}", status="503") == 1
    # Histograms: one observation per request forwarded upstream (the 400 never was).
    assert value(s, "compaction_proxy_overhead_seconds_count", route=CHAT) == 3
    assert value(s, "compaction_proxy_upstream_ttfb_seconds_count", route=CHAT) == 3
    assert value(s, "compaction_proxy_request_duration_seconds_count", route=CHAT) == 4
    assert value(s, "compaction_proxy_overhead_seconds_sum", route=CHAT) > 0

    assert value(s, "compaction_proxy_in_flight_requests") == 1  # this scrape itself
    assert value(s, "compaction_proxy_in_flight_streams") == 0  # the stream has ended

    outcomes = "compaction_proxy_compaction_outcomes_total"
    assert value(s, outcomes, status="compacted", reason="") == 1
    assert value(s, outcomes, status="reused", reason="") == 1
    assert value(s, outcomes, status="passthrough", reason="") == 1
    assert value(s, "compaction_proxy_compaction_seconds_count") == 2

    small_tokens = value(s, "compaction_proxy_prompt_tokens_total", stage="before") - 2 * before
    assert small_tokens > 0
    assert value(s, "compaction_proxy_prompt_tokens_total", stage="after") == (
        2 * after + small_tokens
    )
    assert value(s, "compaction_proxy_prompt_tokens_saved_total") == 2 * (before - after)

    assert value(s, "compaction_proxy_summarizer_calls_total", result="ok") == 1
    assert value(s, "compaction_proxy_summarizer_call_seconds_count") == 1
    assert value(s, "compaction_proxy_summarizer_tokens_total", direction="input") == 1234
    assert value(s, "compaction_proxy_summarizer_tokens_total", direction="output") == 56
    assert value(s, "compaction_proxy_store_lookups_total", result="miss") == 1
    assert value(s, "compaction_proxy_store_lookups_total", result="hit") == 1
    assert value(s, "compaction_proxy_store_errors_total", backend="memory") == 0
    breaker = "compaction_proxy_summarizer_breaker_state"
    assert value(s, breaker, state="closed") == 1 and value(s, breaker, state="open") == 0
    assert value(s, "process_resident_memory_bytes") > 0
    assert value(s, "process_cpu_seconds_total") > 0


async def test_summarizer_failures_by_reason_and_the_breaker_opening(
    upstream: respx.MockRouter, caplog: pytest.LogCaptureFixture
) -> None:
    FakeUpstream(summary_status=400).install(upstream)
    caplog.set_level(logging.WARNING, logger="proxy.compaction")
    summarizer = {"breaker_failures": 1, "retries": 0}
    async for client in open_client(
        compaction={"summarizer": summarizer}, cache={"backend": "none"}
    ):
        await client.post(CHAT, json=request_body())  # 400: the summarizer is up, not counted
        upstream.routes.clear()
        FakeUpstream(summary_status=500).install(upstream)
        failed = await client.post(CHAT, json=request_body())
        refused = await client.post(CHAT, json=request_body())
        s = await scrape(client)
    assert failed.headers["x-compaction-reason"] == "summarizer_http_500"
    assert refused.headers["x-compaction-reason"] == "circuit_open"
    failures = "compaction_proxy_summarizer_failures_total"
    assert value(s, failures, reason="summarizer_http_400") == 1
    assert value(s, failures, reason="summarizer_http_500") == 1
    assert value(s, failures, reason="circuit_open") == 1
    assert value(s, "compaction_proxy_summarizer_calls_total", result="error") == 2
    outcomes = "compaction_proxy_compaction_outcomes_total"
    assert value(s, outcomes, status="failed", reason="circuit_open") == 1
    assert value(s, "compaction_proxy_store_lookups_total", result="none") == 3
    breaker = "compaction_proxy_summarizer_breaker_state"
    assert value(s, breaker, state="open") == 1 and value(s, breaker, state="closed") == 0
    warnings = [r for r in caplog.records if "circuit breaker open" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING


async def test_model_label_is_bounded(
    client: httpx.AsyncClient, fake: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics_module, "MAX_MODELS", 2)
    for model in ("a", "b", "c", "d", "a"):
        await client.post(
            CHAT, json={"model": model, "messages": [{"role": "user", "content": "x"}]}
        )
    s = await scrape(client)
    counts = {
        labels["model"]: v
        for (name, label_set), v in s.items()
        if name == "compaction_proxy_requests_total"
        for labels in [dict(label_set)]
        if labels["route"] == CHAT
    }
    assert counts == {"a": 2, "b": 1, "other": 2}


async def test_store_lookups_count_extended_summaries_as_partial(
    fake: FakeUpstream,
) -> None:
    statuses: list[str] = []
    async for client in open_client(compaction={"budget_tokens": 2000}):
        for history in agent_turns(60):
            response = await client.post(
                CHAT, json={"model": "gpt-4o-mini", "messages": history, "tools": TOOLS}
            )
            assert response.status_code == 200
            statuses.append(response.headers["x-compaction-status"])
        s = await scrape(client)
    assert statuses.count("extended") >= 1, statuses
    lookups = "compaction_proxy_store_lookups_total"
    assert value(s, lookups, result="partial") == statuses.count("extended")
    assert value(s, lookups, result="hit") == statuses.count("reused")
    assert value(s, lookups, result="miss") == statuses.count("compacted")
