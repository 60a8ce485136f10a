"""Reading the upstream's `usage` from a reply as it is relayed, without changing other bytes.

Non-streaming: the reply is JSON with a `usage` object near its end, read from there
(`trailing_usage`), so a reply of any size is accounted without parsing it whole.
Streaming (SSE): with `stream_options.include_usage` the upstream sends one extra event
whose `choices` is empty and whose `usage` is set, just before `data: [DONE]`. When the
proxy asked for it on the client's behalf, `StreamTap` removes exactly that event: every
other byte reaches the client as the upstream sent it, in the same chunks, except that an
event split across chunks is held back until it is complete (so the one to remove can be
recognised). When the client asked for usage itself, the tap only reads and nothing is
held back.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import orjson

_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_EOL = (b"\r", b"\n")
# The bytes before a usage-only event's `"usage"` key as OpenAI sends them.
_EMPTY_CHOICES = (b',"choices":[],', b'{"choices":[],')
# An event longer than this is passed on without being held back or read.
_MAX_EVENT_BYTES = 1024 * 1024
_MAX_DECODED_BYTES = 8 * 1024 * 1024


class ReportedUsage(NamedTuple):
    """The upstream's own numbers for one reply."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @classmethod
    def parse(cls, usage: object) -> ReportedUsage | None:
        """Chat Completions' shape (prompt/completion tokens) or the Responses API's
        (input/output tokens); embeddings report prompt tokens only. Counts are non-negative
        integers (not booleans), else None."""
        if type(usage) is not dict:
            return None
        prompt = usage["prompt_tokens"] if "prompt_tokens" in usage else usage.get("input_tokens")
        completion = (
            usage["completion_tokens"]
            if "completion_tokens" in usage
            else usage.get("output_tokens", 0)
        )
        if type(prompt) is not int or type(completion) is not int or prompt < 0 or completion < 0:
            return None
        details = (
            usage["prompt_tokens_details"]
            if "prompt_tokens_details" in usage
            else usage.get("input_tokens_details")
        )
        cached = 0
        if type(details) is dict and "cached_tokens" in details:
            found = details["cached_tokens"]
            if type(found) is int and found > 0:
                cached = found
        return cls(prompt, completion, cached)


def usage_of_body(body: bytes, content_encoding: str = "") -> ReportedUsage | None:
    """`usage` of a whole JSON reply (None if absent, not JSON, or in an unknown encoding).

    The relayed bytes stay as the upstream encoded them; only this copy is decoded. The
    reply's end is read first (`trailing_usage`), the whole parse only when that fails.
    """
    try:
        if content_encoding:
            encoding = content_encoding.strip().lower()
            if encoding in ("gzip", "x-gzip", "deflate"):
                inflate = zlib.decompressobj(31 if encoding != "deflate" else 15)
                body = inflate.decompress(body, _MAX_DECODED_BYTES)
            elif encoding not in ("", "identity"):
                return None
        found = trailing_usage(body)
        if found is not None:
            return found
        data: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError, zlib.error):
        return None
    return ReportedUsage.parse(data.get("usage")) if isinstance(data, dict) else None


_decoder = json.JSONDecoder()
_SPACE = " \t\n\r"
_MAX_TRAILING_MEMBERS = 64


def trailing_usage(data: bytes) -> ReportedUsage | None:
    """The top-level `usage` of a JSON object that ends `data`, read from its end only.

    OpenAI puts `usage` near the end of a reply (after `choices`), so the last `"usage"` key
    in the bytes, its object, and the few members after it up to the closing brace are all
    that is parsed, however long the reply is. The answer is only given when that is proven:
    the key is not inside a string, its value has integer token counts, and what follows it
    is members of the same object up to the last byte of `data` (so the object is the
    top-level one). Otherwise None: the caller parses the whole reply, or estimates.
    `data` may be just the end of a reply (see `BodyTail`).
    """
    at = data.rfind(b'"usage"')
    if at < 0:
        return None
    slashes = 0
    while at - slashes > 0 and data[at - slashes - 1] == 0x5C:  # backslash
        slashes += 1
    if slashes % 2:  # an escaped quote: the text is inside a string
        return None
    try:
        text = data[at + 7 :].decode()
        i = 0 if text[:1] == ":" else _skip(text, 0)
        if text[i : i + 1] != ":":
            return None
        i += 1
        if text[i : i + 1] != "{":
            i = _skip(text, i)
        usage, i = _decoder.raw_decode(text, i)
        found = ReportedUsage.parse(usage)
        if found is None:
            return None
        if text[i:].rstrip(_SPACE) != "}" and not _closes_object(text, i):
            return None
    except (ValueError, UnicodeDecodeError):
        return None
    return found


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


