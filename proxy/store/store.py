"""The summary store: summaries by prefix key over any backend, and the outage policy.

`keys[k-1]` names the k-message prefix of a history (proxy/store/chain.py). A lookup asks
the backend for every prefix's key in one round trip, decodes what it finds, keeps only
entries that say they cover exactly the prefix their key names (a corrupt or mislabelled
entry reads as absent) and that the caller accepts (a summary may only end where a cut may
fall), longest first.

Outages fail open, once for every backend: a backend that raises StoreUnavailable makes
the store answer "nothing stored" at once for `retry_after_s` (so an outage does not stall
every request on a timeout), count the error (`errors`, exported as a metric) and log a
warning at most every 30 s. A broken store costs money (re-summarizing), never a request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal, TypeVar

from proxy.store.protocol import Backend, RateLimitedLog, StoredSummary, StoreUnavailable

log = logging.getLogger("proxy.store")
T = TypeVar("T")

LockResult = Literal["acquired", "held", "unavailable"]


class SummaryStore:
    """See the module docstring. `backend` None: the "none" store (stores nothing)."""

    def __init__(
        self,
        backend: Backend | None,
        *,
        lock_ttl_s: float = 180.0,
        retry_after_s: float = 2.0,
        where: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.name = backend.name if backend is not None else "none"
        self.shared = backend is not None and backend.shared
        self.lock_ttl_s = lock_ttl_s
        self.available = backend is not None  # False while the backend is failing
        self.errors = 0  # backend failures so far
        self.last_error: str | None = None  # the failure's kind only
        self._retry_after_s = retry_after_s
        self._retry_at = float("-inf")
        self._clock = clock
        self._where = where or self.name
        self._log = RateLimitedLog(log, clock=clock)  # outages
        self._unreadable = RateLimitedLog(log, clock=clock)

    async def _guarded(self, op: str, call: Callable[[Backend], Awaitable[T]], default: T) -> T:
        """One backend call; on an outage answer `default`, never raise (cancellation aside)."""
        backend = self.backend
        if backend is None or self._clock() < self._retry_at:
            return default
        try:
            result = await call(backend)
        except StoreUnavailable as exc:
            self.errors += 1
            self.available = False
            self.last_error = str(exc) or type(exc).__name__
            self._retry_at = self._clock() + self._retry_after_s
            self._log.warning(
                "summary store: %s %s failed at %s (%s); continuing without the store "
                "for %.1fs (errors=%d)",
                self.name, op, self._where, self.last_error, self._retry_after_s, self.errors,
            )  # fmt: skip
            return default
        self.available = True
        return result

    def _decode(self, raw: bytes | None, length: int | None = None) -> StoredSummary | None:
        if raw is None:
            return None
        try:
            summary = StoredSummary.decode(raw)
        except ValueError as exc:
            self._unreadable.warning("summary store: ignoring unreadable entry (%s)", exc)
            return None
        if length is not None and summary.length != length:
            return None  # the entry under keys[k-1] must say it covers k messages
        return summary

    async def get(self, key: str) -> StoredSummary | None:
        """The entry stored under one key."""
        empty: list[bytes | None] = [None]
        found = await self._guarded("get", lambda b: b.get_many([key]), empty)
        return self._decode(found[0] if found else None)

    async def lookup(
        self,
        keys: Sequence[str],
        max_length: int,
        accept: Callable[[int], bool] | None = None,
    ) -> list[StoredSummary]:
        """Every stored prefix k <= max_length that `accept(k)`, longest first; one round
        trip."""
        probed = list(keys[: max(0, min(max_length, len(keys)))])
        if not probed:
            return []
        empty: list[bytes | None] = []
        raws = await self._guarded("lookup", lambda b: b.get_many(probed), empty)
        found = []
        for length in range(len(raws), 0, -1):
            raw = raws[length - 1]
            if raw is None or (accept is not None and not accept(length)):
                continue
            summary = self._decode(raw, length)
            if summary is not None:
                found.append(summary)
        return found

    async def put(self, key: str, summary: StoredSummary) -> None:
        value = summary.encode()
        await self._guarded("set", lambda b: b.set(key, value), None)

    async def acquire_lock(self, key: str, token: str) -> LockResult:
        """Take the lock for `key` (it expires after `lock_ttl_s`) unless another holder has
        it; "unavailable" when the backend is down (then everyone makes their own)."""

        async def call(backend: Backend) -> LockResult:
            taken = await backend.lock(key, token, self.lock_ttl_s)
            return "acquired" if taken else "held"

        return await self._guarded("lock", call, "unavailable")

    async def release_lock(self, key: str, token: str) -> None:
        await self._guarded("unlock", lambda b: b.unlock(key, token), None)

    async def ping(self) -> None:
        """Raises unless the backend answers now (readiness: not guarded like the rest)."""
        if self.backend is not None:
            await self.backend.ping()

    async def close(self) -> None:
        if self.backend is not None:
            await self.backend.close()


def NullStore() -> SummaryStore:
    """Backend "none": stores nothing, finds nothing."""
    return SummaryStore(None)
