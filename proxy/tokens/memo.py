"""Content keys for the count memo, cheap enough to compute for every message of every request.

An agent resends its whole history each turn, so the key of every old message is computed
again each time and must cost far less than tokenizing it. Canonical JSON plus a digest costs
about a quarter of tokenizing the same text, so keys are computed in C instead:

- a flat message (every value hashable: role, string content, name, tool_call_id) is keyed
  by the hash of the frozenset of its items, so key order does not matter;
- anything nested (content parts, tool calls) by the hash of its `marshal` serialization,
  which is exact (type-tagged: `1`, `1.0`, `true` and `"1"` differ) but follows key order,
  so a reordered copy misses the memo once; it can never be miscounted.

Strings hash with Python's per-process keyed SipHash, so clients cannot aim collisions at the
64-bit key. Only the integer is kept, never the message.
"""

from __future__ import annotations

import marshal
import threading
from typing import Any, cast

from cachetools import LRUCache

_MARSHAL_VERSION = 2  # no back-references: the bytes depend on content only, not on sharing
_LOCK_SLICE = 512  # keys looked up per lock hold (~0.1 ms)


def content_key(value: object) -> int | None:
    """None when `value` holds objects marshal refuses (it is then counted every time)."""
    if type(value) is dict and "tool_calls" not in value and type(value.get("content")) is not list:
        try:
            return hash(frozenset(value.items()))
        except TypeError:  # some other list or dict inside
            pass
    try:
        return hash(marshal.dumps(cast(Any, value), _MARSHAL_VERSION))
    except (ValueError, RecursionError):
        return None


class Memo:
    """A bounded LRU of counts behind one lock (the event loop and worker threads share it)."""

    def __init__(self, max_entries: int) -> None:
        self._cache: LRUCache[int, int] = LRUCache(maxsize=max_entries)
        self._lock = threading.Lock()

    def get_many(self, keys: list[int | None]) -> list[int | None]:
        """One lock per slice of keys; hits (nearly all of them) take the shortest path.

        Slices, not the whole list: a worker thread looking up a million keys would otherwise
        hold the lock for a second, and the event loop's next lookup would wait for all of it.
        """
        getitem = self._cache.__getitem__
        found: list[int | None] = []
        append = found.append
        for start in range(0, len(keys), _LOCK_SLICE):
            with self._lock:
                for key in keys[start : start + _LOCK_SLICE]:
                    try:
                        append(getitem(key))  # type: ignore[arg-type]
                    except KeyError:  # a miss, or None (uncacheable) which is never stored
                        append(None)
        return found

    def get(self, key: int) -> int | None:
        with self._lock:
            return self._cache.get(key)

    def put(self, key: int, value: int) -> None:
        with self._lock:
            self._cache[key] = value

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
