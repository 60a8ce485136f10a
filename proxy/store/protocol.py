"""The store seam: a stored summary's encoding and what a backend must do (bytes).

A broken store costs money (re-summarizing), never a request: backends raise
StoreUnavailable, and the one wrapper (proxy/store/store.py) answers "nothing stored".
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from proxy.report import Usage

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
    # Made ahead of need (proxy/preparer.py) and not used yet: the first request it serves
    # says so (x-compaction-prepared: used) and stores it again without the mark.
    prepared: bool = False

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
        if self.prepared:
            data["prepared"] = True
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
            prepared = data.get("prepared", False)
        except (KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"malformed stored summary: {type(exc).__name__}") from None
        ints = (length, tokens, input_tokens, output_tokens)
        if not isinstance(text, str) or not all(_is_int(v) for v in ints):
            raise ValueError("malformed stored summary: field types")
        if not isinstance(created_at, int | float) or isinstance(created_at, bool):
            raise ValueError("malformed stored summary: created_at")
        if carried is not None and not _is_int(carried):
            raise ValueError("malformed stored summary: carried")
        if not isinstance(prepared, bool):
            raise ValueError("malformed stored summary: prepared")
        usage = Usage(input_tokens, output_tokens)
        return cls(text, length, tokens, usage, float(created_at), carried, prepared)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class StoreUnavailable(Exception):
    """A backend could not answer (its server is down, slow or refusing): the store goes on
    without it for a while. The message names the failure's kind, never a credential."""


@runtime_checkable
class Backend(Protocol):
    """Bytes by key, and an expiring lock per key: all a summary store backend does.

    Matching (which entry belongs to which prefix), decoding and the outage policy live
    once, in `SummaryStore` (proxy/store/store.py). A backend raises StoreUnavailable when
    it cannot answer; anything it stores expires on its own (the backend's TTL)."""

    name: str
    # Seen by every replica (then single flight takes the backend's lock across replicas).
    shared: bool

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The value under each key (None: absent), in one round trip."""
        ...

    async def set(self, key: str, value: bytes) -> None: ...

    async def lock(self, key: str, token: str, ttl_s: float) -> bool:
        """Take the lock for `key` unless someone holds it (it expires after `ttl_s`)."""
        ...

    async def unlock(self, key: str, token: str) -> None:
        """Release it only if `token` still holds it (an expired lock may be another's)."""
        ...

    async def ping(self) -> None:
        """Raises unless the backend answers now (readiness)."""
        ...

    async def close(self) -> None: ...


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
