"""The chat formula: what one message of a chat request costs, whatever shape it arrives in.

As in OpenAI's cookbook, each message costs 3 tokens of framing (`<|start|>role ... <|end|>`)
plus the tokens of every string field (role included), 1 more when `name` is set; the reply is
primed with 3 tokens. Content may be a string or a list of parts (text, refusal, image, audio,
file). Assistant tool calls cost their function name and arguments plus `TOOL_CALL_OVERHEAD`,
an estimate for the wrapping the API adds (the cookbook gives no number for it). Messages are
client JSON: anything unexpected is skipped or counted by its strings, never an error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from proxy.tokens.images import ImagePricing, image_tokens
from proxy.tokens.media import audio_tokens, file_tokens

TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING = 3
TOOL_CALL_OVERHEAD = 3
_MAX_DEPTH = 24

TextCount = Callable[[str], int]


@dataclass(frozen=True)
class Media:
    images: ImagePricing
    unknown_image_tokens: int  # `tokenizer.remote_image_tokens`, in gpt-4o units


def message_tokens(message: object, text: TextCount, media: Media) -> int:
    if not isinstance(message, dict):
        return TOKENS_PER_MESSAGE + strings(message, text)
    total = TOKENS_PER_MESSAGE
    for key, value in message.items():
        if key == "content":
            total += content_tokens(value, text, media)
        elif key == "tool_calls":
            total += tool_calls_tokens(value, text)
        elif key == "function_call":
            total += call_tokens(value, text)
        elif isinstance(value, str):
            total += text(value)
            if key == "name":
                total += TOKENS_PER_NAME
    return total


def content_tokens(content: object, text: TextCount, media: Media) -> int:
    if isinstance(content, str):
        return text(content)
    if isinstance(content, list):
        return sum(part_tokens(part, text, media) for part in content)
    if isinstance(content, dict):
        return part_tokens(content, text, media)
    return 0


def part_tokens(part: object, text: TextCount, media: Media) -> int:
    if isinstance(part, str):
        return text(part)
    if not isinstance(part, dict):
        return strings(part, text)
    kind = part.get("type")
    if kind in ("image_url", "input_image") or "image_url" in part:
        return _image_part(part, media)
    if kind == "input_audio" or "input_audio" in part:
        audio = part.get("input_audio")
        if not isinstance(audio, dict):
            return 0
        return audio_tokens(audio.get("data"), audio.get("format"))
    if kind in ("file", "input_file") or "file" in part:
        file = part.get("file", part)
        name = file.get("filename") if isinstance(file, dict) else None
        page = media.images.unknown(media.unknown_image_tokens)
        return file_tokens(file, page) + (text(name) if isinstance(name, str) else 0)
    for key in ("text", "refusal"):
        value = part.get(key)
        if isinstance(value, str):
            return text(value)
    return sum(strings(value, text) for key, value in part.items() if key != "type")


def _image_part(part: dict[object, object], media: Media) -> int:
    image = part.get("image_url")
    if isinstance(image, dict):
        url, detail = image.get("url"), image.get("detail", part.get("detail"))
    else:
        url, detail = image, part.get("detail")
    return image_tokens(url, detail, media.images, media.unknown_image_tokens)


def tool_calls_tokens(calls: object, text: TextCount) -> int:
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list):
        return 0
    total = 0
    for call in calls:
        if not isinstance(call, dict):
            total += strings(call, text)
            continue
        kind = call.get("type", "function")
        body = call.get(kind) if isinstance(kind, str) else None
        if isinstance(body, dict):
            total += call_tokens(body, text)
        else:
            total += TOOL_CALL_OVERHEAD + sum(
                strings(value, text) for key, value in call.items() if key not in ("id", "type")
            )
    return total


def call_tokens(call: object, text: TextCount) -> int:
    """`{"name", "arguments"}` (function) or `{"name", "input"}` (custom tool)."""
    if not isinstance(call, dict):
        return 0
    total = TOOL_CALL_OVERHEAD
    for key in ("name", "arguments", "input"):
        value = call.get(key)
        if isinstance(value, str):
            total += text(value)
        elif value is not None:  # arguments sent as an object instead of a JSON string
            total += text(_json(value))
    return total


def strings(value: object, text: TextCount, depth: int = 0) -> int:
    """Tokens of every string inside `value`: the fallback for shapes we don't know."""
    if isinstance(value, str):
        return text(value)
    if depth > _MAX_DEPTH:
        return 0
    if isinstance(value, dict):
        return sum(strings(item, text, depth + 1) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(strings(item, text, depth + 1) for item in value)
    return 0


def _json(value: object) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        return ""
