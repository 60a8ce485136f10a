"""Reading the upstream's `usage` from a reply as it is relayed, without changing other bytes.

Non-streaming: the reply is JSON with a `usage` object. Streaming (SSE): with
`stream_options.include_usage` the upstream sends one extra event whose `choices` is empty
and whose `usage` is set, just before `data: [DONE]`. When the proxy asked for it on the
client's behalf, `StreamTap` removes exactly that event: every other byte reaches the client
as the upstream sent it, in the same chunks, except that an event split across chunks is
held back until it is complete (so the one to remove can be recognised). When the client
asked for usage itself, the tap only reads and nothing is held back.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")
# An event longer than this is passed on without being held back or read.
_MAX_EVENT_BYTES = 1024 * 1024
_MAX_DECODED_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class ReportedUsage:
    """The upstream's own numbers."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @classmethod
    def parse(cls, usage: object) -> ReportedUsage | None:
        """Chat Completions' shape (prompt/completion tokens) or the Responses API's
        (input/output tokens); embeddings report prompt tokens only."""
        if not isinstance(usage, dict):
            return None
        prompt = _count(usage.get("prompt_tokens", usage.get("input_tokens")))
        completion = _count(usage.get("completion_tokens", usage.get("output_tokens", 0)))
        if prompt is None or completion is None:
            return None
        details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        return cls(prompt, completion, cached or 0)


def _count(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def usage_of_body(body: bytes, content_encoding: str = "") -> ReportedUsage | None:
    """`usage` of a whole JSON reply (None if absent, not JSON, or in an unknown encoding).

    The relayed bytes stay as the upstream encoded them; only this copy is decoded.
    """
    encoding = content_encoding.strip().lower()
    try:
        if encoding in ("gzip", "x-gzip", "deflate"):
            inflate = zlib.decompressobj(31 if encoding != "deflate" else 15)
            body = inflate.decompress(body, _MAX_DECODED_BYTES)
        elif encoding not in ("", "identity"):
            return None
        data: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError, zlib.error):
        return None
    return ReportedUsage.parse(data.get("usage")) if isinstance(data, dict) else None


def _has_usage(data: bytes) -> bool:
    return b'"usage":{' in data or b'"usage": {' in data


def _event_payload(event: bytes) -> Any:
    lines = event.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    data = b"\n".join(line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:"))
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None


class StreamTap:
    """Fed a relayed SSE body chunk by chunk; afterwards `usage` holds what the upstream
    reported. Plain methods, no generator of its own: the relay loop calls `feed` per chunk."""

    def __init__(self, *, hide_usage_event: bool) -> None:
        self.hide = hide_usage_event
        self.usage: ReportedUsage | None = None
        self.events = 0  # events seen (a fallback estimate of completion tokens)
        self._held = b""  # the incomplete last event

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send the client now for this chunk (b"" while an event is held)."""
        self.events += chunk.count(b"data:")
        data = self._held + chunk if self._held else chunk
        end = len(data) if data.endswith(b"\n\n") else _last_boundary(data)
        if end < len(data) and len(data) - end <= _MAX_EVENT_BYTES:
            complete, self._held = data[:end], data[end:]
        else:
            complete, self._held = data, b""
        if not self.hide:
            # Read-only: the chunk goes out as it came; the usage event is read from a copy.
            if complete and _has_usage(complete):
                for start, stop in _spans(complete):
                    self._take(complete[start:stop])
            return chunk
        if complete and _has_usage(complete):
            return self._without_usage_event(complete)
        return complete

    def end(self) -> bytes:
        """What is still held when the stream ends (an event without its terminator)."""
        held, self._held = self._held, b""
        return held if self.hide else b""

    async def relay(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """`feed` over an async iterator (for callers without a relay loop of their own)."""
        async for chunk in chunks:
            out = self.feed(chunk)
            if out:
                yield out
        rest = self.end()
        if rest:
            yield rest

    def _take(self, event: bytes) -> bool:
        """Record usage from an event; True if it is the usage-only event."""
        if not _has_usage(event):
            return False
        payload = _event_payload(event)
        if not isinstance(payload, dict):
            return False
        reported = payload.get("usage")
        if reported is None and isinstance(payload.get("response"), dict):
            reported = payload["response"].get("usage")  # Responses API: response.completed
        usage = ReportedUsage.parse(reported)
        if usage is None:
            return False
        self.usage = usage
        return payload.get("choices") == []

    def _without_usage_event(self, data: bytes) -> bytes:
        for start, stop in _spans(data):
            if self._take(data[start:stop]):
                return data[:start] + data[stop:]
        return data


def _last_boundary(data: bytes) -> int:
    """Index just past the last event terminator in `data` (0 if none)."""
    best = 0
    for sep in (b"\n\n", b"\r\n\r\n", b"\r\r"):
        at = data.rfind(sep)
        if at >= 0:
            best = max(best, at + len(sep))
    return best


def _spans(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each complete event, terminator included."""
    spans: list[tuple[int, int]] = []
    start = 0
    for match in _BOUNDARY.finditer(data):
        spans.append((start, match.end()))
        start = match.end()
    return spans
