"""A long tool-heavy agent session through a keyed proxy with the official openai SDK
streaming every turn: the key's usage in /admin/usage is what the upstream reported, to the
token, and the client's stream never shows the usage chunk the proxy asked for."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from proxy.app import create_app
from proxy.compaction.prompt import SYSTEM_PROMPT
from tests.integration.conftest import PROXY_UVICORN
from tests.integration.harness import WAIT_S, ServerThread, proxy_settings
from tests.replay import coding_agent

pytestmark = pytest.mark.integration

PROXY_KEY = "sk-proxy-usage-session"
ADMIN_TOKEN = "admin-usage-session"


@dataclass
class Reporting:
    """Streams OpenAI's shape ("usage":null in every chunk, the counts in a last chunk when
    asked) with counts made from the request, and keeps what it reported."""

    reported: list[tuple[int, int, int]] = field(default_factory=list)  # prompt, completion, cached
    summaries: int = 0

    async def chat(self, request: Request) -> Response:
        body = json.loads(await request.body())
        if body["messages"][0].get("content") == SYSTEM_PROMPT:
            self.summaries += 1
            reply = {"role": "assistant", "content": "Summary: the agent read and ran things."}
            usage = {"prompt_tokens": 1000, "completion_tokens": 40}
            return JSONResponse({"choices": [{"message": reply}], "usage": usage})
        size = len(json.dumps(body["messages"]))
        prompt, completion = size // 4, 3 + size % 7
        cached = prompt // 3
        self.reported.append((prompt, completion, cached))
        asked = (body.get("stream_options") or {}).get("include_usage") is True
        null = ',"usage":null' if asked else ""
        head = '{"id":"chatcmpl-s","object":"chat.completion.chunk","model":"gpt-4o-mini",'
        events = [
            head + '"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]' + null,
            head + '"choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":"stop"}]'
            + null,
        ]  # fmt: skip
        if asked:
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            events.append(head + '"choices":[],"usage":' + json.dumps(usage))

        async def chunks() -> AsyncIterator[bytes]:
            for event in events:
                yield f"data: {event}}}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")


def test_a_long_agent_session_is_accounted_as_the_upstream_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("USAGE_SESSION_ADMIN", ADMIN_TOKEN)
    upstream = Reporting()
    routes = [Route("/v1/chat/completions", upstream.chat, methods=["POST"])]
    upstream_app = Starlette(routes=routes)
    upstream_server = ServerThread(upstream_app, "usage-upstream", lifespan="off").start()
    key = {
        "id": "agents",
        "key_sha256": hashlib.sha256(PROXY_KEY.encode()).hexdigest(),
        "budget_tokens": 6000,
        "requests_per_minute": 100_000,
    }
    settings = proxy_settings(
        f"{upstream_server.url}/v1",
        auth={"keys": [key]},
        admin={"token_env": "USAGE_SESSION_ADMIN"},
    )
    proxy_server = ServerThread(create_app(settings), "usage-proxy", **PROXY_UVICORN).start()
    session = coding_agent(150)
    try:
        client = openai.OpenAI(base_url=f"{proxy_server.url}/v1", api_key=PROXY_KEY)
        for history in session.turns:
            stream = client.chat.completions.create(
                model="gpt-4o-mini",
                messages=history,  # type: ignore[arg-type]
                tools=session.tools,  # type: ignore[arg-type]
                stream=True,
            )
            chunks = list(stream)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ok"
            assert all(c.choices and c.usage is None for c in chunks)  # no usage chunk shown
        turns = len(session.turns)
        assert len(upstream.reported) == turns
        assert upstream.summaries > 0  # the session was compacted along the way
        row = _usage_row(proxy_server.url, turns)
        assert row["requests"] == turns
        assert row["estimated_requests"] == 0
        assert row["prompt_tokens_forwarded"] == sum(r[0] for r in upstream.reported)
        assert row["completion_tokens"] == sum(r[1] for r in upstream.reported)
        assert row["cached_prompt_tokens"] == sum(r[2] for r in upstream.reported)
        assert row["summarizer_prompt_tokens"] == 1000 * upstream.summaries
        assert row["summarizer_completion_tokens"] == 40 * upstream.summaries
        assert row["tokens_saved"] > 0
    finally:
        proxy_server.stop()
        upstream_server.stop()


def _usage_row(url: str, requests: int) -> dict[str, Any]:
    """The key's one row once it counts `requests` (the meter writes every 0.5 s)."""
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    deadline = time.monotonic() + WAIT_S
    while True:
        rows = httpx.get(f"{url}/admin/usage", headers=headers, timeout=WAIT_S).json()["data"]
        if (rows and rows[0]["requests"] >= requests) or time.monotonic() > deadline:
            assert len(rows) == 1, rows
            return dict(rows[0])
        time.sleep(0.05)  # polls what the proxy's meter writes on its own clock
