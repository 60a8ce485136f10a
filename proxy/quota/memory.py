"""In-process ledger: one replica. Counters keep only their current window, so memory is
bounded by keys x models x retained days."""

from __future__ import annotations

from proxy.quota.ledger import (
    Charge,
    Denial,
    LimitArgs,
    RecordId,
    UsageCounts,
    UsageRow,
    oldest_kept_day,
)
from proxy.quota.windows import Windows, windows_at


class _Counters:
    """One key's quota counters, each with the window it counts (a new window starts at 0)."""

    __slots__ = ("day", "minute", "month", "rpm", "spend_d", "spend_m", "tpd", "tpm")

    def __init__(self) -> None:
        self.minute = self.day = self.month = ""
        self.rpm = self.tpm = self.tpd = self.spend_d = self.spend_m = 0

    def roll(self, w: Windows) -> None:
        if self.minute != w.minute:
            self.minute, self.rpm, self.tpm = w.minute, 0, 0
        if self.day != w.day:
            self.day, self.tpd, self.spend_d = w.day, 0, 0
        if self.month != w.month:
            self.month, self.spend_m = w.month, 0

    def denial(self, limits: LimitArgs, tokens: int) -> Denial | None:
        """The first limit one more request of `tokens` would exceed (None: all pass)."""
        if limits.requests and self.rpm + 1 > limits.requests:
            return "requests"
        if limits.tokens_minute and self.tpm + tokens > limits.tokens_minute:
            return "tokens_minute"
        if limits.tokens_day and self.tpd + tokens > limits.tokens_day:
            return "tokens_day"
        if limits.spend_day_nano and self.spend_d >= limits.spend_day_nano:
            return "spend_day"
        if limits.spend_month_nano and self.spend_m >= limits.spend_month_nano:
            return "spend_month"
        return None


class MemoryLedger:
    name = "memory"
    remote = False  # a charge never waits: nothing can give its request up midway

    def __init__(self, retention_days: int = 400) -> None:
        self.errors = 0
        self.retention_days = retention_days
        self._counters: dict[str, _Counters] = {}
        self._usage: dict[tuple[str, str, str], UsageCounts] = {}  # (key, day, model)
        self._oldest_kept = ""

    def _of(self, key_id: str) -> _Counters:
        found = self._counters.get(key_id)
        if found is None:
            found = self._counters[key_id] = _Counters()
        return found

    async def charge(self, key_id: str, limits: LimitArgs, tokens: int, w: Windows) -> Charge:
        c = self._of(key_id)
        c.roll(w)
        denied = c.denial(limits, tokens)
        if denied is None:
            c.rpm += 1
            c.tpm += tokens
            c.tpd += tokens
        return Charge(denied, c.rpm, c.tpm, c.tpd, c.spend_d, c.spend_m)

    async def record(
        self,
        key_id: str,
        model: str,
        counts: UsageCounts,
        now: float,
        *,
        record_id: RecordId | None = None,  # never resent: this backend cannot fail
    ) -> None:
        w = windows_at(now)
        entry = (key_id, w.day, model)
        found = self._usage.get(entry)
        self._usage[entry] = counts if found is None else found.plus(counts)
        if counts.cost_nano_usd:
            self._spent(key_id, w, counts.cost_nano_usd)
        oldest = oldest_kept_day(w.day, self.retention_days)
        if oldest != self._oldest_kept:
            self._oldest_kept = oldest
            for stale in [k for k in self._usage if k[1] < oldest]:
                del self._usage[stale]

    def _spent(self, key_id: str, w: Windows, cost: int) -> None:
        """Spend of a finished request; one of an earlier day (a batch written after
        midnight) never turns the counters back."""
        c = self._of(key_id)
        if w.day == c.day:
            c.spend_d += cost
        elif w.day > c.day:
            c.day, c.tpd, c.spend_d = w.day, 0, cost
        if w.month == c.month:
            c.spend_m += cost
        elif w.month > c.month:
            c.month, c.spend_m = w.month, cost

    async def usage(self, key_ids: list[str] | None, since: str, until: str) -> list[UsageRow]:
        wanted = None if key_ids is None else set(key_ids)
        return [
            UsageRow(key, model, day, counts)
            for (key, day, model), counts in sorted(self._usage.items())
            if since <= day <= until and (wanted is None or key in wanted)
        ]

    async def close(self) -> None:
        return None
