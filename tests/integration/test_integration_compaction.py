"""Issue 4 end to end: a 60-turn tool-using agent conversation through a live proxy.

The upstream is a real HTTP server that plays both roles: summarizer (when the system prompt
is the compaction prompt) and model. As the model it checks every request it receives the
way a strict provider would: system prompt first, tool calls and results paired both ways,
the client's latest user message present verbatim, and the prompt under the budget.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from proxy.compaction.prompt import SUMMARY_MARKER, SYSTEM_PROMPT
from proxy.settings import Settings
from proxy.tokens import TokenCounter
from tests.integration.harness import ServerThread, proxy_settings

pytestmark = pytest.mark.integration

BUDGET = 3000
TURNS = 60
SYSTEM = "You are a coding agent. Use the tools to inspect and fix the repository."


@dataclass
class StrictUpstream:
    counter: TokenCounter
    expected_last_user: list[Any] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    summaries: int = 0
    model_calls: int = 0
    tokens: list[int] = field(default_factory=list)

    async def chat(self, request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        messages = body["messages"]
        if messages[0].get("content") == SYSTEM_PROMPT:
            self.summaries += 1
            if "tools" in body:
                self.violations.append("summarizer call carried tools")
            text = f"Summary {self.summaries}: fixing the parser; tests 1-{self.summaries} pass."
            return JSONResponse(
                {
                    "choices": [{"message": {"role": "assistant", "content": text}}],
                    "usage": {"prompt_tokens": 500, "completion_tokens": 20},
                }
            )
        self.model_calls += 1
        self.check(body)
        turn = self.model_calls
        return JSONResponse(
            {
                "id": f"chatcmpl-{turn}",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "tool_calls",
                        "message": {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [
                                {
                                    "id": f"call_{turn}",
                                    "type": "function",
                                    "function": {
                                        "name": "run",
                                        "arguments": json.dumps({"cmd": f"pytest -k case{turn}"}),
                                    },
                                }
                            ],
                        },
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    def check(self, body: dict[str, Any]) -> None:
        messages = body["messages"]
        turn = self.model_calls
        if messages[0] != {"role": "system", "content": SYSTEM}:
            self.violations.append(f"turn {turn}: system prompt not first")
        called: set[str] = set()
        for index, message in enumerate(messages):
            for call in message.get("tool_calls") or []:
                called.add(call["id"])
            if message["role"] == "tool" and message["tool_call_id"] not in called:
                self.violations.append(f"turn {turn}: orphaned tool result at {index}")
        answered = {m["tool_call_id"] for m in messages if m["role"] == "tool"}
        if called - answered:
            self.violations.append(f"turn {turn}: tool calls without results {called - answered}")
        if self.expected_last_user and self.expected_last_user[-1] not in messages:
            self.violations.append(f"turn {turn}: latest user message not forwarded verbatim")
        tokens = self.counter.count_request(body)
        self.tokens.append(tokens)
        compacted = any(
            isinstance(m.get("content"), str) and m["content"].startswith(SUMMARY_MARKER)
            for m in messages
        )
        if compacted and tokens > BUDGET:
            self.violations.append(f"turn {turn}: forwarded {tokens} tokens > budget {BUDGET}")


@pytest.fixture
def strict_upstream() -> Iterator[tuple[StrictUpstream, str]]:
    counter = TokenCounter(Settings())
    counter.load()
    upstream = StrictUpstream(counter)
    app = Starlette(routes=[Route("/v1/chat/completions", upstream.chat, methods=["POST"])])
    server = ServerThread(app, "strict-upstream", lifespan="off").start()
    try:
        yield upstream, f"{server.url}/v1"
    finally:
        server.stop()
        counter.close()


def test_sixty_turn_agent_conversation_stays_valid_and_under_budget(
    strict_upstream: tuple[StrictUpstream, str], start_proxy: Callable[[Settings], str]
) -> None:
    upstream, upstream_url = strict_upstream
    proxy_url = start_proxy(proxy_settings(upstream_url, compaction={"budget_tokens": BUDGET}))
    client = openai.OpenAI(base_url=proxy_url, api_key="sk-agent", max_retries=0, timeout=30)
    rng = random.Random(3)
    tools: Any = [
        {
            "type": "function",
            "function": {
                "name": "run",
                "description": "Run a shell command in the repository",
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
            },
        }
    ]
    history: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "The parser tests fail on nested lists. Fix it."},
    ]
    upstream.expected_last_user.append(history[-1])
    statuses: list[str] = []
    for turn in range(1, TURNS + 1):
        raw = client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=history, tools=tools
        )
        statuses.append(raw.headers["x-compaction-status"])
        reply = raw.parse().choices[0].message
        history.append(reply.model_dump(exclude_none=True))
        output = " ".join(
            rng.choice(["ok", "FAILED", "assert", "parser.py:41", "ListNode"])
            for _ in range(rng.randint(30, 600))
        )
        history.append({"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": output})
        if turn % 9 == 0:
            ask = {"role": "user", "content": f"Good. Now also handle case {turn} (tuples)."}
            history.append(ask)
            upstream.expected_last_user.append(ask)

    assert upstream.violations == []
    assert upstream.model_calls == TURNS
    over = [s for s in statuses if s != "passthrough"]
    assert len(over) >= TURNS // 2, statuses
    assert set(over) <= {"compacted", "extended", "reused"}, statuses
    assert statuses.count("reused") > upstream.summaries  # the store pays off
    assert max(upstream.tokens) <= BUDGET
