"""The parsed state of recent chat bodies, so a resent history is parsed only where it is new.

An agent sends its whole history every turn, plus one or two new messages. Parsing, checking
and hashing the messages it already sent cost more than everything else a reused turn does
(on a 128k-token body ~1 ms of ~3). So the span parser's answer for a body (its messages,
where each one's bytes are, their byte keys) is kept here, by tenant scope and a hash of the
first `HEAD_BYTES` of the messages array; a later body whose array starts with exactly the
same bytes, up to the end of the kept body's last message, is parsed from there on
(`jsonspans.extend_chat`), and everything before comes from the kept state.

Exact: a hit is an exact byte comparison (memcmp, ~8 us for 480 KB), and what is reused is a
pure function of those bytes, so a hit answers what a cold parse would: the same body, the
same spans, the same keys (tests/test_turnmemo.py compares them, and whole requests).
Anything the cold parser could answer otherwise (messages the stdlib must read, tiny messages,
an error) is parsed cold. The message objects are shared between the requests of a session:
nothing on the request path changes a message in place (the compaction step builds new lists).

A kept body carries its session cache (proxy/sessioncache.py: token counts, store chains,
the conversation's structure), so the turn that extends it derives only what its new
messages add: this memo is the one owner of a session's derived state.

Bounded: by bytes (`cache.turn_memo_bytes`: each entry counts the body it holds, twice the
array's bytes for the parsed objects and 1,056 bytes a message for lists, keys, index, store
chains, the conversation's entries and pairing, and token counts; a 128k-token body of
481 KB costs ~1.8 MB),
by age (`TTL_S`) and by `CANDIDATES` bodies per scope and head; the least recently used goes
first. The table is empty until a request is kept. Scoped: entries of one tenant (the
summary store's scope: credential hash or proxy key id) are never found by another, so a
faster answer tells no one what someone else sent; requests without a scope are not kept.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from cachetools import TTLCache

from proxy.jsonspans import Spans, extend_chat, field_of

# The memo key hashes this many bytes from the array's `[`: the system prompt, mostly.
HEAD_BYTES = 1024
# Bodies kept per scope and head: sessions of one tenant that start alike (one system prompt).
CANDIDATES = 8
# An entry unused this long goes (agents send their next turn within seconds or minutes).
TTL_S = 600.0
# Lists of spans and keys, the id index, each dict's own overhead (~350 bytes), and the
# store chains a body keeps (2 of ~150 bytes: link, hex key), its entries and pairing (~180
# bytes measured: an entry, a partner, a call position), its token counts (2 of ~40 bytes:
# a list slot, an int).
_MESSAGE_OVERHEAD = 1056
_ENTRY_OVERHEAD = 1024

_Key = tuple[str, str, int]  # scope, the array's field, hash of the array's head


def size_of(spans: Spans) -> int:
    """What keeping `spans` holds: its body's bytes, the parsed objects (measured with
    tracemalloc at ~1.5x the array's bytes; counted 2x), and per message its bookkeeping."""
    array = spans.close - spans.open
    return len(spans.raw) + 2 * array + _MESSAGE_OVERHEAD * len(spans.messages) + _ENTRY_OVERHEAD


def _entries_size(entries: tuple[Spans, ...]) -> int:
    return sum(map(size_of, entries))


class TurnMemo:
    """Kept bodies by (scope, hash of the array's head); safe across threads."""

    def __init__(
        self, max_bytes: int, ttl_s: float = TTL_S, *, timer: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_bytes = max_bytes
        self._cache: TTLCache[_Key, tuple[Spans, ...]] = TTLCache(
            maxsize=max(1, max_bytes), ttl=ttl_s, timer=timer, getsizeof=_entries_size
        )
        self._lock = threading.Lock()
        self.hits = 0

    @property
    def bytes_used(self) -> int:
        return int(self._cache.currsize)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(entries) for entries in self._cache.values())

    def parse(
        self,
        scope: str,
        raw: bytes,
        max_items: int = 0,
        min_average: int = 0,
        field_name: str = "messages",
    ) -> tuple[dict[str, Any], Spans, Spans] | None:
        """(body, spans, the kept body it extends) when a kept body of `scope` is the start of
        `raw`'s messages (or the array `field_name` holds: the Responses API's "input") and
        the rest parses as the cold path would; None: parse it cold."""
        if not self.max_bytes:
            return None
        found = field_of(raw, field_name)
        if found is None:
            return None
        open_ = found.start(1)
        key = (scope, field_name, hash(raw[open_ : open_ + HEAD_BYTES]))
        with self._lock:
            entries = self._cache.get(key, ())
        base: Spans | None = None
        for spans in entries:
            prefix = memoryview(spans.raw)[spans.open : spans.ends[-1]]
            if (base is None or len(prefix) > base.ends[-1] - base.open) and raw.startswith(
                prefix, open_
            ):
                base = spans
        if base is None:
            return None
        extended = extend_chat(raw, found, base, max_items, min_average)
        if extended is None:
            return None
        self.hits += 1
        return extended[0], extended[1], base

    def keep(self, scope: str, spans: Spans, base: Spans | None = None) -> bool:
        """Keep `spans` (the fast path's, its array's head whole) for the scope's next turn;
        `base`, the kept body it extends, goes: a session holds one entry. False: not kept."""
        if not spans.whole or spans.ends[-1] - spans.open < HEAD_BYTES:
            return False
        if size_of(spans) > self.max_bytes:
            return False
        key = (scope, spans.field_name, hash(spans.raw[spans.open : spans.open + HEAD_BYTES]))
        with self._lock:
            entries = self._cache.get(key, ())
            kept = (spans, *(e for e in entries if e is not base and e is not spans))
            kept = kept[:CANDIDATES]
            while _entries_size(kept) > self.max_bytes:
                kept = kept[:-1]
            self._cache[key] = kept
        return True

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
