"""Responses API histories shaped like the ones real agents send, and the checks every
request the proxy forwards must pass (tests and benches share them)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from proxy.jsonspans import field_of

Item = dict[str, Any]

DEVELOPER = "You are a coding agent running in a terminal. Be precise, run the tests. " * 20
ENVIRONMENT = (
    "<environment_context>\n  <cwd>/repo</cwd>\n  <shell>bash</shell>\n</environment_context>"
)


def message(role: str, text: str, *, item_id: str | None = None) -> Item:
    part = "output_text" if role == "assistant" else "input_text"
    item: Item = {"type": "message", "role": role, "content": [{"type": part, "text": text}]}
    if item_id is not None:
        item["id"] = item_id
    return item


def tool_turn(i: int, output_words: int = 400, *, reasoning: bool = True) -> list[Item]:
    """One agent step: reasoning, a shell call and its (large) output."""
    items: list[Item] = []
    if reasoning:
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{i}",
                "summary": [],
                "encrypted_content": "gAAAAA" + f"{i:04d}" * 100,
            }
        )
    arguments = json.dumps({"cmd": f"pytest -x tests/test_{i}.py"})
    items.append(
        {
            "type": "function_call",
            "id": f"fc_{i}",
            "call_id": f"call_{i}",
            "name": "exec_command",
            "arguments": arguments,
        }
    )
    lines = " ".join(f"line {i}.{w} of the test output" for w in range(output_words // 6))
    items.append({"type": "function_call_output", "call_id": f"call_{i}", "output": lines})
    return items


def codex_history(turns: int, *, asks_every: int = 10, output_words: int = 400) -> list[Item]:
    """Codex's shape: developer messages, an environment block, the task, then tool turns
    with a user message now and then."""
    items: list[Item] = [
        message("developer", DEVELOPER, item_id="msg_dev"),
        message("user", ENVIRONMENT, item_id="msg_env"),
        message("user", "Fix the failing parser tests.", item_id="msg_task"),
    ]
    for i in range(turns):
        items += tool_turn(i, output_words)
        if asks_every and i % asks_every == asks_every - 1:
            items.append(message("user", f"Also check module {i}.", item_id=f"msg_u{i}"))
    return items


def responses_body(items: list[Item], **extra: Any) -> dict[str, Any]:
    return {
        "model": "gpt-4o-mini",
        "input": items,
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "tools": [
            {
                "type": "function",
                "name": "exec_command",
                "description": "Run a shell command.",
                "parameters": {
                    "type": "object",
                    "properties": {"cmd": {"type": "string", "description": "The command."}},
                    "required": ["cmd"],
                },
            }
        ],
        **extra,
    }


def outside_input(raw: bytes) -> tuple[bytes, bytes]:
    """The bytes of a body before and after its `input` array."""
    found = field_of(raw, "input")
    assert found is not None, "no input array"
    start = found.start(1)
    depth, index, in_string, escaped = 0, start, False, False
    while True:  # the array's end: brackets outside strings
        char = raw[index : index + 1]
        if in_string:
            if escaped:
                escaped = False
            elif char == b"\\":
                escaped = True
            elif char == b'"':
                in_string = False
        elif char == b'"':
            in_string = True
        elif char in b"[{":
            depth += 1
        elif char in b"]}":
            depth -= 1
            if depth == 0:
                return raw[:start], raw[index + 1 :]
        index += 1


def check_forwarded(sent: bytes, forwarded: bytes) -> list[Item]:
    """What a valid forwarded request keeps of what the client sent (raises AssertionError):
    every byte outside `input` as sent; each call paired with its output by call_id; every
    reasoning item whole and followed by what followed it; leading developer/system items
    and `additional_tools` in place; compaction items neither dropped nor reordered; every
    item the client sent kept as its own bytes. Returns the forwarded items."""
    assert outside_input(forwarded) == outside_input(sent), "a field other than input changed"
    original: list[Item] = json.loads(sent)["input"]
    items: list[Item] = json.loads(forwarded)["input"]
    calls = Counter(i["call_id"] for i in items if str(i.get("type", "")).endswith("_call"))
    outputs = Counter(i["call_id"] for i in items if str(i.get("type", "")).endswith("_output"))
    assert calls == outputs, f"calls and outputs not paired: {calls - outputs} {outputs - calls}"
    after = {
        json.dumps(item, sort_keys=True): original[n + 1] if n + 1 < len(original) else None
        for n, item in enumerate(original)
    }
    kept = {json.dumps(item, sort_keys=True) for item in original}
    for n, item in enumerate(items):
        key = json.dumps(item, sort_keys=True)
        if item.get("type") == "reasoning":
            assert key in kept, "a reasoning item was changed"
            following = items[n + 1] if n + 1 < len(items) else None
            assert following == after[key], "a reasoning item lost the item it led to"
    lead = 0
    while lead < len(original) and (
        original[lead].get("role") in ("system", "developer")
        or original[lead].get("type") == "additional_tools"
    ):
        lead += 1
    assert items[:lead] == original[:lead], "the leading developer items moved"
    compactions = [i for i in original if i.get("type") == "compaction"]
    assert [i for i in items if i.get("type") == "compaction"] == compactions
    for item in items:
        if json.dumps(item, sort_keys=True) in kept:
            text = json.dumps(item, separators=(",", ":"), ensure_ascii=False).encode()
            assert text in sent or _bytes_of(item, sent), "a kept item was re-encoded"
    return items


def _bytes_of(item: Item, sent: bytes) -> bool:
    """Whether the item's own bytes (as the client spaced them) are in the body."""
    for separators in ((", ", ": "), (",", ":")):
        for ascii_only in (True, False):
            text = json.dumps(item, separators=separators, ensure_ascii=ascii_only).encode()
            if text in sent:
                return True
    return False
