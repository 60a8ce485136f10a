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
import mmap
import threading
from typing import Any, cast

_MARSHAL_VERSION = 2  # no back-references: the bytes depend on content only, not on sharing
_LOCK_SLICE = 512  # keys looked up per lock hold (~0.1 ms)
_MIN, _MAX = -(1 << 63), (1 << 63) - 1  # keys are Python hashes (xor-ed): signed 64-bit


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
    """A fixed-size table of counts, 16 bytes a slot, behind one lock (the event loop and
    worker threads share it).

    Flat arrays of 64-bit keys and counts, no Python object per entry: a cachetools LRUCache
    of int -> int costs ~220 bytes an entry (44 MB at the default 200k entries), this 16
    (3.2 MB), so the memory bound is `16 * max_entries` bytes whatever is counted.

    Two-way set associative: a key lives in one of the two slots of its set (key modulo the
    number of sets), the most recently used first; a new key takes the first slot and the
    other entry of its set goes, so each set drops its least recently used one. Keys are
    matched on all 64 bits, as the LRU did: a miss is possible, a wrong count is not.
    The table is anonymous memory, so RSS grows with the pages touched, not with the bound.
    """

    def __init__(self, max_entries: int) -> None:
        self._sets = max(1, max_entries // 2)  # capacity: max_entries rounded down to even
        self._new_tables()
        self._lock = threading.Lock()

    def _new_tables(self) -> None:
        """Four arrays over one anonymous mapping: zero pages that count in RSS once touched,
        so an idle memo costs nothing. A zero count slot is empty: counts are kept plus 1.

        The arrays are interleaved, each a strided view of every fourth word: a set's two
        keys and two counts are 32 adjacent bytes, so a lookup or a store touches one cache
        line and one page (whose first touch is a page fault, ~15 us on a VM) instead of
        one in each of four arrays."""
        self._map = mmap.mmap(-1, 32 * self._sets)
        words = memoryview(self._map).cast("q")
        self._keys0, self._values0, self._keys1, self._values1 = (words[i::4] for i in range(4))
        self._size = 0

    def get_many(self, keys: list[int | None]) -> list[int | None]:
        """One lock per slice of keys; None (uncacheable) is always a miss.

        Slices, not the whole list: a worker thread looking up a million keys would otherwise
        hold the lock for a second, and the event loop's next lookup would wait for all of it.
        The lookup of `_get_locked` is inlined: this runs for every message of every request.
        """
        found: list[int | None] = []
        append = found.append
        sets = self._sets
        for start in range(0, len(keys), _LOCK_SLICE):
            with self._lock:
                keys0, values0 = self._keys0, self._values0
                for key in keys[start : start + _LOCK_SLICE]:
                    if key is None:
                        append(None)
                        continue
                    at = key % sets
                    if keys0[at] == key and (value := values0[at]):
                        append(value - 1)
                    else:
                        append(self._second_locked(key, at))
        return found

    def get(self, key: int) -> int | None:
        at = key % self._sets
        with self._lock:
            if self._keys0[at] == key and (value := self._values0[at]):
                return value - 1
            return self._second_locked(key, at)

    def _second_locked(self, key: int, at: int) -> int | None:
        """A hit in the second slot moves it to the first."""
        if self._keys1[at] == key and (value := self._values1[at]):
            self._keys1[at], self._values1[at] = self._keys0[at], self._values0[at]
            self._keys0[at], self._values0[at] = key, value
            return value - 1
        return None

    def put(self, key: int, value: int) -> None:
        if not 0 <= value < _MAX or not _MIN <= key <= _MAX:  # (keys are 64-bit hashes)
            return
        stored = value + 1
        at = key % self._sets
        with self._lock:
            keys0, values0, keys1, values1 = self._keys0, self._values0, self._keys1, self._values1
            if keys0[at] == key and values0[at]:
                values0[at] = stored
            elif keys1[at] == key and values1[at]:
                values1[at] = stored
            else:  # the set's older entry goes, or an empty slot fills
                if not values1[at]:
                    self._size += 1
                keys1[at], values1[at] = keys0[at], values0[at]
                keys0[at], values0[at] = key, stored

    def __len__(self) -> int:
        return self._size

    @property
    def capacity(self) -> int:
        return 2 * self._sets

    def clear(self) -> None:
        with self._lock:
            self._new_tables()
