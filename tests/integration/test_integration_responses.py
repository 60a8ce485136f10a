"""The official openai SDK's `client.responses.create` through the proxy, over real sockets,
against FakeOpenAI served as the upstream: streaming and not, compacted and not; what the
SDK sees (headers, events, usage) and what the upstream got (valid, within budget). And the
WebSocket upgrade a client tries first: refused at once with 426."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import websockets

from proxy.testing import FakeOpenAI, Reply, ToolCall, make_app, serve
from tests.responses.shapes import check_forwarded, codex_history

pytestmark = pytest.mark.integration

BUDGET = 3000


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI()
    with serve(fake, lifespan="off") as url:
        fake.base_url = f"{url}/v1"
        yield fake


@pytest.fixture
def proxy_url(fake: FakeOpenAI) -> Iterator[str]:
    app = make_app(upstream={"base_url": fake.base_url}, compaction={"budget_tokens": BUDGET})
    with serve(app) as url:
        yield url


@pytest.fixture
def sdk(proxy_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="sk-test", max_retries=0) as client:
        yield client


def items_of(history: list[dict[str, Any]]) -> Any:
    return history  # the SDK takes plain dicts as input items


def test_a_short_request_passes_through_with_headers(sdk: openai.OpenAI, fake: FakeOpenAI) -> None:
    raw = sdk.responses.with_raw_response.create(
        model="gpt-4o-mini", input="Say hello.", instructions="Be brief."
    )
    assert raw.headers["x-compaction-status"] == "skipped"  # a string input: nothing to cut
    reply = raw.parse()
    assert reply.output_text == "Hello from the fake upstream."
    (call,) = fake.responses_calls
    assert call.body == {"model": "gpt-4o-mini", "input": "Say hello.", "instructions": "Be brief."}


def test_a_long_history_is_compacted_and_the_sdk_reads_the_reply(
    sdk: openai.OpenAI, fake: FakeOpenAI
) -> None:
    fake.replies = [Reply(tool_calls=[ToolCall("exec_command", {"cmd": "ls"})], reasoning="r")]
    history = codex_history(30)
    raw = sdk.responses.with_raw_response.create(
        model="gpt-4o-mini", input=items_of(history), store=False,
        include=["reasoning.encrypted_content"], prompt_cache_key="session-1",
    )  # fmt: skip
    assert raw.headers["x-compaction-status"] == "compacted"
    assert int(raw.headers["x-compaction-tokens-after"]) <= BUDGET
    reply = raw.parse()
    kinds = [item.type for item in reply.output]
    assert kinds == ["reasoning", "function_call"]
    assert reply.usage is not None
    assert reply.usage.input_tokens == int(raw.headers["x-compaction-tokens-after"])
    sent = raw.http_request.content
    check_forwarded(sent, fake.responses_calls[-1].request.content)


def test_streaming_compacted_and_not(sdk: openai.OpenAI, fake: FakeOpenAI) -> None:
    for history, status in ((codex_history(2), "passthrough"), (codex_history(30), "compacted")):
        fake.replies = [Reply("Done: the parser handles empty files.")]
        with sdk.responses.with_streaming_response.create(
            model="gpt-4o-mini", input=items_of(history), stream=True
        ) as raw:
            assert raw.headers["x-compaction-status"] == status
            events = list(raw.parse())
        kinds = [event.type for event in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert "response.output_text.delta" in kinds
        completed = events[-1].response
        assert completed.output_text == "Done: the parser handles empty files."
        assert completed.usage is not None and completed.usage.input_tokens > 0
        forwarded = fake.responses_calls[-1]
        assert forwarded.stream
        sent = json.dumps({"model": "gpt-4o-mini", "input": history, "stream": True}).encode()
        if status == "passthrough":
            assert forwarded.body == json.loads(sent)
        else:
            assert completed.usage.input_tokens <= BUDGET
            assert forwarded.input[0] == history[0]


def test_a_websocket_upgrade_is_refused_at_once_with_426(proxy_url: str) -> None:
    async def connect() -> int:
        url = proxy_url.replace("http://", "ws://") + "/v1/responses"
        try:
            async with websockets.connect(url, open_timeout=5):
                return 101
        except websockets.InvalidStatus as refused:
            body = json.loads(refused.response.body or b"{}")
            assert body["error"]["code"] == "websocket_unsupported"
            return refused.response.status_code

    assert asyncio.run(connect()) == 426
