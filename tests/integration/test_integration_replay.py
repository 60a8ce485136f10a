"""Long agent sessions replayed turn by turn through a live proxy (uvicorn on 127.0.0.1),
every forwarded request checked against the proxy's promises (tests/replay.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.routing import Route

from proxy.settings import Settings
from proxy.tokens import TokenCounter
from tests.integration.harness import ServerThread, proxy_settings
from tests.replay import (
    ReplayUpstream,
    Session,
    Turn,
    check,
    coding_agent,
    customer_service,
    random_session,
    turn_of,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def counter() -> Iterator[TokenCounter]:
    counter = TokenCounter(Settings())
    counter.load()
    yield counter
    counter.close()


@pytest.fixture(scope="module")
def replay_upstream() -> Iterator[tuple[ReplayUpstream, str]]:
    upstream = ReplayUpstream()
    app = Starlette(routes=[Route("/v1/chat/completions", upstream.chat, methods=["POST"])])
    server = ServerThread(app, "replay-upstream", lifespan="off").start()
    try:
        yield upstream, f"{server.url}/v1"
    finally:
        server.stop()


def replay(
    proxy_url: str, upstream: ReplayUpstream, session: Session, *, key: str, budget: int
) -> tuple[list[Turn], list[dict[str, Any]]]:
    upstream.forwarded.clear()
    turns: list[Turn] = []
    with httpx.Client(base_url=proxy_url, timeout=30) as client:
        for history in session.turns:
            response = client.post(
                "/chat/completions",
                json={"model": "gpt-4o-mini", "messages": history, "tools": session.tools},
                headers={"authorization": f"Bearer {key}", "x-compaction-budget": str(budget)},
            )
            assert response.status_code == 200, response.text
            turns.append(turn_of(response.headers))
    return turns, list(upstream.forwarded)


@pytest.mark.parametrize("strategy", ["simple", "structured", "hybrid"])
def test_a_coding_agent_session_keeps_every_promise(
    replay_upstream: tuple[ReplayUpstream, str],
    start_proxy: Callable[[Settings], str],
    counter: TokenCounter,
    strategy: str,
) -> None:
    upstream, url = replay_upstream
    proxy = start_proxy(proxy_settings(url, compaction={"strategy": strategy}))
    session = coding_agent()
    assert sum(bool(m.get("tool_calls")) for m in session.turns[-1]) >= 150
    turns, forwarded = replay(proxy, upstream, session, key=f"sk-coding-{strategy}", budget=8000)
    assert check(session, turns, forwarded, counter, 8000) == []
    statuses = [t.status for t in turns]
    assert statuses.count("reused") > statuses.count("extended") > 0, statuses
    if strategy != "hybrid":  # (masking steps count as `compacted` between summaries)
        assert statuses.count("compacted") == 1


def test_a_coding_agent_session_masked_keeps_every_promise(
    replay_upstream: tuple[ReplayUpstream, str],
    start_proxy: Callable[[Settings], str],
    counter: TokenCounter,
) -> None:
    """Masking alone holds the budget when it can, says `over_budget` when the last outputs
    alone are over, and never calls the summarizer."""
    upstream, url = replay_upstream
    proxy = start_proxy(proxy_settings(url, compaction={"strategy": "mask"}))
    session = coding_agent()
    summaries = upstream.summaries
    turns, forwarded = replay(proxy, upstream, session, key="sk-coding-mask", budget=12000)
    assert check(session, turns, forwarded, counter, 12000) == []
    assert upstream.summaries == summaries
    assert {"compacted", "over_budget"} <= {t.status for t in turns}


def test_a_customer_service_session_keeps_every_promise(
    replay_upstream: tuple[ReplayUpstream, str],
    start_proxy: Callable[[Settings], str],
    counter: TokenCounter,
) -> None:
    upstream, url = replay_upstream
    proxy = start_proxy(proxy_settings(url))
    session = customer_service()
    assert len(session.tools) >= 10
    assert any(m.get("role") == "tool" and m["content"] == "" for m in session.turns[-1])
    assert sum(m.get("role") == "user" for m in session.turns[-1]) > 30
    turns, forwarded = replay(proxy, upstream, session, key="sk-service", budget=3000)
    assert check(session, turns, forwarded, counter, 3000) == []
    assert {t.status for t in turns} >= {"compacted", "reused", "extended"}


@pytest.fixture(scope="module")
def shared_proxy(replay_upstream: tuple[ReplayUpstream, str]) -> Iterator[str]:
    from proxy.app import create_app
    from tests.integration.conftest import PROXY_UVICORN

    app = create_app(proxy_settings(replay_upstream[1]))
    server = ServerThread(app, "replay-proxy", **PROXY_UVICORN).start()
    try:
        yield f"{server.url}/v1"
    finally:
        server.stop()


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 10_000),
    steps=st.integers(10, 45),
    ask_every=st.sampled_from([0.0, 0.1, 0.4]),
    big_every=st.sampled_from([0, 8]),
    budget=st.sampled_from([1200, 2500, 6000]),
)
# Two skipped turns in a row, the second extending the first's summary (once flagged as a
# double payment: a skipped turn reports 0 summarized whatever it paid for).
@example(seed=30, steps=33, ask_every=0.4, big_every=8, budget=2500)
def test_random_sessions_keep_every_promise(
    replay_upstream: tuple[ReplayUpstream, str],
    shared_proxy: str,
    counter: TokenCounter,
    seed: int,
    steps: int,
    ask_every: float,
    big_every: int,
    budget: int,
) -> None:
    session = random_session(seed, steps=steps, ask_every=ask_every, big_every=big_every)
    upstream = replay_upstream[0]
    turns, forwarded = replay(shared_proxy, upstream, session, key=f"sk-{seed}", budget=budget)
    assert check(session, turns, forwarded, counter, budget) == []