def _closes_object(text: str, i: int) -> bool:
    """Is text[i:] `(, "key": value)* }` and then only whitespace?"""
    for _ in range(_MAX_TRAILING_MEMBERS):
        i = _skip(text, i)
        if text[i : i + 1] == "}":
            return _skip(text, i + 1) == len(text)
        if text[i : i + 1] != ",":
            return False
        key, i = _decoder.raw_decode(text, _skip(text, i + 1))
        i = _skip(text, i)
        if not isinstance(key, str) or text[i : i + 1] != ":":
            return False
        _, i = _decoder.raw_decode(text, _skip(text, i + 1))
    return False


class BodyTail:
    """The last `TAIL_BYTES` of a (possibly content-encoded) JSON reply relayed in chunks, to
    read its `usage` at the end (`trailing_usage`) without keeping the reply."""

    TAIL_BYTES = 64 * 1024
    __slots__ = ("_inflate", "_parts", "_size", "readable")

    def __init__(self, content_encoding: str = "") -> None:
        encoding = content_encoding.strip().lower()
        self.readable = encoding in ("", "identity", "gzip", "x-gzip", "deflate")
        self._inflate = (
            zlib.decompressobj(15 if encoding == "deflate" else 31)
            if self.readable and encoding not in ("", "identity")
            else None
        )
        self._parts: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> bytes:
        """Keeps the end of what passes; the chunk itself goes on untouched."""
        if not self.readable:
            return chunk
        if self._inflate is None:
            self._keep(chunk)
            return chunk
        data = chunk
        try:
            while data:
                self._keep(self._inflate.decompress(data, self.TAIL_BYTES))
                data = self._inflate.unconsumed_tail
        except zlib.error:
            self.readable = False
            self._parts = []
        return chunk

    def end(self) -> bytes:
        return b""

    def _keep(self, data: bytes) -> None:
        if not data:
            return
        if len(data) > self.TAIL_BYTES:
            data = data[-self.TAIL_BYTES :]
        self._parts.append(data)
        self._size += len(data)
        while self._size - len(self._parts[0]) >= self.TAIL_BYTES:
            self._size -= len(self._parts.pop(0))

    def usage(self) -> ReportedUsage | None:
        if not self.readable or not self._parts:
            return None
        return trailing_usage(b"".join(self._parts))


def _has_usage(data: bytes) -> bool:
    return b'"usage":{' in data or b'"usage": {' in data


