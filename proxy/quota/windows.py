"""Quota windows: fixed UTC minute, day and month buckets, as pure functions of a timestamp.

Fixed windows (not sliding) make a check one GET per counter and a reset time every
replica agrees on without talking to the others.
"""

from __future__ import annotations

import calendar
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Windows:
    minute: str  # "m<unix minute>"
    day: str  # "YYYY-MM-DD"
    month: str  # "YYYY-MM"
    minute_reset_s: float
    day_reset_s: float
    month_reset_s: float


_memo: tuple[int, Windows] | None = None


def windows_at(now: float) -> Windows:
    """Windows at `now`; the calendar part is computed once per second (hot path)."""
    global _memo
    second = int(now)
    memo = _memo
    if memo is None or memo[0] != second:
        memo = _memo = (second, _windows_at(float(second)))
    base = memo[1]
    if now == second:
        return base
    frac = now - second
    return Windows(
        base.minute,
        base.day,
        base.month,
        base.minute_reset_s - frac,
        base.day_reset_s - frac,
        base.month_reset_s - frac,
    )


def _windows_at(now: float) -> Windows:
    t = time.gmtime(now)
    day_start = calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0))
    next_month = (t.tm_year + (t.tm_mon == 12), t.tm_mon % 12 + 1)
    month_end = calendar.timegm((*next_month, 1, 0, 0, 0))
    return Windows(
        minute=f"m{int(now // 60)}",
        day=f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}",
        month=f"{t.tm_year:04d}-{t.tm_mon:02d}",
        minute_reset_s=60 - now % 60,
        day_reset_s=day_start + 86400 - now,
        month_reset_s=month_end - now,
    )


def day_of(now: float) -> str:
    return windows_at(now).day


def duration_text(seconds: float) -> str:
    """OpenAI's reset format: "1s", "6m0s", "2h3m4s" (sub-second as "250ms")."""
    if seconds < 1:
        return f"{max(1, int(seconds * 1000))}ms"
    total = int(seconds + 0.999)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"
