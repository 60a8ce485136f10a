"""What FakeOpenAI answers on `POST .../responses`: a Response object, or its event stream.

A scripted item (`str`, `Reply`, `ToolCall`) becomes the Response's `output`: a `reasoning`
item first when `Reply.reasoning` is set (with `encrypted_content`, as a stateless client
asks for it), then a `message` with the text, then one `function_call` per tool call. The
stream is the sequence the API sends: `response.created`, `response.in_progress`, per
output item `response.output_item.added`, its deltas (`response.content_part.added`,
`response.output_text.delta` word by word, `response.output_text.done`,
`response.content_part.done`; `response.function_call_arguments.delta` / `.done` for a
call), `response.output_item.done`, and `response.completed` with `usage` (input tokens
counted as the proxy counts them, `input_tokens_details.cached_tokens`, output tokens).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx

from proxy.testing.script import Reply, ToolCall

CREATED = 1_700_000_000


def output_items(reply: Reply, seed: str) -> list[dict[str, Any]]:
    """The Response's `output` for `reply`; ids derived from `seed` (stable per request)."""
    items: list[dict[str, Any]] = []
    if reply.reasoning is not None:
        secret = base64.b64encode(reply.reasoning.encode() * 3).decode()
        items.append(
            {
                "id": f"rs_{seed}",
                "type": "reasoning",
                "summary": [],
                "encrypted_content": "gAAAAA" + secret,
            }
        )
    if reply.content is not None:
        items.append(
            {
                "id": f"msg_{seed}",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": reply.content, "annotations": []}],
            }
        )
    for index, call in enumerate(reply.tool_calls):
        items.append(
            {
                "id": f"fc_{seed}_{index}",
                "type": "function_call",
                "status": "completed",
                "call_id": call_id(seed, index, call),
                "name": call.name,
                "arguments": call.arguments_json(),
            }
        )
    return items


def call_id(seed: str, index: int, call: ToolCall) -> str:
    return call.id or f"call_{seed}_{index}"


def seed_of(body: Any) -> str:
    """A short id for a request's output items (its content's digest)."""
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:12]


def response_object(
    body: dict[str, Any], output: list[dict[str, Any]], usage: dict[str, Any] | None, status: str
) -> dict[str, Any]:
    """A Response as the API returns it, echoing what the request set."""
    return {
        "id": f"resp_{seed_of(body)}",
        "object": "response",
        "created_at": CREATED,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": body.get("model") or "fake",
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": body.get("store", True),
        "temperature": body.get("temperature", 1.0),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0),
        "truncation": body.get("truncation", "disabled"),
        "usage": usage,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


def usage_of(input_tokens: int, output_tokens: int, cached: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def stream_events(
    body: dict[str, Any], output: list[dict[str, Any]], usage: dict[str, Any]
) -> list[dict[str, Any]]:
    """The event sequence of a streamed Response (see the module docstring)."""
    events: list[dict[str, Any]] = []
    started = response_object(body, [], None, "in_progress")
    events.append({"type": "response.created", "response": started})
    events.append({"type": "response.in_progress", "response": started})
    for index, item in enumerate(output):
        kind = item["type"]
        if kind == "message":
            empty = {**item, "status": "in_progress", "content": []}
            events.append(
                {"type": "response.output_item.added", "output_index": index, "item": empty}
            )
            part = {"type": "output_text", "text": "", "annotations": []}
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append({"type": "response.content_part.added", **where, "part": part})
            text = item["content"][0]["text"]
            for piece in re.findall(r"\s*\S+", text):
                events.append({"type": "response.output_text.delta", **where, "delta": piece})
            events.append({"type": "response.output_text.done", **where, "text": text})
            done_part = {**part, "text": text}
            events.append({"type": "response.content_part.done", **where, "part": done_part})
        elif kind == "function_call":
            added = {**item, "status": "in_progress", "arguments": ""}
            events.append(
                {"type": "response.output_item.added", "output_index": index, "item": added}
            )
            where = {"item_id": item["id"], "output_index": index}
            arguments = item["arguments"]
            events.append(
                {"type": "response.function_call_arguments.delta", **where, "delta": arguments}
            )
            events.append(
                {"type": "response.function_call_arguments.done", **where, "arguments": arguments}
            )
        else:
            events.append(
                {"type": "response.output_item.added", "output_index": index, "item": item}
            )
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append(
        {
            "type": "response.completed",
            "response": response_object(body, output, usage, "completed"),
        }
    )
    for number, event in enumerate(events):
        event["sequence_number"] = number
    return events


async def sse(events: list[dict[str, Any]], *, broken: bool) -> AsyncIterator[bytes]:
    """Each event as the API frames it: an `event:` line naming its type, one `data:` line."""
    for event in events:
        data = json.dumps(event).encode()
        yield b"event: " + event["type"].encode() + b"\ndata: " + data + b"\n\n"
    if broken:
        raise httpx.RemoteProtocolError("the fake upstream broke off the stream")


def output_text(output: list[dict[str, Any]]) -> str:
    """What the reply says and calls, for its output token count."""
    parts: list[str] = []
    for item in output:
        if item["type"] == "message":
            parts.extend(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            parts.append(item["name"] + item["arguments"])
    return "".join(parts)
