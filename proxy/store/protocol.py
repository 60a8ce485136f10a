"""The store seam: what the planner needs from a summary store, whatever the backend.

Backends never raise on an outage: they answer "nothing stored" and report it through
`available` / `errors`, so a broken store costs money (re-summarizing), never a request.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from proxy.compaction.protocol import Usage

_FORMAT_VERSION = 1


@dataclass(frozen=True)
class StoredSummary:
    """A summary of the prefix messages[:length] and what it cost to make."""

    text: str
    length: int
    tokens: int
    usage: Usage
    created_at: float
    # The position of the user message forwarded verbatim after it when it was made (kept
    # on reuse, so the forwarded prefix stays the same); None: none.
    carried: int | None = None

    def encode(self) -> bytes:
        """Compact JSON; also the size the memory backend charges against its byte bound."""
        data = {
            "v": _FORMAT_VERSION,
            "text": self.text,
            "length": self.length,
            "tokens": self.tokens,
            "usage": {
                "input_tokens": self.usage.input_tokens,
                "output_tokens": self.usage.output_tokens,
            },
            "created_at": self.created_at,
        }
        if self.carried is not None:
            data["carried"] = self.carried
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode(
            "utf-8", errors="surrogatepass"
        )

    @classmethod
    def decode(cls, raw: bytes | str) -> StoredSummary:
        """Strict parse: anything unexpected (other version, wrong types) raises ValueError."""
        try:
            data: Any = json.loads(raw)
            if not isinstance(data, dict) or data.get("v") != _FORMAT_VERSION:
                raise ValueError("unknown summary format")
            usage = data["usage"]
            text, length, tokens = data["text"], data["length"], data["tokens"]
            input_tokens, output_tokens = usage["input_tokens"], usage["output_tokens"]
            created_at = data["created_at"]
            carried = data.get("carried")
        except (KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"malformed stored summary: {type(exc).__name__}") from None
        ints = (length, tokens, input_tokens, output_tokens)
        if not isinstance(text, str) or not all(_is_int(v) for v in ints):
            raise ValueError("malformed stored summary: field types")
        if not isinstance(created_at, int | float) or isinstance(created_at, bool):
            raise ValueError("malformed stored summary: created_at")
        if carried is not None and not _is_int(carried):
            raise ValueError("malformed stored summary: carried")
        usage = Usage(input_tokens, output_tokens)
        return cls(text, length, tokens, usage, float(created_at), carried)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@runtime_checkable
class SummaryStore(Protocol):
    """Summaries by prefix key (see chain.py). keys[k-1] is the key of the k-message prefix."""

    name: str  # "memory" | "redis" | "none"
    available: bool  # False while the backend is failing (or for the null store)
    errors: int  # backend failures so far

    async def get(self, key: str) -> StoredSummary | None:
        """The entry stored under one key."""
        ...

    async def longest(self, keys: list[str], max_length: int) -> StoredSummary | None:
        """The longest stored prefix k <= max_length. One round trip."""
        ...

    async def lookup_all(self, keys: list[str], max_length: int) -> list[StoredSummary]:
        """Every stored prefix k <= max_length, longest first. One round trip."""
        ...

    async def put(self, key: str, summary: StoredSummary) -> None: ...

    async def close(self) -> None: ...


LockResult = Literal["acquired", "held", "unavailable"]


@runtime_checkable
class LockingStore(SummaryStore, Protocol):
    """A store shared by several replicas, with an expiring lock per key for single flight."""

    lock_ttl_s: float

    async def acquire_lock(self, key: str, token: str) -> LockResult:
        """Take the lock for `key` unless another holder has it; never raises on outage."""
        ...

    async def release_lock(self, key: str, token: str) -> None:
        """Release only if `token` still holds it (an expired lock may belong to someone else)."""
        ...


class NullStore:
    """Backend "none": stores nothing, finds nothing."""

    name = "none"

    def __init__(self) -> None:
        self.available = False
        self.errors = 0

    async def get(self, key: str) -> StoredSummary | None:
        return None

    async def longest(self, keys: list[str], max_length: int) -> StoredSummary | None:
        return None

    async def lookup_all(self, keys: list[str], max_length: int) -> list[StoredSummary]:
        return []

    async def put(self, key: str, summary: StoredSummary) -> None:
        return None

    async def close(self) -> None:
        return None


def probe_range(keys: list[str], max_length: int) -> list[str]:
    """The keys a lookup probes: prefixes 1..min(max_length, len(keys))."""
    return keys[: max(0, min(max_length, len(keys)))]


def matches(summary: StoredSummary | None, length: int) -> StoredSummary | None:
    """Guard against a corrupt entry: the one under keys[k-1] must say it covers k messages."""
    if summary is None or summary.length != length:
        return None
    return summary


class RateLimitedLog:
    """At most one warning per interval, so an outage doesn't flood the log on every request."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._last: float | None = None
        self.suppressed = 0

    def warning(self, msg: str, *args: object) -> None:
        now = self._clock()
        if self._last is not None and now - self._last < self._interval_s:
            self.suppressed += 1
            return
        self._last = now
        if self.suppressed:
            msg += " (%d similar warnings suppressed)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        self._logger.warning(msg, *args)
