"""In-process backend: the default, for a single replica.

Bounded by the size of its values (not their count: one summary can be a few hundred bytes
or tens of kilobytes) and by a TTL; the least recently used entry goes first. Its locks are
never needed (single flight within a process is enough), so it has none to share.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from cachetools import TTLCache

# Rough per-entry overhead (dict slot, key object) so tiny entries still count.
_ENTRY_OVERHEAD = 200


class MemoryBackend:
    """A TTL + byte-bounded LRU of values. `timer` is injectable for tests."""

    name = "memory"
    shared = False

    def __init__(
        self, max_bytes: int, ttl_s: float, *, timer: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_bytes = max_bytes
        self._cache: TTLCache[str, bytes] = TTLCache(
            maxsize=max_bytes, ttl=ttl_s, timer=timer, getsizeof=_sizeof
        )

    @property
    def bytes_used(self) -> int:
        return int(self._cache.currsize)

    def __len__(self) -> int:
        return len(self._cache)

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        get = self._cache.get
        return [get(key) for key in keys]

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
