"""Turn client messages into the plain text the summarizer reads.

The summarizer only needs what was said and done, so everything else is stripped: empty parts
(some providers reject them), media (a short placeholder keeps the fact that it was there),
reasoning (large, and the reference drops it too). Each message is capped head + tail so one
huge tool output cannot overflow the summarizer's own window. Client messages are only read,
never changed, and no content shape makes this raise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.compaction.prompt import compact_prompt, message_header
from proxy.compaction.protocol import Message

CountTokens = Callable[[str], int]

# Tool-call arguments are context for the results, not the point: keep their head and tail.
TOOL_ARGUMENTS_MAX_CHARS = 1000
# Before tokenizing a huge text, keep only this many chars per allowed token (head + tail),
# so capping a 5 MB log does not tokenize all of it. No real tokenizer averages more.
_MAX_CHARS_PER_TOKEN = 32
# Room the "[... omitted ...]" marker needs inside a capped message.
_MARKER_TOKENS = 16

_TEXT_PARTS = {"text", "input_text", "output_text"}
_PLACEHOLDERS = {
    "image_url": "[image]",
    "input_image": "[image]",
    "image": "[image]",
    "input_audio": "[audio]",
    "audio": "[audio]",
    "video": "[video]",
    "video_url": "[video]",
    "file": "[file]",
    "input_file": "[file]",
}

_REASONING_BLOCK = re.compile(r"<(think|thinking|reasoning)>.*?</\1>\s*", re.DOTALL | re.IGNORECASE)
_UNCLOSED_OPEN = re.compile(r"^\s*<(think|thinking|reasoning)>", re.IGNORECASE)
_STRAY_CLOSE = re.compile(r"^.*?</(think|thinking|reasoning)>\s*", re.DOTALL | re.IGNORECASE)


def default_count_tokens(text: str) -> int:
    """~4 characters per token: the estimate used when the app gives no tokenizer."""
    return (len(text) + 3) // 4


def strip_reasoning(text: str) -> str:
    """Remove <think>-style blocks, as reasoning models inline them in plain content.

    An opening tag never closed means the reply was cut inside its reasoning: nothing after it
    is an answer. A closing tag with no opening one (templates that put `<think>` in the prompt)
    means everything before it was reasoning.
    """
    if "<" not in text:  # every pattern here starts at a tag (an assistant text's usual case)
        return text.strip()
    text = _REASONING_BLOCK.sub("", text)
    if _UNCLOSED_OPEN.match(text):
        return ""
    return _STRAY_CLOSE.sub("", text, count=1).strip()


def message_role(message: Any) -> str:
    role = message.get("role") if isinstance(message, dict) else None
    return role if isinstance(role, str) and role else "unknown"


def content_text(content: Any, *, drop_reasoning: bool = False) -> str:
    """The text of `content` (string or list of parts), media as placeholders, the rest dropped."""
    pieces: list[str] = []
    items = content if isinstance(content, list) else [content]
    for item in items:
        piece = _part_text(item)
        if piece and drop_reasoning:
            piece = strip_reasoning(piece)
        if piece and piece.strip():
            pieces.append(piece)
    return "\n".join(pieces)


def _part_text(part: Any) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        return ""
    kind = part.get("type")
    if not isinstance(kind, str):
        return ""
    if kind in _TEXT_PARTS:
        text = part.get("text")
        return text if isinstance(text, str) else ""
    if kind == "refusal":
        refusal = part.get("refusal")
        return f"[refusal] {refusal}" if isinstance(refusal, str) and refusal.strip() else ""
    if kind in _PLACEHOLDERS:
        name = _file_name(part) if _PLACEHOLDERS[kind] == "[file]" else None
        return f"[file: {name}]" if name else _PLACEHOLDERS[kind]
    return ""  # reasoning/thinking parts and unknown types


def _file_name(part: dict[str, Any]) -> str | None:
    inner = part.get(str(part.get("type")))
    for source in (inner, part):
        if isinstance(source, dict):
            name = source.get("filename")
            if isinstance(name, str) and name.strip():
                return name
    return None


def tool_calls_text(message: Message) -> list[str]:
    """One line per call (`[tool call <id>] name(arguments)`), so results keep their context."""
    lines: list[str] = []
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            if not isinstance(call, dict):
                continue
            function = call.get("function")
            function = function if isinstance(function, dict) else {}
            call_id = call.get("id")
            label = (
                f"[tool call {call_id}]" if isinstance(call_id, str) and call_id else "[tool call]"
            )
            lines.append(f"{label} {_call_signature(function)}")
    legacy = message.get("function_call")
    if isinstance(legacy, dict):
        lines.append(f"[function call] {_call_signature(legacy)}")
    return lines


def _call_signature(function: dict[str, Any]) -> str:
    name = function.get("name")
    name = name if isinstance(name, str) and name else "?"
    arguments = function.get("arguments")
    if arguments is None:
        arguments = ""
    if not isinstance(arguments, str):
        try:
            arguments = json.dumps(arguments, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            arguments = str(arguments)
    return f"{name}({truncate_chars(arguments, TOOL_ARGUMENTS_MAX_CHARS)})"


def truncate_chars(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}[... {len(text) - 2 * half} characters omitted ...]{text[-half:]}"


def cap_tokens(text: str, max_tokens: int, count_tokens: CountTokens) -> tuple[str, int]:
    """`text` cut to at most `max_tokens` (head + marker + tail), and its token count.

    Beginnings (commands, headers) and ends (errors, results) of long outputs carry the
    information; the middle of a log rarely does.
    """
    max_chars = max_tokens * _MAX_CHARS_PER_TOKEN
    sample = text
    if len(text) > max_chars:
        sample = text[: max_chars // 2] + text[-(max_chars // 2) :]
    tokens = count_tokens(sample)
    if sample is text and tokens <= max_tokens:
        return text, tokens
    keep = max(max_tokens - _MARKER_TOKENS, 2)
    half_chars = max(int(len(sample) * keep / max(tokens, 1) / 2), 1)
    for _ in range(6):
        capped = _head_tail(text, half_chars)
        tokens = count_tokens(capped)
        if tokens <= max_tokens or half_chars == 1:
            return capped, tokens
        half_chars = max(int(half_chars * max_tokens / tokens * 0.9), 1)
    capped = _head_tail(text, 1)
    return capped, count_tokens(capped)


def _head_tail(text: str, half_chars: int) -> str:
    if 2 * half_chars >= len(text):
        return text
    omitted = len(text) - 2 * half_chars
    return f"{text[:half_chars]}\n[... {omitted} characters omitted ...]\n{text[-half_chars:]}"


@dataclass(frozen=True)
class Body:
    """One message as the summarizer reads it: role, capped text, and that text's tokens."""

    role: str
    text: str
    tokens: int