def _event_data(event: bytes) -> bytes:
    """The data of one SSE event (its data lines joined)."""
    if event.startswith(b"data: ") and event.count(b"\n") == 2 and event.endswith(b"\n\n"):
        data = event[6:-2]  # one data line, as OpenAI sends them
        if b"\r" not in data:
            return data
    lines = event.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    return b"\n".join(line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:"))


def _payload_usage(payload: Any) -> ReportedUsage | None:
    if type(payload) is not dict:
        return None
    reported = payload.get("usage")
    if reported is None and isinstance(payload.get("response"), dict):
        reported = payload["response"].get("usage")  # Responses API: response.completed
    return ReportedUsage.parse(reported)


class StreamTap:
    """Fed a relayed SSE body chunk by chunk; afterwards `usage` holds what the upstream
    reported. Plain methods, no generator of its own: the relay loop calls `feed` per chunk."""

    __slots__ = ("_held", "events", "hide", "usage")

    def __init__(self, *, hide_usage_event: bool) -> None:
        self.hide = hide_usage_event
        self.usage: ReportedUsage | None = None
        self.events = 0  # events seen (a fallback estimate of completion tokens)
        self._held = b""  # the incomplete last event

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send the client now for this chunk (b"" while an event is held)."""
        if not self._held and chunk.endswith(b"\n\n"):  # the usual: whole events
            at = chunk.rfind(b'"usage"')
            # No usage key, or the last is OpenAI's `"usage":null` (in every chunk before the
            # last with include_usage) and it is the only one, or no key has an object (what
            # `_take` reads): no event here carries usage, the chunk goes as it came.
            if at < 0 or (
                chunk[at + 7 : at + 12] == b":null"
                and (chunk.find(b'"usage"', 0, at) < 0 or not _has_usage(chunk))
            ):
                if self.usage is None:
                    self.events += chunk.count(b"data:")
                return chunk
            complete = chunk
        else:
            at = -1
            data = self._held + chunk if self._held else chunk
            end = len(data) if data.endswith(b"\n\n") else _last_boundary(data)
            if end < len(data) and len(data) - end <= _MAX_EVENT_BYTES:
                complete, self._held = data[:end], data[end:]
            else:
                complete, self._held = data, b""
        out = self._read(complete, at) if self.hide else self._read_only(complete, at, chunk)
        if self.usage is None:  # the count only stands in for usage the upstream did not send
            self.events += chunk.count(b"data:")
        return out

    def _read_only(self, complete: bytes, at: int, chunk: bytes) -> bytes:
        """The chunk goes out as it came; the usage event is read from a copy."""
        if self._read_last(complete, at) is None and _has_usage(complete):
            for start, stop in _spans(complete):
                self._take(complete[start:stop])
        return chunk

    def _read(self, complete: bytes, at: int) -> bytes:
        """`complete` without the usage-only event, once read."""
        span = self._read_last(complete, at)
        if span is None:
            return self._without_usage_event(complete) if _has_usage(complete) else complete
        start, stop = span
        return complete[:start] + complete[stop:] if stop else complete

    def _read_last(self, data: bytes, at: int) -> tuple[int, int] | None:
        """Usage read from the event holding the last `"usage"` key of `data` (at `at`; -1:
        not looked for yet), when that event is one `data: ` line as OpenAI sends them:
        (start, end) of the event when it is the usage-only one; (0, 0) when it is not, or
        when no event has the key. None: not that shape, or no top-level `usage` in that
        event; the caller splits `data` into events and reads each.

        The chunk holding the usage event usually holds the reply's other events too (a
        short reply arrives at once), and the event sits at its end, just before `[DONE]`:
        finding it from its key replaces splitting the chunk and reading every event. Only
        that event is parsed: what earlier events in the chunk hold (OpenAI's
        `"usage":null`, an upstream's running counts) is no later reading than the last,
        which is the reading, as it is when the events come one by one.
        """
        if at < 0:
            at = data.rfind(b'"usage"')
            if at < 0:
                return (0, 0)
        if data[at + 7 : at + 9] != b":{" and data[at + 7 : at + 10] != b": {":
            return None
        # The key's line: after a blank line (not in a run of them) or at the start, ending
        # at one, with no CR in it (an SSE line ending too).
        start = data.rfind(b"\n", 0, at) + 1
        if start and (data[start - 2 : start] != b"\n\n" or data[start - 3 : start - 2] in _EOL):
            return None
        end = data.find(b"\n", at)
        if (
            end < 0
            or data[end + 1 : end + 2] != b"\n"
            or data[start : start + 6] != b"data: "
            or data.find(b"\r", start, end) >= 0
        ):
            return None
        stop = end + 2
        if self._take_tail(data, at, end):
            return (start, stop)
        usage_only = self._take_data(data[start + 6 : end])
        if usage_only is None:
            return None
        return (start, stop) if usage_only else (0, 0)

    def _take_tail(self, data: bytes, at: int, end: int) -> bool:
        """Record usage from the event as OpenAI sends the usage-only one, `..."choices":[],
        "usage":{...}}` ending at `end`: only `{` and the bytes from the key on are parsed,
        which parse only when they close the event's object, so the key is a member of it
        (after a comma, outside any string), and the member before it is an empty `choices`.
        False (nothing recorded): not that shape; the whole event is parsed instead."""
        if data[at - 14 : at] not in _EMPTY_CHOICES:
            return False
        try:
            tail = orjson.loads(b"{" + data[at:end])
        except orjson.JSONDecodeError:
            return False
        usage = ReportedUsage.parse(tail["usage"])
        if usage is None:
            return False
        self.usage = usage
        return True

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
        return self._take_data(_event_data(event)) is True

    def _take_data(self, data: bytes) -> bool | None:
        """Record usage from an event's data: whether it is the usage-only event (its
        `choices` empty); None when it has no top-level `usage` (nothing recorded)."""
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            payload = None
        usage = _payload_usage(payload)
        if usage is None:
            # What orjson refuses or reads differently (NaN, lone surrogates, a BOM, integers
            # past 64 bits as floats), the stdlib decides, as it always did.
            try:
                payload = json.loads(data)
            except (ValueError, UnicodeDecodeError):
                return None
            usage = _payload_usage(payload)
            if usage is None:
                return None
        self.usage = usage
        return bool(payload.get("choices") == [])

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
