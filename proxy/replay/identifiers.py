"""The identifiers of a text: what an agent typically needs again, word for word.

`identifiers(text)` finds, by regular expressions, in this order:

- URLs: `http://` or `https://` up to a space, quote or bracket (trailing `.,;:!?` dropped);
- file paths: two or more names joined by `/` (`stockroom/db/locks.py`, `/etc/hosts`), and
  single file names with a common extension (`Makefile` has none: not one);
- code names: names with an underscore (`reserve_stock`, `LOCK_TIMEOUT_MS`), CamelCase
  names (`SkuRecord`, `ReservationConflictError`, `getUserById`) and names called with `(`;
- ids: upper-case words joined by `-` with a digit in them (`SKU-48213`, `INC-20931`), and
  codes of 6 or more letters and digits with at least 3 digits (`1Z999AA10123456784`,
  `7f04953`);
- numbers with 3 or more digits (`2500`, `412,600`, `41.2`, `2024-05-02` gives `2024`);
- quoted strings: 3 to 100 characters between backticks, double or single quotes, on one
  line, holding something other than letters and `_` (`"1.234,56"`, `` `make check` ``;
  not `"path"`, so JSON keys are not identifiers).

Matches are kept as written (no case folding). The extractor is meant to be cheap and
predictable, not complete: the same text always gives the same set, so "present in the
forwarded request" is a set lookup for messages that were forwarded unchanged.
"""

from __future__ import annotations

import marshal
import re
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
# Version 2 writes no back-references: equal messages give equal bytes, however their
# strings are shared between objects (version 3 and later would not).
_MARSHAL_VERSION = 2

_EXTENSIONS = (
    "py|pyi|js|mjs|ts|tsx|jsx|go|rs|java|kt|rb|php|c|h|cc|cpp|hpp|cs|swift|scala|sh|sql|"
    "md|rst|txt|json|jsonl|yaml|yml|toml|ini|cfg|conf|lock|html|css|csv|xml|pdf|log|proto"
)
_URL = re.compile(r"https?://[^\s<>\"'`()\[\]{}]+")
_PATH = re.compile(r"(?<![\w/.:-])(?:\.{1,2}/|/)?(?:[\w.-]+/)+[\w.-]*\w")
_FILE = re.compile(rf"(?<![\w/.-])[\w-]+(?:\.[\w-]+)*\.(?:{_EXTENSIONS})\b")
_SNAKE = re.compile(r"(?<![\w])_*[A-Za-z][A-Za-z0-9]*(?:_+[A-Za-z0-9]+)+\b")
_CAMEL = re.compile(r"\b(?:[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+|[a-z]+(?:[A-Z][a-z0-9]+)+)\b")
_CALLED = re.compile(r"\b[A-Za-z_]\w*(?=\()")
_ID = re.compile(r"\b[A-Z][A-Z0-9]*(?:-[A-Z0-9]+)+\b")
_CODE = re.compile(r"\b(?=[A-Za-z0-9]*[A-Za-z])(?=(?:[A-Za-z]*\d){3})[A-Za-z0-9]{6,}\b")
_NUMBER = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w])|(?<![\w.,])\d+(?:\.\d+)?")
_QUOTED = re.compile(r"`([^`\n]{3,100})`|\"([^\"\n]{3,100})\"|'([^'\n]{3,100})'")
_TRAILING = ".,;:!?"
_WORDLIKE = re.compile(r"[A-Za-z_]+")
# Called names that are plain words of prose or code, not identifiers of the session.
_COMMON_CALLS = frozenset({"if", "for", "while", "return", "print", "len", "int", "str"})


def identifiers(text: str) -> set[str]:
    """The identifiers in `text` (see the module docstring)."""
    found: set[str] = set()
    rest = text
    if "://" in text:
        for match in _URL.finditer(text):
            found.add(match.group().rstrip(_TRAILING))
        rest = _URL.sub(" ", text)  # a URL's parts are not paths of their own
    if "/" in rest:
        found.update(m.group() for m in _PATH.finditer(rest))
    if "." in rest:
        found.update(m.group() for m in _FILE.finditer(rest))
    if "_" in rest:
        found.update(m.group() for m in _SNAKE.finditer(rest))
    found.update(m.group() for m in _CAMEL.finditer(rest))
    if "(" in rest:
        found.update(
            name for m in _CALLED.finditer(rest) if (name := m.group()) not in _COMMON_CALLS
        )
    if "-" in rest:
        found.update(m.group() for m in _ID.finditer(rest) if _has_digit(m.group()))
    found.update(m.group() for m in _CODE.finditer(rest))
    for match in _NUMBER.finditer(rest):
        number = match.group()
        if sum(c.isdigit() for c in number) >= 3:
            found.add(number)
    for match in _QUOTED.finditer(text):
        quoted = match.group(1) or match.group(2) or match.group(3)
        if not _WORDLIKE.fullmatch(quoted) and quoted.strip() == quoted:
            found.add(quoted)
    return found


def _has_digit(text: str) -> bool:
    return any(c.isdigit() for c in text)


def message_text(message: Any) -> str:
    """A message's text as the identifiers are read from it: its content (text parts of a
    list), and for an assistant's tool calls each call's name and arguments."""
    if not isinstance(message, dict):
        return ""
    parts: list[str] = []
    content = message.get("content")
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            parts.append(str(function.get("name") or ""))
            arguments = function.get("arguments")
            parts.append(arguments if isinstance(arguments, str) else str(arguments))
    return "\n".join(parts)


def tool_names(tools: Iterable[Any] | None) -> set[str]:
    """The function names a request declares: always in the request, never "lost"."""
    names: set[str] = set()
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return names


class ByContent(Generic[T]):
    """A value per message, computed once per distinct message (its exact marshalled bytes
    are the key): the same message resent every turn is read once per replayed run."""

    def __init__(self, compute: Callable[[Any], T]) -> None:
        self._compute = compute
        self._values: dict[bytes, T] = {}

    def of(self, message: Any) -> T:
        try:
            key = marshal.dumps(message, _MARSHAL_VERSION)
        except ValueError:  # not plain JSON values: not kept
            return self._compute(message)
        value = self._values.get(key)
        if value is None:
            value = self._values[key] = self._compute(message)
        return value


def message_identifiers(message: Any) -> frozenset[str]:
    return frozenset(identifiers(message_text(message)))


class IdentifierCache(ByContent[frozenset[str]]):
    """`message_identifiers` per distinct message."""

    def __init__(self) -> None:
        super().__init__(message_identifiers)
