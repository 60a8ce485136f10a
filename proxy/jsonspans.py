"""A chat body parsed message by message, remembering where each message's bytes are.

An agent resends its whole history every turn, so most of a long body is bytes the proxy
has seen before. Knowing each message's span in the client's own bytes lets the request
path hash those bytes (the summary store's prefix keys, the token memo's keys) instead of
re-serialising every message, and forward kept messages as the client wrote them.

How: the `messages` array is split at the candidate ends of its elements (`}` then `,` and
the next `{"`, or `}` then the array's `]` and what may follow it), and each candidate span
is parsed on its own with orjson (C, ~1 GB/s). A span that is not a whole element (a
candidate inside a string or a nested array) fails to parse and the next candidate is
tried: JSON objects are prefix-free, so the first span that parses is the element. The
rest of the body (model, tools, options) is parsed with the array replaced by a sentinel,
which must come back as the top-level `messages` value: by orjson, or by the stdlib where
the two could read it apart (a run of 19+ digits, whatever orjson refuses), so it equals
`json.loads` exactly (integers past 64 bits included).

What orjson refuses (lone surrogates `"\\ud800"`, NaN, numbers out of range) is parsed by
the stdlib, element by element, so the result equals `json.loads`; except that an integer
beyond 64 bits inside a message reads as a float (orjson's reading). The proxy reads no
numbers from messages and forwards the client's bytes, so nothing a user sees changes.
Anything else unusual (no `messages` array at the top, an empty one, an element that is not
an object, invalid JSON) answers None: the caller parses the whole body the old way, which
also words the error.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from operator import is_
from typing import Any

import anyio.to_thread
import orjson

from proxy.jsonparse import TooManyItems
from proxy.sessioncache import SessionCache

_WS = rb"[ \t\n\r]*"
_FIELD = re.compile(rb'"messages"' + _WS + rb":" + _WS + rb"(\[)" + _WS)
# The arrays this parser knows, by the body field that holds them: chat completions'
# `messages`, the Responses API's `input` items.
_FIELDS = {
    "messages": _FIELD,
    "input": re.compile(rb'"input"' + _WS + rb":" + _WS + rb"(\[)" + _WS),
}
# The end of one element: `}` then `,` before the next `{"`, or `}` then `]` before the
# top level goes on (`,"key"`) or ends (`}`). Lookaheads: the match ends at `,` or `]`.
_ARRAY_END = rb"(\])(?=" + _WS + rb"(?:," + _WS + rb'"|\}' + _WS + rb"\Z))"
_END = re.compile(rb"\}" + _WS + rb"(?:,(?=" + _WS + rb"\{" + _WS + rb'")|' + _ARRAY_END + rb")")
_OPEN = re.compile(_WS + rb"\{")
# The fast path's candidates, in one scan: between two elements (`}` `,` up to the next
# element's `{`, which is followed by a key), or the array's end (group 1, as in `_END`).
_CANDIDATE = re.compile(
    rb"\}" + _WS + rb"(?:," + _WS + rb"(?=\{" + _WS + rb'")|' + _ARRAY_END + rb")"
)
_TRUNCATED = "unexpected end of data"  # orjson's words for a span cut short
# Every ASCII digit as "0", any other byte as " ": a run of 19 zeros is where an integer
# could pass 64 bits (one C pass, ~10x faster than the regex `[0-9]{19}`).
_DIGIT_RUNS = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
_LONG_RUN = b"0" * 19
# The array's stand-in when the rest of the body is parsed: no client can guess it.
_SENTINEL = f"\x00cp-messages-{secrets.token_hex(8)}"
_SENTINEL_JSON = json.dumps(_SENTINEL).encode()
_RAW_SALT = hash("raw-message")
_CHECK_EVERY = 512  # messages between checks of their average size
# Up to this size the array is parsed in one orjson call (~0.8 ms/MB, one GIL hold); bigger
# ones element by element, so a worker thread parsing them lets the loop run in between.
WHOLE_ARRAY_BYTES = 4 * 1024 * 1024
_OFFLOAD_BYTES = 256 * 1024  # bigger bodies are parsed in a worker thread by spans_of


@dataclass(eq=False)
class Spans:
    """Where each message of `messages` (the body's own list) is in `raw`."""

    raw: bytes
    open: int  # index of the array's `[`
    close: int  # index just after its `]`
    starts: list[int]
    ends: list[int]
    messages: list[Any]
    _keys: list[int] | None = field(default=None, repr=False)
    _index: dict[int, int] | None = field(default=None, repr=False)
    # Found by the one-call fast path (`_whole_array`): a later body that extends this one
    # can be parsed from it (`extend_chat`) with the same answer.
    whole: bool = field(default=False, repr=False)
    # What the compaction step derives from these messages (token counts, store chains, the
    # conversation's structure), kept with the body for the session's next turn: a body
    # extending this one starts with the same messages, so with these (`extend_chat`).
    cache: SessionCache = field(default_factory=SessionCache, repr=False)
    # The body field holding the array: "messages" (chat completions) or "input" (the
    # Responses API's items).
    field_name: str = "messages"

    def view(self, index: int) -> memoryview:
        return memoryview(self.raw)[self.starts[index] : self.ends[index]]

    def keys(self) -> list[int]:
        """A 64-bit key per message: Python's keyed hash of its bytes (salted apart from
        other key kinds). Equal bytes, equal key; a re-serialised message gets another."""
        if self._keys is None:
            raw, salt = self.raw, _RAW_SALT
            self._keys = [
                hash(raw[a:b]) ^ salt for a, b in zip(self.starts, self.ends, strict=True)
            ]
        return self._keys

    def index_of(self, message: object) -> int | None:
        """The position of `message` (this very object) in the body, None if it is not one
        of the client's messages (a summary, a copy)."""
        if self._index is None:  # the list holds them: no other object can share their ids
            self._index = {id(m): i for i, m in enumerate(self.messages)}
        return self._index.get(id(message))

    def key_of(self, message: object) -> int | None:
        index = self.index_of(message)
        return None if index is None else self.keys()[index]

    def run_of(self, messages: Sequence[object]) -> int | None:
        """Where `messages` start in the body when they are a run of its very objects (the
        history after the pinned ones, say); None otherwise."""
        if not messages:
            return None
        first = self.index_of(messages[0])
        if first is not None:
            run = self.messages[first : first + len(messages)]
            if len(run) == len(messages) and all(map(is_, run, messages)):
                return first
        return None

    def keys_for(self, messages: Sequence[object]) -> list[int | None]:
        """The key of each of `messages` that is one of the client's; None for the others."""
        keys = self.keys()
        first = self.run_of(messages)
        if first is not None:
            found: list[int | None] = list(keys[first : first + len(messages)])
            return found
        self.index_of(None)
        get = self._index.get  # type: ignore[union-attr]
        return [None if (i := get(id(m))) is None else keys[i] for m in messages]

    def digest(self, index: int) -> bytes:
        """SHA-256 of the message's bytes (SHA-NI makes it the fastest digest here)."""
        return hashlib.sha256(self.view(index)).digest()

    def splice(
        self, content: bytes, messages: Sequence[Any], encode: Callable[[Any], bytes]
    ) -> bytes | None:
        """`content` (the client's body, or one that only differs after the array) with the
        array replaced by `messages`: the client's messages as their own bytes, any other
        one through `encode`. None when `content` no longer holds the array where `raw` did."""
        raw = self.raw
        if content is not raw and not content.startswith(memoryview(raw)[: self.close]):
            return None
        source = memoryview(raw)
        starts, ends, index_of = self.starts, self.ends, self.index_of
        parts: list[bytes | memoryview] = []
        # A run of the client's messages that were one `,` apart is one slice of its bytes.
        first = last = -2
        for message in messages:
            index = index_of(message)
            if index is not None and index == last + 1 and starts[index] == ends[last] + 1:
                last = index
                continue
            if first >= 0:
                parts.append(source[starts[first] : ends[last]])
            if index is None:
                parts.append(encode(message))
                first = last = -2
            else:
                first = last = index
        if first >= 0:
            parts.append(source[starts[first] : ends[last]])
        view = memoryview(content)
        return b"".join((view[: self.open], b"[", b",".join(parts), b"]", view[self.close :]))


@dataclass(eq=False)
class Parsed:
    """A request's bytes and, once known, where its messages are in them."""

    raw: bytes
    spans: Spans | None = None


def loads_chat(
    raw: bytes, max_items: int = 0, min_average: int = 0, field_name: str = "messages"
) -> tuple[dict[str, Any], Spans] | None:
    """The body and its message spans; None: parse it another way (see the module doc).

    Raises TooManyItems as soon as `messages` has more than `max_items` (0: no limit).
    `min_average`: give up (None) once the messages so far average fewer bytes than this;
    for tiny messages the stdlib parser is faster (a call per message costs ~1.5 us here).
    `field_name`: the body field holding the array ("messages", or the Responses API's
    "input")."""
    found = _FIELDS[field_name].search(raw)
    if found is None:
        return None
    element = found.end()
    if raw[element : element + 1] != b"{":
        return None
    view = memoryview(raw)
    if len(raw) <= WHOLE_ARRAY_BYTES:
        whole = _whole_array(raw, view, found.start(1), element, max_items, min_average, field_name)
        if whole is not None:
            if whole:
                whole[1].keys()  # here, where a worker thread may be parsing it
            return whole or None
    return _by_element(raw, view, found, element, max_items, min_average, field_name)


def loads_chat_fast(
    raw: bytes, max_items: int = 0, min_average: int = 0, field_name: str = "messages"
) -> tuple[dict[str, Any], Spans] | tuple[()] | None:
    """loads_chat's fast path only (one orjson call for the array, ~1.6 ms/MB, so the event
    loop can afford it for a body of a few hundred KB): () where loads_chat would answer
    None, None where it would parse element by element (give that to a worker thread)."""
    found = _FIELDS[field_name].search(raw)
    if found is None:
        return ()
    element = found.end()
    if raw[element : element + 1] != b"{":
        return ()
    return _whole_array(
        raw, memoryview(raw), found.start(1), element, max_items, min_average, field_name
    )


def _by_element(
    raw: bytes,
    view: memoryview,
    found: re.Match[bytes],
    element: int,
    max_items: int,
    min_average: int,
    field_name: str = "messages",
) -> tuple[dict[str, Any], Spans] | None:
    """loads_chat, one orjson call per element: the GIL changes hands between them."""
    messages: list[Any] = []
    starts: list[int] = []
    ends: list[int] = []
    keys: list[int] = []
    salt = _RAW_SALT
    search = _END.search
    wasted, allowance = 0, 2 * len(raw) + (1 << 16)  # spans tried that were not elements
    position = element
    while True:
        match = search(raw, position)
        if match is None:
            return None
        end = match.start() + 1
        piece = view[element:end]
        value = _element(piece)
        if value is None:
            wasted += end - element
            if wasted > allowance:
                return None
            position = end
            continue
        messages.append(value)
        starts.append(element)
        ends.append(end)
        # Here, while the bytes are in this core's cache; of a copy, as hashing a memoryview
        # hashes the whole object it views first (a 40 MB body: 30 ms holding the GIL).
        keys.append(hash(raw[element:end]) ^ salt)
        if max_items and len(messages) > max_items:
            raise TooManyItems(field_name, max_items)
        count = len(messages)
        if min_average and not count % _CHECK_EVERY and end - starts[0] < min_average * count:
            return None
        if match.group(1) is not None:
            close = match.end()
            break
        opened = _OPEN.match(raw, match.end())
        if opened is None:  # cannot happen: the lookahead saw it
            return None
        element = position = opened.end() - 1
    try:
        body = _loads_rest(b"".join((view[: found.start(1)], _SENTINEL_JSON, view[close:])))
    except (ValueError, RecursionError):
        return None
    if type(body) is not dict or body.get(field_name) != _SENTINEL:
        return None  # the array was not the top-level field (or a later one replaced it)
    body[field_name] = messages
    return body, Spans(
        raw, found.start(1), close, starts, ends, messages, keys, field_name=field_name
    )


def _whole_array(
    raw: bytes,
    view: memoryview,
    open_: int,
    element: int,
    max_items: int,
    min_average: int,
    field_name: str = "messages",
) -> tuple[dict[str, Any], Spans] | tuple[()] | None:
    """The fast path of loads_chat: the array in one orjson call (the per-element calls and
    the loop around them cost more than the parse), each element's span from the candidates
    between them. () means "not this body" (loads_chat answers None), None means "ask the
    element-by-element path" (what orjson refuses, a candidate inside a string, ...).

    Exact: the array ends at the first end candidate if the bytes up to it parse as an array
    (arrays are prefix-free; a candidate inside a string leaves them cut short). Every
    boundary between two elements (objects with a key, as the checks require) is a candidate,
    so exactly one fewer candidates before the end than elements means none of them is
    inside a string (a string ending in `},{` is the only way to make one)."""
    window = element + min_average * _CHECK_EVERY
    if min_average and window < len(raw):  # the element-by-element path's first check
        # Tiny messages are the stdlib's: the scan below costs ~0.3 us a message. At least
        # one candidate per message, so this many in the window means they are tiny.
        for seen, _ in enumerate(_CANDIDATE.finditer(raw, element, window), 1):
            if seen >= _CHECK_EVERY:
                return ()
    candidates = [(m.start(), m.end(), m.lastindex) for m in _CANDIDATE.finditer(raw, element)]
    at = next((i for i, (_, _, group) in enumerate(candidates) if group is not None), -1)
    if at < 0:
        return None
    start, close, _ = candidates[at]
    try:
        messages = orjson.loads(view[open_:close])
    except orjson.JSONDecodeError:  # a `}]` inside a string, or what orjson refuses
        return None
    if type(messages) is not list or not messages:
        return None
    count = len(messages)
    if max_items and count > max_items:
        raise TooManyItems(field_name, max_items)
    if min_average and count >= _CHECK_EVERY and close - open_ < min_average * count:
        return ()
    if at != count - 1 or not all(type(m) is dict and m for m in messages):
        return None  # a candidate inside a string: the element-by-element path sorts it out
    seps = candidates[:at]
    starts = [element]
    starts += [b for _, b, _ in seps]
    ends = [a + 1 for a, _, _ in seps]
    ends.append(start + 1)
    try:
        body = _loads_rest(b"".join((view[:open_], _SENTINEL_JSON, view[close:])))
    except (ValueError, RecursionError):
        return ()
    if type(body) is not dict or body.get(field_name) != _SENTINEL:
        return ()
    body[field_name] = messages
    return body, Spans(raw, open_, close, starts, ends, messages, whole=True, field_name=field_name)


def field_of(raw: bytes, field_name: str = "messages") -> re.Match[bytes] | None:
    """Where the parsers take the array to be: the match of its key, colon and `[`."""
    return _FIELDS[field_name].search(raw)


def extend_chat(
    raw: bytes, found: re.Match[bytes], base: Spans, max_items: int = 0, min_average: int = 0
) -> tuple[dict[str, Any], Spans] | None:
    """What `loads_chat_fast` answers for `raw`, parsing only what follows the messages of
    `base` (a body the fast path parsed, whose array up to the end of its last message `raw`
    holds at `found`, as `proxy.turnmemo` checked); None: the answer may differ, parse cold.

    Exact: the candidates `_whole_array` finds before the last of `base`'s messages are the
    same bytes, so the same ones (a candidate's match and lookaheads stop at the `}` that
    ends that message: it is none of the bytes they consume), `len(base.messages) - 1` of
    them, none an array end. The scan goes on from that `}`; every check of the fast path
    is made on the whole (counts, sizes, the rest of the body), and whatever would make it
    answer something else (a tiny-messages `()`, the element path's None, an error) answers
    None here, so the cold path decides."""
    open_, element = found.start(1), found.end()
    shift = open_ - base.open
    count = len(base.messages)
    last = base.ends[-1] + shift - 1  # the `}` of base's last message
    if element != base.starts[0] + shift:
        return None
    if min_average:
        window = element + min_average * _CHECK_EVERY
        if last + 1 < window < len(raw):  # the fast path's first check reads past base's bytes
            for seen, _ in enumerate(_CANDIDATE.finditer(raw, element, window), 1):
                if seen >= _CHECK_EVERY:
                    return None
    tail = [(m.start(), m.end(), m.lastindex) for m in _CANDIDATE.finditer(raw, last)]
    if not tail or tail[0][0] != last:
        return None
    at = next((i for i, (_, _, group) in enumerate(tail) if group is not None), -1)
    if at < 0:
        return None
    close = tail[at][1]
    view = memoryview(raw)
    new: Any = []
    if at:
        try:
            new = orjson.loads(b"".join((b"[", view[tail[0][1] : close])))
        except orjson.JSONDecodeError:
            return None
        if type(new) is not list or len(new) != at or not all(type(m) is dict and m for m in new):
            return None
    total = count + at
    if max_items and total > max_items:
        return None
    if min_average and total >= _CHECK_EVERY and close - open_ < min_average * total:
        return None
    try:
        body = _loads_rest(b"".join((view[:open_], _SENTINEL_JSON, view[close:])))
    except (ValueError, RecursionError):
        return None
    field_name = base.field_name
    if type(body) is not dict or body.get(field_name) != _SENTINEL:
        return None
    messages = base.messages + new
    body[field_name] = messages
    starts = base.starts if not shift else [s + shift for s in base.starts]
    ends = base.ends if not shift else [e + shift for e in base.ends]
    starts = starts + [b for _, b, _ in tail[:at]]
    ends = ends + [a + 1 for a, _, _ in tail[1 : at + 1]]
    keys = base._keys
    if keys is not None:
        salt = _RAW_SALT
        added = zip(starts[count:], ends[count:], strict=True)
        keys = keys + [hash(raw[a:b]) ^ salt for a, b in added]
    index = base._index
    if index is not None:
        index = dict(index)
        index.update(zip(map(id, new), range(count, total), strict=True))
    return body, Spans(
        raw,
        open_,
        close,
        starts,
        ends,
        messages,
        keys,
        index,
        True,
        base.cache.extended(),
        field_name,
    )


async def spans_of(raw: bytes, field_name: str = "messages") -> Spans | None:
    """Where the messages (or the array `field_name` holds) of a body, already parsed and
    checked some other way, are in `raw`; None: this parser cannot tell. In a worker thread
    when `raw` is big."""
    if len(raw) <= _OFFLOAD_BYTES:
        parsed = loads_chat(raw, field_name=field_name)
    else:
        parsed = await anyio.to_thread.run_sync(partial(loads_chat, raw, field_name=field_name))
    return None if parsed is None else parsed[1]


def _loads_rest(data: bytes) -> Any:
    """`json.loads(data)` for the body outside its messages (model, tools, options), by
    orjson when it reads `data` as the stdlib does: not for a run of 19 or more digits (an
    integer past 64 bits, which orjson reads as a float), and what orjson refuses (lone
    surrogates, NaN, a BOM, ...) is the stdlib's, errors included."""
    if _LONG_RUN not in data.translate(_DIGIT_RUNS):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)


def _element(piece: memoryview) -> Any:
    """The element `piece` holds, or None if it is not a whole JSON value."""
    try:
        return orjson.loads(piece)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith(_TRUNCATED):
            return None
    try:  # what orjson refuses and the stdlib reads: lone surrogates, NaN, 1e400
        return json.loads(bytes(piece))
    except (ValueError, RecursionError):
        return None
