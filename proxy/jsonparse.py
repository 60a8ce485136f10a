"""`json.loads` for big request bodies, in pieces that let other threads run in between.

`json.loads` is one C call: in a worker thread it still holds the GIL for the whole parse
(~0.6 s for 40 MB), so the event loop stalls as if it parsed on the loop. This parser reads
the top-level object key by key and its arrays element by element with the same C scanner,
so the GIL can change hands between elements: run it in a thread and the loop keeps serving.
The result equals `json.loads` (same values, last duplicate key wins, same errors); only the
elements of one top-level array may be refused early, by `max_items`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from json import JSONDecodeError
from typing import Any

_DECODER = json.JSONDecoder()
_SCAN = _DECODER.raw_decode  # checked; the loop over array elements calls the scanner itself
_SCAN_ONCE: Callable[[str, int], tuple[Any, int]] = _DECODER.scan_once  # type: ignore[attr-defined]
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_BLANK = " \t\n\r"


class TooManyItems(Exception):
    """The array under `key` holds more than `limit` elements (parsing stopped there)."""

    def __init__(self, key: str, limit: int) -> None:
        super().__init__(f"{key} holds more than {limit} items")
        self.key = key
        self.limit = limit


def loads(raw: bytes, *, limited_key: str = "", max_items: int = 0) -> Any:
    """Like `json.loads(raw)`; raises TooManyItems when the top-level array `limited_key`
    has more than `max_items` elements (0: no limit)."""
    text = raw.decode(json.detect_encoding(raw), "surrogatepass")  # as json.loads(bytes)
    i = _skip(text, 0)
    if not text.startswith("{", i):
        return json.loads(text)  # not an object: the caller refuses it anyway
    result: dict[str, Any] = {}
    i = _skip(text, i + 1)
    if text.startswith("}", i):
        return _end(text, i + 1, result)
    while True:
        if not text.startswith('"', i):
            raise JSONDecodeError("Expecting property name enclosed in double quotes", text, i)
        key, i = _SCAN(text, i)
        i = _skip(text, i)
        if not text.startswith(":", i):
            raise JSONDecodeError("Expecting ':' delimiter", text, i)
        i = _skip(text, i + 1)
        if text.startswith("[", i):
            limit = max_items if key == limited_key else 0
            value, i = _array(text, i + 1, key, limit)
        else:
            value, i = _SCAN(text, i)
        result[key] = value
        i = _skip(text, i)
        if text.startswith(",", i):
            i = _skip(text, i + 1)
            continue
        if text.startswith("}", i):
            return _end(text, i + 1, result)
        raise JSONDecodeError("Expecting ',' delimiter", text, i)


def _array(text: str, i: int, key: str, limit: int) -> tuple[list[Any], int]:
    """The elements from just after `[` to just after `]`, one scanner call each."""
    items: list[Any] = []
    append = items.append
    scan = _SCAN_ONCE
    end = len(text)
    i = _skip(text, i)
    if text.startswith("]", i):
        return items, i + 1
    while True:
        try:
            value, i = scan(text, i)
        except StopIteration as exc:
            raise JSONDecodeError("Expecting value", text, exc.value) from None
        append(value)
        if limit and len(items) > limit:
            raise TooManyItems(key, limit)
        char = text[i] if i < end else ""
        if char in _BLANK and char:
            i = _skip(text, i)
            char = text[i] if i < end else ""
        if char == ",":
            i += 1
            if i < end and text[i] in _BLANK:
                i = _skip(text, i)
            continue
        if char == "]":
            return items, i + 1
        raise JSONDecodeError("Expecting ',' delimiter", text, i)


def _skip(text: str, i: int) -> int:
    match = _WHITESPACE.match(text, i)
    return match.end() if match is not None else i


def _end(text: str, i: int, result: dict[str, Any]) -> dict[str, Any]:
    i = _skip(text, i)
    if i != len(text):
        raise JSONDecodeError("Extra data", text, i)
    return result
