"""In-process backend: the default, for a single replica.

Bounded by the size of its values (not their count: one summary can be a few hundred bytes
or tens of kilobytes) and by a TTL; the least recently used entry goes first. Its locks are
never needed (single flight within a process is enough), so it has none to share.

A lookup probes every prefix of a history (hundreds of keys, nearly all absent), so the
cache keeps the set of its keys beside it: absent keys cost a set lookup, and only the
present ones go through the cache's own (expiry-checking) `get`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from cachetools import TTLCache

# Rough per-entry overhead (dict slot, key object) so tiny entries still count.
_ENTRY_OVERHEAD = 200


class _Values(TTLCache[str, bytes]):
    """A TTLCache that knows which keys it may hold (`present`): every way a key leaves it
    (deleted, evicted through `popitem`, expired through `expire`) is one of the methods
    cachetools lets a subclass extend."""

    def __init__(self, maxsize: int, ttl: float, timer: Callable[[], float]) -> None:
        super().__init__(maxsize=maxsize, ttl=ttl, timer=timer, getsizeof=_sizeof)
        self.present: set[str] = set()

    def __setitem__(self, key: str, value: bytes) -> None:
        super().__setitem__(key, value)
        self.present.add(key)

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self.present.discard(key)

    def popitem(self) -> tuple[str, bytes]:
        key, value = super().popitem()
        self.present.discard(key)
        return key, value

    def expire(self, time: float | None = None) -> list[tuple[str, bytes]]:
        expired = list(super().expire(time))
        for key, _ in expired:
            self.present.discard(key)
        return expired

    def clear(self) -> None:
        super().clear()
        self.present.clear()


class MemoryBackend:
    """A TTL + byte-bounded LRU of values. `timer` is injectable for tests."""

    name = "memory"
    shared = False

    def __init__(
        self, max_bytes: int, ttl_s: float, *, timer: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_bytes = max_bytes
        self._cache = _Values(max_bytes, ttl_s, timer)

    @property
    def bytes_used(self) -> int:
        return int(self._cache.currsize)

    def __len__(self) -> int:
        return len(self._cache)

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        present, get = self._cache.present, self._cache.get
        return [get(key) if key in present else None for key in keys]

    async def set(self, key: str, value: bytes) -> None:
        if _sizeof(value) + len(key) > self.max_bytes:
            return  # would evict everything and still not fit
        self._cache[key] = value

    async def lock(self, key: str, token: str, ttl_s: float) -> bool:
        return True  # one process: its single flight already makes each summary once

    async def unlock(self, key: str, token: str) -> None:
        return None

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        self._cache.clear()


def _sizeof(value: bytes) -> int:
    return len(value) + _ENTRY_OVERHEAD
