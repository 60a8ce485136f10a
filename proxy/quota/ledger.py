"""The ledger seam: what one key used, in quota windows and in per-day usage rows.

`charge` is the one call on the hot path: it checks every limit of a key and, only if all
pass, counts the request and its forwarded prompt tokens, atomically. `record` adds what a
finished request cost (usage and spend), off the hot path. Backends: memory (one process)
and Redis (any number of replicas, single node or cluster).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

from proxy.auth.keys import Limits
from proxy.quota.windows import Windows

Denial = Literal["requests", "tokens_minute", "tokens_day", "spend_day", "spend_month"]

# Per-day usage fields, all integers (dollars as nano-dollars, so cheap requests add up).
USAGE_FIELDS = (
    "requests",
    "prompt_tokens_sent",
    "prompt_tokens_forwarded",
    "cached_prompt_tokens",
    "completion_tokens",
    "summarizer_prompt_tokens",
    "summarizer_completion_tokens",
    "tokens_saved",
    "cost_nano_usd",
    "estimated_requests",
)

NANO = 1_000_000_000  # dollars are stored as integer nano-dollars

# A usage batch's idempotency id: (writer, sequence number). A writer (one meter) numbers
# its batches in increasing order, and sends a key, model and day's next batch only once
# the one before is written; so the ledger keeps just the last number written per writer,
# model, key and day, for as long as the usage itself, and a batch resent at any time after
# it landed is recognised (no id to expire first).
RecordId = tuple[str, int]


class LedgerUnavailable(Exception):
    """The backend could not be reached (Redis down); the caller applies on_redis_error."""


class Charge(NamedTuple):
    """Counters after the check (incremented only when `denied is None`). A tuple: one is
    made per request."""

    denied: Denial | None
    requests: int = 0
    tokens_minute: int = 0
    tokens_day: int = 0
    spend_day_nano: int = 0
    spend_month_nano: int = 0


def new_charge(fields: tuple[Denial | None, int, int, int, int, int]) -> Charge:
    """`Charge(*fields)` made by the tuple type itself: a NamedTuple's own constructor is a
    Python function, a call frame more on every request."""
    return tuple.__new__(Charge, fields)


@dataclass(frozen=True)
class LimitArgs:
    """Limits as integers, 0 = unlimited (what the Lua script and the memory backend take)."""

    requests: int
    tokens_minute: int
    tokens_day: int
    spend_day_nano: int
    spend_month_nano: int

    @classmethod
    def of(cls, limits: Limits) -> LimitArgs:
        def nano(usd: float | None) -> int:
            return 0 if usd is None else max(1, round(usd * NANO))

        return cls(
            limits.requests_per_minute or 0,
            limits.prompt_tokens_per_minute or 0,
            limits.prompt_tokens_per_day or 0,
            nano(limits.spend_usd_per_day),
            nano(limits.spend_usd_per_month),
        )


@dataclass
class UsageRow:
    key: str
    model: str
    day: str
    counts: dict[str, int] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        counts = {name: self.counts.get(name, 0) for name in USAGE_FIELDS}
        cost = counts.pop("cost_nano_usd") / NANO
        return {"key": self.key, "model": self.model, "day": self.day, **counts, "cost_usd": cost}


class LostVerdict(Protocol):
    """Told the verdict of a charge whose caller stopped waiting for it (None: the ledger
    could not get it)."""

    def lost(self, charge: Charge | None) -> None: ...


class Ledger(Protocol):
    name: str  # "memory" | "redis"
    errors: int  # backend failures so far

    def charge(
        self,
        key_id: str,
        limits: LimitArgs,
        tokens: int,
        w: Windows,
        *,
        lost: LostVerdict | None = None,
    ) -> Awaitable[Charge]:
        """`w`: the windows of the request's time, computed once by the caller. A backend
        that talks to a server may send the charge before returning, so that its round trip
        overlaps what the caller does until it awaits the result (the request it admits is
        only sent upstream after that). Awaited once (by the caller, or to settle a charge
        whose request was given up first). If that wait is cancelled once the charge may
        have been sent, the backend asks again under the charge's id (counting nothing
        twice) and tells `lost` the verdict; a backend whose charge never suspends never
        sees that."""
        ...

    async def record(
        self,
        key_id: str,
        model: str,
        counts: dict[str, int],
        now: float,
        *,
        record_id: RecordId | None = None,
    ) -> None:
        """Add one batch. `record_id`: the same for every resend of one batch (made by the
        backend if None); a backend that can fail adds a batch it has seen the id of only
        once, however long after (see RecordId)."""
        ...

    async def usage(self, key_ids: list[str] | None, since: str, until: str) -> list[UsageRow]:
        """Rows for days since..until (inclusive, "YYYY-MM-DD"); all keys when None."""
        ...

    async def close(self) -> None: ...


def oldest_kept_day(day: str, retention_days: int) -> str:
    start = dt.date.fromisoformat(day) - dt.timedelta(days=retention_days - 1)
    return start.isoformat()


def days_between(since: str, until: str, limit: int = 400) -> list[str]:
    """Every "YYYY-MM-DD" from since to until inclusive (at most `limit`, newest kept)."""
    start, end = dt.date.fromisoformat(since), dt.date.fromisoformat(until)
    count = (end - start).days + 1
    if count <= 0:
        return []
    first = max(0, count - limit)
    return [(start + dt.timedelta(days=i)).isoformat() for i in range(first, count)]
