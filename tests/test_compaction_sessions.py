"""Long agent sessions, turn by turn through the app, for every strategy: every forwarded
request keeps the proxy's promises (tests/replay.py's `check`: valid tool pairs, the task
and the latest real ask verbatim, within budget or honestly `over_budget`, honest token
counts), and masking keeps the forwarded prefix from one turn to the next except at its
steps."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import respx

from proxy.compaction.mask import STUB
from proxy.compaction.prompt import SYSTEM_PROMPT
from proxy.settings import Settings
from proxy.tokens import TokenCounter
from tests.conftest import UPSTREAM, make_settings, respx_app
from tests.replay import (
    Session,
    Turn,
    check,
    coding_agent,
    customer_service,
    random_session,
    turn_of,
)

STRATEGIES = ["simple", "structured", "mask", "hybrid"]
STUB_START = STUB.split("{", 1)[0]


@dataclass
class Upstream:
    """Plays model and summarizer (summaries of 150..400 words, a function of their input)."""

    forwarded: list[dict[str, Any]] = field(default_factory=list)
    summaries: int = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        messages = body["messages"]
        if messages[0].get("content") == SYSTEM_PROMPT:
            self.summaries += 1
            digest = hashlib.blake2b(request.content, digest_size=8).digest()
            rng = random.Random(digest)
            text = "Summary: " + " ".join(rng.choice("abcdefgh") * 3 for _ in range(300))
            reply = {"role": "assistant", "content": text}
            usage = {"prompt_tokens": 100, "completion_tokens": 10}
            return httpx.Response(200, json={"choices": [{"message": reply}], "usage": usage})
        self.forwarded.append(body)
        reply = {"role": "assistant", "content": "ok"}
        return httpx.Response(
            200,
            json={
                "id": "chatcmpl-s",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": reply, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            },
        )


@pytest.fixture(scope="module")
def counter() -> Iterator[TokenCounter]:
    counter = TokenCounter(Settings())
    counter.load()
    yield counter
    counter.close()


async def replay(
    session: Session, strategy: str, budget: int, **compaction: Any
) -> tuple[list[Turn], list[dict[str, Any]], list[int]]:
    """(each turn's headers, each forwarded body, each turn's masked count)."""
    upstream = Upstream()
    settings = make_settings(
        compaction={"strategy": strategy, "budget_tokens": budget, **compaction},
        cache={"backend": "memory"},
    )
    app = respx_app(settings)
    turns: list[Turn] = []
    masked: list[int] = []
    with respx.mock(base_url=UPSTREAM, assert_all_called=False) as router:
        router.post("/chat/completions").mock(side_effect=upstream)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://p") as client:
            for history in session.turns:
                response = await client.post(
                    "/v1/chat/completions",
                    json={"model": "gpt-4o-mini", "messages": history, "tools": session.tools},
                    headers={"authorization": f"Bearer sk-{strategy}"},
                )
                assert response.status_code == 200, response.text
                turns.append(turn_of(response.headers))
                masked.append(int(response.headers.get("x-compaction-messages-masked", 0)))
    await app.state.proxy.upstream.client.aclose()
    return turns, upstream.forwarded, masked


SHAPES = {
    "coding agent": (coding_agent, 8000),  # one task, 160 calls, huge outputs, a complaint
    "parallel calls": (lambda: random_session(3, steps=120, ask_every=0.1, big_every=6), 6000),
    "customer service": (customer_service, 2500),  # many short user turns, 12 tools
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("shape", list(SHAPES))
async def test_every_forwarded_request_keeps_the_promises(
    strategy: str, shape: str, counter: TokenCounter
) -> None:
    make, budget = SHAPES[shape]
    session = make()
    turns, forwarded, masked = await replay(session, strategy, budget)
    assert check(session, turns, forwarded, counter, budget) == []
    compacted = [t for t in turns if t.status not in ("passthrough", "skipped")]
    if strategy == "mask":
        assert all(t.summarized == 0 and not t.paid for t in turns)
        if shape == "customer service":  # short outputs: no step clears 4,000 tokens
            assert compacted == [] and {t.status for t in turns} == {"passthrough", "skipped"}
            return
    assert compacted, "the session never went over budget"
    if strategy == "hybrid" and shape != "customer service":
        assert any(masked), "nothing was masked"


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_masking_keeps_the_prefix_between_its_steps(
    shape: str, counter: TokenCounter
) -> None:
    """From one masked turn to the next the forwarded request is the previous one plus the
    new messages, unless masking took a step; a step clears at least `clear_at_least`
    tokens, and the prompt is new only from the first result it masked."""
    make, budget = SHAPES[shape]
    session = make()
    clear_at_least = 300 if shape == "customer service" else 1500
    turns, forwarded, masked = await replay(
        session, "mask", budget, mask={"keep_last": 3, "clear_at_least": clear_at_least}
    )
    steps = kept = 0
    for i in range(1, len(turns)):
        if turns[i - 1].status == "passthrough" or turns[i].status == "passthrough":
            continue
        before, after = forwarded[i - 1]["messages"], forwarded[i]["messages"]
        if masked[i] == masked[i - 1]:
            assert after[: len(before)] == before, f"turn {i}: prefix changed between steps"
            kept += 1
            continue
        assert masked[i] > masked[i - 1]
        steps += 1
        first = next(j for j, (a, b) in enumerate(zip(before, after, strict=False)) if a != b)
        assert after[first]["content"].startswith(STUB_START)  # new only from a masked result
        assert all(
            not m.get("content", "").startswith(STUB_START) if m["role"] == "tool" else True
            for m in before[first:]
        ), "a step masks only results that were whole before"
        newly = [m for m in after[first : len(before)] if m["role"] == "tool"]
        cleared = sum(counter.count_message("gpt-4o-mini", m) for m in before[first : len(before)])
        cleared -= sum(counter.count_message("gpt-4o-mini", m) for m in after[first : len(before)])
        assert newly and cleared >= clear_at_least * 0.9
    assert kept > steps > 0, (kept, steps)


async def test_masking_is_deterministic_byte_for_byte() -> None:
    """The same history gives the same forwarded bytes, with no store and a fresh app."""

    async def forwarded_bytes() -> bytes:
        session = coding_agent(60)
        sent: list[bytes] = []
        settings = make_settings(
            compaction={"strategy": "mask", "budget_tokens": 6000}, cache={"backend": "none"}
        )
        app = respx_app(settings)

        def record(request: httpx.Request) -> httpx.Response:
            sent.append(request.content)
            return httpx.Response(200, json={"choices": []})

        with respx.mock(base_url=UPSTREAM, assert_all_called=False) as router:
            router.post("/chat/completions").mock(side_effect=record)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://p") as client:
                response = await client.post(
                    "/v1/chat/completions",
                    json={"model": "gpt-4o-mini", "messages": session.turns[-1]},
                )
        await app.state.proxy.upstream.client.aclose()
        assert int(response.headers["x-compaction-messages-masked"]) > 0
        return sent[-1]

    assert await forwarded_bytes() == await forwarded_bytes()
