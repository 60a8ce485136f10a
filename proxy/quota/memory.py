"""In-process ledger: one replica. Counters keep only their current window, so memory is
bounded by keys x models x retained days (and end users per key and day, capped)."""

from __future__ import annotations

from proxy.quota.ledger import (
    MAX_USERS_PER_DAY,
    OTHER_USER,
    USER_FIELDS,
    Charge,
    Counters,
    Denial,
    LimitArgs,
    RecordId,
    Reservation,
    UsageCounts,
    UsageRow,
    oldest_kept_day,
)
from proxy.quota.windows import Windows, windows_at


class _Counters:
    """One holder's quota counters, each with the window it counts (a new window starts at
    0)."""

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

    def count(self, tokens: int, reserve: int) -> None:
        self.rpm += 1
        self.tpm += tokens
        self.tpd += tokens
        self.spend_d += reserve
        self.spend_m += reserve

    def counters(self) -> Counters:
        return Counters(self.rpm, self.tpm, self.tpd, self.spend_d, self.spend_m)

    def spent(self, day: str, month: str, cost: int) -> None:
        """Spend in the windows of `day` and `month`; one of an earlier day (a batch
        written after midnight) never turns the counters back."""
        if day == self.day:
            self.spend_d += cost
        elif day > self.day:
            self.day, self.tpd, self.spend_d = day, 0, cost
        if month == self.month:
            self.spend_m += cost
        elif month > self.month:
            self.month, self.spend_m = month, cost


class MemoryLedger:
    name = "memory"
    remote = False  # a charge never waits: nothing can give its request up midway

    def __init__(self, retention_days: int = 400) -> None:
        self.errors = 0
        self.retention_days = retention_days
        self._keys: dict[str, _Counters] = {}
        self._teams: dict[str, _Counters] = {}
        # (key, team, day, model) -> counts; (key, team, day, user) -> counts
        self._usage: dict[tuple[str, str, str, str], UsageCounts] = {}
        self._users: dict[tuple[str, str, str, str], UsageCounts] = {}
        self._user_count: dict[tuple[str, str], int] = {}  # (key, day) -> distinct users
        self._oldest_kept = ""

    @staticmethod
    def _of(table: dict[str, _Counters], name: str) -> _Counters:
        found = table.get(name)
        if found is None:
            found = table[name] = _Counters()
        return found

    async def charge(
        self,
        key_id: str,
        limits: LimitArgs,
        tokens: int,
        w: Windows,
        *,
        team: str | None = None,
        team_limits: LimitArgs | None = None,
        reserve_nano: int = 0,
    ) -> Charge:
        c = self._of(self._keys, key_id)
        c.roll(w)
        denied = c.denial(limits, tokens)
        t: _Counters | None = None
        if team is not None:
            t = self._of(self._teams, team)
            t.roll(w)
            if denied is None and team_limits is not None:
                found = t.denial(team_limits, tokens)
                denied = None if found is None else f"team_{found}"  # type: ignore[assignment]
        if denied is None:
            c.count(tokens, reserve_nano)
            if t is not None:
                t.count(tokens, reserve_nano)
        return Charge(denied, c.counters(), Counters() if t is None else t.counters())

    def settle(self, reservation: Reservation, delta_nano: int) -> None:
        """Done when it returns (the next request sees it, with no task to wait for)."""
        if not delta_nano:
            return
        holders = [self._keys.get(reservation.key_id)]
        if reservation.team is not None:
            holders.append(self._teams.get(reservation.team))
        for holder in holders:
            if holder is None:
                continue
            if holder.day == reservation.day:
                holder.spend_d += delta_nano
            if holder.month == reservation.month:
                holder.spend_m += delta_nano

    async def peek(self, key_id: str, team: str | None, w: Windows) -> tuple[Counters, Counters]:
        found: list[Counters] = []
        for table, name in ((self._keys, key_id), (self._teams, team)):
            holder = table.get(name) if name is not None else None
            if holder is None:
                found.append(Counters())
                continue
            holder.roll(w)
            found.append(holder.counters())
        return found[0], found[1]

    async def record(
        self,
        key_id: str,
        model: str,
        counts: UsageCounts,
        now: float,
        *,
        record_id: RecordId | None = None,  # never resent: this backend cannot fail
        team: str | None = None,
        user: str = "",
        spend_nano: int | None = None,
    ) -> None:
        w = windows_at(now)
        entry = (key_id, team or "", w.day, model)
        found = self._usage.get(entry)
        self._usage[entry] = counts if found is None else found.plus(counts)
        if user:
            self._user_row(key_id, team or "", w.day, user, counts)
        spend = counts.cost_nano_usd if spend_nano is None else spend_nano
        if spend:
            self._of(self._keys, key_id).spent(w.day, w.month, spend)
            if team is not None:
                self._of(self._teams, team).spent(w.day, w.month, spend)
        oldest = oldest_kept_day(w.day, self.retention_days)
        if oldest != self._oldest_kept:
            self._oldest_kept = oldest
            for table in (self._usage, self._users):
                for stale in [k for k in table if k[2] < oldest]:
                    del table[stale]
            for stale_day in [k for k in self._user_count if k[1] < oldest]:
                del self._user_count[stale_day]

    def _user_row(self, key_id: str, team: str, day: str, user: str, counts: UsageCounts) -> None:
        entry = (key_id, team, day, user)
        found = self._users.get(entry)
        if found is None:
            seen = self._user_count.get((key_id, day), 0)
            if seen >= MAX_USERS_PER_DAY:
                entry = (key_id, team, day, OTHER_USER)
                found = self._users.get(entry)
            else:
                self._user_count[(key_id, day)] = seen + 1
        kept = UsageCounts(**{name: getattr(counts, name) for name in USER_FIELDS})
        self._users[entry] = kept if found is None else found.plus(kept)

    async def usage(
        self, key_ids: list[str] | None, since: str, until: str, *, users: bool = False
    ) -> list[UsageRow]:
        wanted = None if key_ids is None else set(key_ids)
        table = self._users if users else self._usage
        rows: list[UsageRow] = []
        for (key, team, day, name), counts in sorted(table.items()):
            if since <= day <= until and (wanted is None or key in wanted):
                if users:
                    rows.append(UsageRow(key, "", day, counts, team or None, name))
                else:
                    rows.append(UsageRow(key, name, day, counts, team or None))
        return rows

    async def close(self) -> None:
        return None
