"""The ledger seam: what one key used, in quota windows and in per-day usage rows.

`charge` is the one call on the hot path: it checks every limit of a key and, only if all
pass, counts the request and its forwarded prompt tokens, atomically. `record` adds what
finished requests cost (usage and spend), off the hot path. Backends: memory (one process)
and Redis (any number of replicas, single node or cluster).
"""

from __future__ import annotations

import datetime as dt
import operator
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

from proxy.auth.keys import Limits
from proxy.quota.windows import Windows

Denial = Literal[
    "requests", "tokens_minute", "tokens_day", "spend_day", "spend_month",
    "team_requests", "team_tokens_minute", "team_tokens_day", "team_spend_day",
    "team_spend_month",
]  # fmt: skip

NANO = 1_000_000_000  # dollars are stored as integer nano-dollars, so cheap requests add up

# A usage batch's idempotency id: (writer, sequence number). A writer (one meter) numbers
# its batches in increasing order, and sends a key, model and day's next batch only once
# the one before is written; so the ledger keeps just the last number written per writer,
# model, key and day, for as long as the usage itself, and a batch resent at any time after
# it landed is recognised (no id to expire first).
RecordId = tuple[str, int]


class LedgerUnavailable(Exception):
    """The backend could not be reached (Redis down); the caller applies on_redis_error."""


class UsageCounts(NamedTuple):
    """What requests of one key and model used: one reply's, or a day's sum. All integers;
    the names are the fields of the stored usage rows."""

    requests: int = 0
    prompt_tokens_sent: int = 0  # as the client sent them (before compaction)
    prompt_tokens_forwarded: int = 0  # as the upstream billed them (or we counted them)
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    summarizer_prompt_tokens: int = 0
    summarizer_completion_tokens: int = 0
    tokens_saved: int = 0
    cost_nano_usd: int = 0
    estimated_requests: int = 0  # replies without the upstream's usage: our own counts

    def plus(self, other: UsageCounts) -> UsageCounts:
        """Field by field."""
        return UsageCounts._make(map(operator.add, self, other))

    @classmethod
    def total(cls, many: Iterable[UsageCounts]) -> UsageCounts:
        total = cls()
        for counts in many:
            total = total.plus(counts)
        return total

    def nonzero(self) -> dict[str, int]:
        """The fields that are not 0, by name."""
        return {name: value for name, value in self._asdict().items() if value}


USAGE_FIELDS = UsageCounts._fields


class Counters(NamedTuple):
    """One holder's (a key's or a team's) quota counters in the current windows. Spend is
    what finished requests cost plus what requests in flight reserved."""

    requests: int = 0
    tokens_minute: int = 0
    tokens_day: int = 0
    spend_day_nano: int = 0
    spend_month_nano: int = 0


class Charge(NamedTuple):
    """A key's counters and its team's (zero without a team) after one charge's check
    (incremented only when `denied is None`)."""

    denied: Denial | None
    key: Counters = Counters()
    team: Counters = Counters()


class Reservation(NamedTuple):
    """A request's estimated price, added to its key's (and team's) spend when it was
    admitted; settled (`Ledger.settle`) with the real price when the request ends. `token`
    makes the settlement count once, however often it is sent."""

    key_id: str
    team: str | None
    day: str
    month: str
    nano: int
    token: str


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
    """One key's usage of one model on one UTC day ("YYYY-MM-DD"), or (`user` set, `model`
    "") of one end user's requests through the key that day."""

    key: str
    model: str
    day: str
    counts: UsageCounts
    team: str | None = None
    user: str | None = None

    def as_json(self) -> dict[str, object]:
        counts: dict[str, object] = self.counts._asdict()
        cost = self.counts.cost_nano_usd / NANO
        del counts["cost_nano_usd"]
        row: dict[str, object] = {"key": self.key, "team": self.team}
        if self.user is not None:
            row["user"] = self.user
        return {**row, "model": self.model, "day": self.day, **counts, "cost_usd": cost}


# The fields kept per end user (a smaller row: one per user, key and day, all models).
USER_FIELDS = (
    "requests", "prompt_tokens_sent", "prompt_tokens_forwarded", "completion_tokens",
    "tokens_saved", "cost_nano_usd",
)  # fmt: skip
# Distinct end users kept per key and day; later ones are counted under OTHER_USER.
MAX_USERS_PER_DAY = 10_000
OTHER_USER = "(other)"


class Ledger(Protocol):
    name: str  # "memory" | "redis"
    errors: int  # backend failures so far
    # Whether a charge waits on a server. Such a charge may be in flight when its request
    # is given up: `Quotas` then leaves it running (a task of its own, unless it is a
    # future already), so it is settled all the same.
    remote: bool

    def charge(
        self,
        key_id: str,
        limits: LimitArgs,
        tokens: int,
        w: Windows,
        *,
        team: str | None = None,
        team_limits: LimitArgs | None = None,
        reserve_nano: int = 0,
    ) -> Awaitable[Charge]:
        """Check `limits` (and the team's, for a key of a team) and, if none is exceeded,
        count one request of `tokens` forwarded prompt tokens and add `reserve_nano` to the
        spend of the key (and team), atomically. A spend cap admits while what was spent
        and reserved is under it. `w`: the windows of the request's time. Raises
        LedgerUnavailable when the backend cannot answer."""
        ...

    def settle(self, reservation: Reservation, delta_nano: int) -> Awaitable[None] | None:
        """Add `delta_nano` (the real price minus the reservation) to the spend the
        reservation was added to, once per `reservation.token`: done when this returns
        (None; a backend that is not `remote`), or when the awaitable is. Raises
        LedgerUnavailable."""
        ...

    async def peek(self, key_id: str, team: str | None, w: Windows) -> tuple[Counters, Counters]:
        """A key's and its team's counters now, counting nothing (the admin page)."""
        ...

    async def record(
        self,
        key_id: str,
        model: str,
        counts: UsageCounts,
        now: float,
        *,
        record_id: RecordId | None = None,
        team: str | None = None,
        user: str = "",
        spend_nano: int | None = None,
    ) -> None:
        """Add one batch. `record_id`: the same for every resend of one batch (made by the
        backend if None); a backend that can fail adds a batch it has seen the id of only
        once, however long after (see RecordId). `user`: the end user the requests were
        for ("" none). `spend_nano`: what to add to the spend counters (default: the cost;
        less when part of it was reserved, and settled, already)."""
        ...

    async def usage(
        self, key_ids: list[str] | None, since: str, until: str, *, users: bool = False
    ) -> list[UsageRow]:
        """Rows for days since..until (inclusive, "YYYY-MM-DD"); all keys when None.
        `users`: the per end user rows instead of the per model ones."""
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