def message_body(message: Message, max_tokens: int, count_tokens: CountTokens) -> Body:
    """The summarizer's view of one message: its text, its tool calls, media placeholders.
    A Responses API item is read as the chat message it stands for (`item_message`)."""
    if isinstance(message, dict) and message.get("type", "message") != "message":
        message = item_message(message)
    role = message_role(message)
    if not isinstance(message, dict):
        return Body(role, "", 0)
    pieces: list[str] = []
    call_id = message.get("tool_call_id")
    if role == "tool" and isinstance(call_id, str) and call_id:
        pieces.append(f"[result of tool call {call_id}]")
    text = content_text(message.get("content"), drop_reasoning=role == "assistant")
    if text:
        pieces.append(text)
    pieces.extend(tool_calls_text(message))
    body, tokens = cap_tokens("\n".join(pieces), max_tokens, count_tokens)
    return Body(role, body, tokens)


def item_message(item: dict[str, Any]) -> Message:
    """A Responses API item as the chat message a summarizer reads: a call as an assistant
    tool call (a custom tool's `input` and a shell call's `action` as its arguments), an
    output as a tool message, any other item as an assistant note naming its type."""
    kind = str(item.get("type"))
    call_id = item.get("call_id")
    if kind.endswith("_call") or kind == "mcp_approval_request":
        name = item.get("name")
        arguments = item.get("arguments", item.get("input", item.get("action")))
        if arguments is None:
            fields = {k: v for k, v in item.items() if k not in ("id", "type", "status")}
            arguments = fields
        call = {
            "id": call_id if isinstance(call_id, str) else "",
            "function": {"name": name if isinstance(name, str) and name else kind,
                         "arguments": arguments},
        }  # fmt: skip
        return {"role": "assistant", "tool_calls": [call]}
    if kind.endswith("_output") or kind == "mcp_approval_response":
        output = item.get("output")
        if not isinstance(output, str | list):
            output = _json_text({k: v for k, v in item.items() if k not in ("id", "type")})
        answered = call_id if isinstance(call_id, str) else item.get("approval_request_id")
        return {"role": "tool", "tool_call_id": answered, "content": output}
    return {"role": "assistant", "content": f"[{kind}]"}


def _json_text(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError, RecursionError):
        return str(value)


def compose(bodies: list[Body], custom_instruction: str = "", prompt: str | None = None) -> str:
    """The summarizer's whole user message: numbered messages, then the compact prompt
    (`prompt`, when given, replaces the default one)."""
    blocks = [message_header(i, body.role) + body.text for i, body in enumerate(bodies, 1)]
    blocks.append(
        compact_prompt(custom_instruction)
        if prompt is None
        else compact_prompt(custom_instruction, prompt)
    )
    return "\n\n".join(blocks)
