"""In-process ledger: one replica. Counters keep only their current window, so memory is
bounded by keys x models x retained days."""

from __future__ import annotations

from collections import defaultdict

from proxy.quota.ledger import (
    Charge,
    Denial,
    LimitArgs,
    LostVerdict,
    RecordId,
    UsageRow,
    oldest_kept_day,
)
from proxy.quota.windows import Windows, windows_at


class _Counters:
    """One key's quota counters, each with the window it counts (a new window starts at 0).

    One object per key, so a charge is one dict lookup and a few attribute reads."""

    __slots__ = ("day", "minute", "month", "rpm", "seen", "spend_d", "spend_m", "tpd", "tpm")

    def __init__(self) -> None:
        self.minute = self.day = self.month = ""
        self.rpm = self.tpm = self.tpd = self.spend_d = self.spend_m = 0
        self.seen: Windows | None = None  # the last windows rolled to (one tuple a second)

    def roll(self, w: Windows) -> None:
        self.seen = w
        if self.minute != w.minute:
            self.minute, self.rpm, self.tpm = w.minute, 0, 0
        if self.day != w.day:
            self.day, self.tpd, self.spend_d = w.day, 0, 0
        if self.month != w.month:
            self.month, self.spend_m = w.month, 0


class MemoryLedger:
    name = "memory"

    def __init__(self, retention_days: int = 400) -> None:
        self.errors = 0
        self.retention_days = retention_days
        self._counters: dict[str, _Counters] = {}
        self._usage: dict[tuple[str, str, str], defaultdict[str, int]] = {}
        self._oldest_kept = ""

    async def charge(
        self,
        key_id: str,
        limits: LimitArgs,
        tokens: int,
        w: Windows,
        *,
        lost: LostVerdict | None = None,  # never told: this charge never suspends
    ) -> Charge:
        return self.charge_now(key_id, limits, tokens, w)

    def charge_now(self, key_id: str, limits: LimitArgs, tokens: int, w: Windows) -> Charge:
        """`charge`, answered in the caller's frame (this backend never waits): `Quotas`
        decides a request's charge here when its verdict is asked for, with no awaitable.
        The limit check is inline: one call frame fewer per request."""
        c = self._counters.get(key_id)
        if c is None:
            c = self._counters[key_id] = _Counters()
        if c.seen is not w:
            c.roll(w)
        rpm, tpm, tpd, spend_d, spend_m = c.rpm, c.tpm, c.tpd, c.spend_d, c.spend_m
        denied: Denial | None = None
        if limits.requests and rpm + 1 > limits.requests:
            denied = "requests"
        elif limits.tokens_minute and tpm + tokens > limits.tokens_minute:
            denied = "tokens_minute"
        elif limits.tokens_day and tpd + tokens > limits.tokens_day:
            denied = "tokens_day"
        elif limits.spend_day_nano and spend_d >= limits.spend_day_nano:
            denied = "spend_day"
        elif limits.spend_month_nano and spend_m >= limits.spend_month_nano:
            denied = "spend_month"
        else:
            c.rpm = rpm = rpm + 1
            c.tpm = tpm = tpm + tokens
            c.tpd = tpd = tpd + tokens
        return tuple.__new__(Charge, (denied, rpm, tpm, tpd, spend_d, spend_m))  # see new_charge

    async def record(
        self,
        key_id: str,
        model: str,
        counts: dict[str, int],
        now: float,
        *,
        record_id: RecordId | None = None,  # never resent: this backend cannot fail
    ) -> None:
        w = windows_at(now)
        row = self._usage.setdefault((key_id, w.day, model), defaultdict(int))
        for name, value in counts.items():
            row[name] += value
        cost = counts.get("cost_nano_usd", 0)
        if cost:
            self._spent(key_id, w, cost)
        oldest = oldest_kept_day(w.day, self.retention_days)
        if oldest != self._oldest_kept:
            self._oldest_kept = oldest
            for stale in [k for k in self._usage if k[1] < oldest]:
                del self._usage[stale]

    def _spent(self, key_id: str, w: Windows, cost: int) -> None:
        """Spend of a finished request; one of an earlier day (a batch written after
        midnight) never turns the counters back."""
        c = self._counters.get(key_id)
        if c is None:
            c = self._counters[key_id] = _Counters()
        if w.day == c.day:
            c.spend_d += cost
        elif w.day > c.day:
            c.day, c.tpd, c.spend_d, c.seen = w.day, 0, cost, None
        if w.month == c.month:
            c.spend_m += cost
        elif w.month > c.month:
            c.month, c.spend_m, c.seen = w.month, cost, None

    async def usage(self, key_ids: list[str] | None, since: str, until: str) -> list[UsageRow]:
        wanted = None if key_ids is None else set(key_ids)
        return [
            UsageRow(key, model, day, dict(row))
            for (key, day, model), row in sorted(self._usage.items())
            if since <= day <= until and (wanted is None or key in wanted)
        ]

    async def close(self) -> None:
        return None
