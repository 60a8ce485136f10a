"""Start-up warm-up: done before the server listens, invisible to the upstream (no request,
no connection), the metrics and the access logs; the optional start probe sends the upstream
`GET /models`."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from proxy import warmup
from proxy.app import create_app
from proxy.settings import Settings
from tests.fault_upstream import FaultUpstream, fault_upstream

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


def served_app(upstream: FaultUpstream, **server: object) -> Starlette:
    return create_app(
        Settings.model_validate({"upstream": {"base_url": f"{upstream.url}/v1"}, "server": server})
    )


@asynccontextmanager
async def started(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    """The lifespan as uvicorn runs it, and a client."""
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p")
    async with app.router.lifespan_context(app), client:
        yield client


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


CHAT_ROUTE = (("route", "/v1/chat/completions"),)


async def test_warm_up_runs_at_start_and_nobody_sees_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="proxy.access")
    frozen_before = gc.get_freeze_count()
    async with fault_upstream() as upstream:
        app = served_app(upstream)
        async with started(app) as client:
            assert gc.get_freeze_count() > frozen_before  # start-up objects out of the GC
            # The upstream has seen no request nor connection, the access log has no line,
            # the metrics count no request.
            assert upstream.seen == []
            assert upstream.connections == 0
            assert not [r for r in caplog.records if r.name == "proxy.access"]
            before = samples((await client.get("/metrics")).text)
            assert not [key for key in before if key[0] == "compaction_proxy_requests_total"]
            # The chat route's latency histograms exist from the start, empty.
            count = ("compaction_proxy_request_duration_seconds_count", CHAT_ROUTE)
            assert before[count] == 0
            assert before[("compaction_proxy_upstream_ttfb_seconds_count", CHAT_ROUTE)] == 0
            reply = await client.post("/v1/chat/completions", json=CHAT)
            assert reply.status_code == 200
            assert [s.path for s in upstream.seen] == [b"/v1/chat/completions"]
            assert upstream.connections == 1
            lines = [r.getMessage() for r in caplog.records if r.name == "proxy.access"]
            assert [line.split()[:2] for line in lines] == [
                ["GET", "/metrics"],
                ["POST", "/v1/chat/completions"],
            ]
            after = samples((await client.get("/metrics")).text)
            assert after[count] == 1
            chat = [v for k, v in after.items() if k[0] == "compaction_proxy_requests_total"
                    and ("route", "/v1/chat/completions") in k[1]]  # fmt: skip
            assert chat == [1]
    gc.unfreeze()


async def test_the_model_names_the_configuration_names_are_profiled_at_start() -> None:
    # Their counting profiles (encoding, image and tool constants) are built at start, not
    # by the first request naming each; a name the configuration does not name is not.
    named = {"my-model", "gpt-4.1-nano", "gpt-4o-mini"}
    async with fault_upstream() as upstream:
        settings = Settings.model_validate(
            {
                "upstream": {"base_url": f"{upstream.url}/v1"},
                "models": {"my-model": {"encoding": "o200k_base"}},
                "compaction": {
                    "models": {"gpt-4.1-nano": {"budget_tokens": 5000}},
                    "summarizer": {"model": "gpt-4o-mini"},
                },
            }
        )
        app = create_app(settings)
        counter = app.state.proxy.counter
        assert not named & counter.profiled
        async with started(app) as client:
            assert named <= counter.profiled
            assert "gpt-4o" not in counter.profiled
            reply = await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})
            assert reply.status_code == 200
            assert "gpt-4o" in counter.profiled
    gc.unfreeze()


async def test_no_connection_is_opened_at_start() -> None:
    async with fault_upstream() as upstream, started(served_app(upstream)) as client:
        assert upstream.connections == 0
        reply = await client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 200
        assert upstream.connections == 1
    gc.unfreeze()


async def test_a_down_upstream_does_not_stop_the_start_nor_answer_for_the_first_request() -> None:
    async with fault_upstream() as upstream:
        url = upstream.url
    async with started(
        create_app(Settings.model_validate({"upstream": {"base_url": f"{url}/v1"}}))
    ) as client:
        reply = await client.post("/v1/chat/completions", json=CHAT)  # refused at start too
    assert reply.status_code == 502
    assert reply.json()["error"]["code"] == "upstream_unreachable"
    gc.unfreeze()


async def test_a_failing_warm_up_does_not_stop_the_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("model profiles broke")

    monkeypatch.setattr(warmup, "known_models", broken)
    async with fault_upstream() as upstream, started(served_app(upstream)) as client:
        reply = await client.post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 200
    assert "start-up warm-up failed" in caplog.text
    gc.unfreeze()


async def test_the_start_probe_opens_one_upstream_connection_and_answers_readyz() -> None:
    async with fault_upstream() as upstream:
        app = served_app(upstream, warm_probe_s=5)
        async with started(app) as client:
            assert [s.path for s in upstream.seen] == [b"/v1/models"]  # before any request
            ready = await client.get("/readyz")
            assert ready.status_code == 200
            assert len(upstream.seen) == 1  # the start probe's answer is kept, as any probe's
            await client.post("/v1/chat/completions", json=CHAT)
            assert upstream.seen[1].connection == upstream.seen[0].connection == 1
    gc.unfreeze()


async def test_without_the_start_probe_the_upstream_sees_nothing_at_start() -> None:
    async with fault_upstream() as upstream, started(served_app(upstream)) as client:
        assert upstream.seen == []
        assert (await client.get("/readyz")).status_code == 200
        assert [s.path for s in upstream.seen] == [b"/v1/models"]
    gc.unfreeze()


async def test_a_down_upstream_does_not_stop_the_start_probe_start() -> None:
    async with fault_upstream() as upstream:
        url = upstream.url
    app = create_app(
        Settings.model_validate(
            {"upstream": {"base_url": f"{url}/v1"}, "server": {"warm_probe_s": 5}}
        )
    )
    async with started(app) as client:  # connection refused: the start goes on
        ready = await client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["failing"] == ["upstream"]
    gc.unfreeze()


@pytest.mark.parametrize("value", [-1, 11])
def test_warm_probe_s_is_checked(value: float) -> None:
    with pytest.raises(pydantic.ValidationError, match="warm_probe_s"):
        Settings.model_validate({"server": {"warm_probe_s": value}})


async def test_behind_an_egress_proxy_no_direct_connection_is_opened_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The start-up connection would go around the proxy and never be used: none is made."""
    async with fault_upstream() as proxy:
        proxy_url = proxy.url  # nothing listens there any more
    monkeypatch.setenv("HTTP_PROXY", proxy_url)
    async with fault_upstream() as upstream, started(served_app(upstream)) as client:
        reply = await client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 502  # sent to the (absent) proxy, not to the upstream
        assert upstream.connections == 0
    gc.unfreeze()
