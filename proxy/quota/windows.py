"""Quota windows: fixed UTC minute, day and month buckets, as pure functions of a timestamp.

Fixed windows (not sliding) make a check one GET per counter and a reset time every
replica agrees on without talking to the others.
"""

from __future__ import annotations

import calendar
import time
from typing import NamedTuple


class Windows(NamedTuple):
    """The windows a moment falls in, and how long until each resets."""

    minute: str  # "m<unix minute>"
    day: str  # "YYYY-MM-DD"
    month: str  # "YYYY-MM"
    minute_reset_s: float
    day_reset_s: float
    month_reset_s: float


_memo: tuple[int, Windows] | None = None


def windows_at(now: float) -> Windows:
    """Windows at `now` (the resets to the fraction of a second)."""
    base = whole_second(now)
    frac = now - int(now)
    if not frac:
        return base
    return Windows(
        base.minute,
        base.day,
        base.month,
        base.minute_reset_s - frac,
        base.day_reset_s - frac,
        base.month_reset_s - frac,
    )


def whole_second(now: float) -> Windows:
    """The windows at the start of the whole second `now` falls in: the same window names as
    `windows_at(now)`, the resets in whole seconds. Memoised for the current second, so the
    calendar arithmetic runs once a second, not once a request."""
    global _memo
    second = int(now)
    memo = _memo
    if memo is None or memo[0] != second:
        memo = _memo = (second, _windows_at(float(second)))
    return memo[1]


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


_day_memo: tuple[int, str] = (-1, "")


def day_of(now: float) -> str:
    """The UTC day of `now` (memoised per day: the usage meter asks once per reply)."""
    global _day_memo
    number = int(now // 86400)
    memo = _day_memo
    if memo[0] != number:
        memo = _day_memo = (number, _windows_at(number * 86400.0).day)
    return memo[1]


_texts: dict[int, str] = {}


def duration_text(seconds: float) -> str:
    """OpenAI's reset format: "1s", "6m0s", "2h3m4s" (sub-second as "250ms"). Whole seconds
    are memoised: every reply of a keyed request carries two."""
    if seconds < 1:
        return f"{max(1, int(seconds * 1000))}ms"
    total = int(seconds + 0.999)
    text = _texts.get(total)
    if text is None:
        hours, rest = divmod(total, 3600)
        minutes, secs = divmod(rest, 60)
        if hours:
            text = f"{hours}h{minutes}m{secs}s"
        elif minutes:
            text = f"{minutes}m{secs}s"
        else:
            text = f"{secs}s"
        if len(_texts) >= 4096:
            _texts.clear()
        _texts[total] = text
    return text
