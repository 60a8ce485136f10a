"""Start-up warm-up: done before the server listens, invisible to the upstream, the metrics
and the access log; the optional start probe leaves one pooled upstream connection."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pydantic
import pytest
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
    """The lifespan as uvicorn runs it (so the app is on its served transport), and a client."""
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p")
    async with app.router.lifespan_context(app), client:
        yield client


async def test_warm_up_runs_at_start_and_nobody_sees_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="proxy.access")
    frozen_before = gc.get_freeze_count()
    async with fault_upstream() as upstream:
        app = served_app(upstream)
        async with started(app) as client:
            assert app.middleware_stack is not None  # built at start, not by request 1
            assert gc.get_freeze_count() > frozen_before  # start-up objects out of the GC
            # The rehearsal went to a throwaway server: the upstream has seen nothing, the
            # access log has no line, the metrics count no request.
            assert upstream.seen == []
            assert not [r for r in caplog.records if r.name == "proxy.access"]
            metrics = (await client.get("/metrics")).text
            assert 'route="/v1/chat/completions"' not in metrics
            reply = await client.post("/v1/chat/completions", json=CHAT)
            assert reply.status_code == 200
            assert [s.path for s in upstream.seen] == [b"/v1/chat/completions"]
            lines = [r.getMessage() for r in caplog.records if r.name == "proxy.access"]
            assert [line.split()[:2] for line in lines] == [
                ["GET", "/metrics"],
                ["POST", "/v1/chat/completions"],
            ]
    gc.unfreeze()


async def test_a_failing_warm_up_does_not_stop_the_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("rehearsal broke")

    monkeypatch.setattr(warmup, "rehearse", broken)
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
