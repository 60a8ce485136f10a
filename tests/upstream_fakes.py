"""A respx upstream that answers both the summarizer's calls and the forwarded requests."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import respx

from proxy.compaction.prompt import SUMMARY_MARKER, SYSTEM_PROMPT

REPLY = {
    "id": "chatcmpl-main",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "the answer"}}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
}
SSE = (
    b'data: {"choices":[{"delta":{"content":"the"}}]}\n\n'
    b'data: {"choices":[{"delta":{"content":" answer"}}]}\n\n'
    b"data: [DONE]\n\n"
)


def is_summarizer_call(body: dict[str, Any]) -> bool:
    messages = body.get("messages") or []
    return bool(messages) and messages[0].get("content") == SYSTEM_PROMPT


@dataclass
class FakeUpstream:
    """Records every call; the summarizer answers `summary_text` (or `summary_status`)."""

    summary_text: str = "SUMMARY: the user is building a parser; tests pass."
    summary_status: int = 200
    summary_usage: tuple[int, int] = (1234, 56)
    numbered: bool = False  # "... #n" for the n-th summary, to tell summaries apart
    gate: asyncio.Event | None = None  # when set, summarizer replies wait for it
    summary_calls: list[dict[str, Any]] = field(default_factory=list)
    summary_requests: list[httpx.Request] = field(default_factory=list)
    forwarded: list[dict[str, Any]] = field(default_factory=list)
    forwarded_raw: list[bytes] = field(default_factory=list)
    forwarded_requests: list[httpx.Request] = field(default_factory=list)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if is_summarizer_call(body):
            self.summary_calls.append(body)
            self.summary_requests.append(request)
            if self.gate is not None:
                await self.gate.wait()
            text = self.summary_text
            if self.numbered:
                text = f"{text} #{len(self.summary_calls)}"
            if self.summary_status != 200:
                return httpx.Response(self.summary_status, json={"error": {"message": "down"}})
            return httpx.Response(
                200,
                json={
                    "choices": [{"message": {"role": "assistant", "content": text}}],
                    "usage": {
                        "prompt_tokens": self.summary_usage[0],
                        "completion_tokens": self.summary_usage[1],
                    },
                },
            )
        self.forwarded.append(body)
        self.forwarded_raw.append(request.content)
        self.forwarded_requests.append(request)
        if body.get("stream"):
            return httpx.Response(200, content=SSE, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=REPLY)

    def install(self, router: respx.MockRouter) -> FakeUpstream:
        router.post("/chat/completions").mock(side_effect=self)
        return self


def summary_of(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and content.startswith(SUMMARY_MARKER):
            return message
    return None
