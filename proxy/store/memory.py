"""In-process store: the default, for a single replica.

Bounded by the encoded size of its entries (not their count: one summary can be a few hundred
bytes or tens of kilobytes) and by a TTL; the least recently used entry goes first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import compress

from cachetools import TTLCache

from proxy.store.protocol import StoredSummary, matches, probe_range

# Rough per-entry overhead (dict slot, dataclass, key object) so tiny entries still count.
_ENTRY_OVERHEAD = 200


@dataclass(frozen=True)
class _Entry:
    summary: StoredSummary
    size: int


def _sizeof(entry: _Entry) -> int:
    return entry.size


class MemoryStore:
    """A TTL + byte-bounded LRU of summaries. `timer` is injectable for tests."""

    name = "memory"

    def __init__(
        self, max_bytes: int, ttl_s: float, *, timer: Callable[[], float] = time.monotonic
    ) -> None:
        self.available = True
        self.errors = 0
        self.max_bytes = max_bytes
        self._cache: TTLCache[str, _Entry] = TTLCache(
            maxsize=max_bytes, ttl=ttl_s, timer=timer, getsizeof=_sizeof
        )

    @property
    def bytes_used(self) -> int:
        return int(self._cache.currsize)

    def __len__(self) -> int:
        return len(self._cache)

    def _get(self, key: str) -> StoredSummary | None:
        entry = self._cache.get(key)
        return None if entry is None else entry.summary

    async def get(self, key: str) -> StoredSummary | None:
        return self._get(key)

    async def longest(self, keys: list[str], max_length: int) -> StoredSummary | None:
        probed = probe_range(keys, max_length)
        for length in range(len(probed), 0, -1):
            found = matches(self._get(probed[length - 1]), length)
            if found is not None:
                return found
        return None

    async def lookup_all(self, keys: list[str], max_length: int) -> list[StoredSummary]:
        probed = probe_range(keys, max_length)
        # A plain dict probe first (nearly every key misses), the TTL-checked get on hits only.
        data = getattr(self._cache, "_Cache__data", self._cache)
        lengths = list(compress(range(1, len(probed) + 1), map(data.__contains__, probed)))
        lengths.reverse()
        found = (matches(self._get(probed[k - 1]), k) for k in lengths)
        return [summary for summary in found if summary is not None]

    async def put(self, key: str, summary: StoredSummary) -> None:
        size = len(summary.encode()) + len(key) + _ENTRY_OVERHEAD
        if size > self.max_bytes:
            return  # would evict everything and still not fit
        self._cache[key] = _Entry(summary, size)

    async def close(self) -> None:
        self._cache.clear()
