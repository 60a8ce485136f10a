"""In-process ledger: one replica. Counters keep only their current window, so memory is
bounded by keys x models x retained days."""

from __future__ import annotations

from collections import defaultdict

from proxy.quota.ledger import Charge, LimitArgs, UsageRow, decide, oldest_kept_day
from proxy.quota.windows import windows_at


class MemoryLedger:
    name = "memory"

    def __init__(self, retention_days: int = 400) -> None:
        self.errors = 0
        self.retention_days = retention_days
        self._counters: dict[tuple[str, str], tuple[str, int]] = {}
        self._usage: dict[tuple[str, str, str], defaultdict[str, int]] = {}
        self._oldest_kept = ""

    def _get(self, key_id: str, kind: str, window: str) -> int:
        found = self._counters.get((key_id, kind))
        return found[1] if found is not None and found[0] == window else 0

    def _add(self, key_id: str, kind: str, window: str, amount: int) -> int:
        value = self._get(key_id, kind, window) + amount
        self._counters[(key_id, kind)] = (window, value)
        return value

    async def charge(self, key_id: str, limits: LimitArgs, tokens: int, now: float) -> Charge:
        w = windows_at(now)
        before = Charge(
            None,
            self._get(key_id, "rpm", w.minute),
            self._get(key_id, "tpm", w.minute),
            self._get(key_id, "tpd", w.day),
            self._get(key_id, "spend_d", w.day),
            self._get(key_id, "spend_m", w.month),
        )
        denied = decide(limits, tokens, before)
        if denied is not None:
            return Charge(denied, *_counts(before))
        return Charge(
            None,
            self._add(key_id, "rpm", w.minute, 1),
            self._add(key_id, "tpm", w.minute, tokens),
            self._add(key_id, "tpd", w.day, tokens),
            before.spend_day_nano,
            before.spend_month_nano,
        )

    async def record(self, key_id: str, model: str, counts: dict[str, int], now: float) -> None:
        w = windows_at(now)
        row = self._usage.setdefault((key_id, w.day, model), defaultdict(int))
        for name, value in counts.items():
            row[name] += value
        cost = counts.get("cost_nano_usd", 0)
        if cost:
            self._add(key_id, "spend_d", w.day, cost)
            self._add(key_id, "spend_m", w.month, cost)
        oldest = oldest_kept_day(w.day, self.retention_days)
        if oldest != self._oldest_kept:
            self._oldest_kept = oldest
            for stale in [k for k in self._usage if k[1] < oldest]:
                del self._usage[stale]

    async def usage(self, key_ids: list[str] | None, since: str, until: str) -> list[UsageRow]:
        wanted = None if key_ids is None else set(key_ids)
        return [
            UsageRow(key, model, day, dict(row))
            for (key, day, model), row in sorted(self._usage.items())
            if since <= day <= until and (wanted is None or key in wanted)
        ]

    async def close(self) -> None:
        return None


def _counts(c: Charge) -> tuple[int, int, int, int, int]:
    return (c.requests, c.tokens_minute, c.tokens_day, c.spend_day_nano, c.spend_month_nano)
