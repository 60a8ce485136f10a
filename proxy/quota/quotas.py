"""Quota policy: a key's limits against its ledger, as a 429 or as response headers.

One `charge` per request, after compaction (prompt tokens count as forwarded, so compaction
visibly saves quota), and only for keys that have limits. Spend caps compare what the key
has spent so far (recorded when replies finish) with its cap, so the request that crosses a
cap still completes and the next one is refused.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Literal

from proxy.auth.keys import ProxyKey
from proxy.errors import ProxyError
from proxy.headers import RawHeaders
from proxy.quota.ledger import NANO, Charge, Ledger, LedgerUnavailable, LimitArgs
from proxy.quota.windows import Windows, duration_text, whole_second, windows_at
from proxy.store.protocol import RateLimitedLog

log = logging.getLogger("proxy.quota")


class Quotas:
    def __init__(
        self,
        ledger: Ledger,
        *,
        on_error: Literal["open", "closed"] = "open",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ledger = ledger
        self.on_error = on_error
        self.clock = clock
        self.failed_open = 0  # requests let through unmetered while the ledger was down
        self.rejected = 0
        self._log = RateLimitedLog(log)
        self._quotas: dict[str, _KeyQuota] = {}
        # A ledger that answers without waiting (memory) decides a charge in `cleared`'s
        # own frame: no awaitable, no coroutine on the request's stack.
        self.charge_now: Callable[[str, LimitArgs, int, Windows], Charge] | None = getattr(
            ledger, "charge_now", None
        )

    def counts_tokens(self, key: ProxyKey | None) -> bool:
        """Does this key's quota need the request's prompt tokens?"""
        if key is None:
            return False
        limits = key.limits
        return (
            limits.prompt_tokens_per_minute is not None or limits.prompt_tokens_per_day is not None
        )

    def _quota_of(self, key: ProxyKey) -> _KeyQuota:
        """The key's limits as integers and its headers' fixed bytes, made once per key (and
        again after a key reload)."""
        found = self._quotas.get(key.id)
        if found is not None and found.key is key:
            return found
        if len(self._quotas) > 100_000:  # ids from many reloads: start over
            self._quotas.clear()
        found = self._quotas[key.id] = _KeyQuota(key)
        return found

    def charge(
        self, key: ProxyKey | None, tokens: int, settled: Settled | None = None
    ) -> Charging | None:
        """Count one request of `tokens` forwarded prompt tokens: the charge is on its way to
        the ledger when this returns, and `Charging.cleared` waits for its verdict (None: the
        key has no limits, nothing to charge). `settled(counted)`: told, instead, of the
        verdict of a charge whose request was given up before its verdict came back (see
        `Charging.abandon`)."""
        if key is None or not key.limits.any:
            return None
        quota = self._quotas.get(key.id)
        if quota is None or quota.key is not key:
            quota = self._quota_of(key)
        now = self.clock()
        charging = Charging(self, key, quota, tokens, now, settled)
        if self.charge_now is not None:
            return charging  # decided when asked for (or given up)
        # The ledger reads only the window names: the whole second's windows (one tuple a
        # second); the exact resets are worked out where a header needs them.
        charging.sent = self.ledger.charge(
            key.id, quota.limits, tokens, whole_second(now), lost=charging
        )
        return charging

    def unavailable(self, exc: LedgerUnavailable) -> None:
        """A charge the ledger could not answer: through unmetered (on_error "open") or a
        503 raised (see `Charging.cleared`)."""
        self._log.warning(
            "quota: %s ledger unavailable (%s); requests go through %s (errors=%d)",
            self.ledger.name, exc,
            "unmetered" if self.on_error == "open" else "refused", self.ledger.errors,
        )  # fmt: skip
        if self.on_error == "open":
            self.failed_open += 1
            return
        raise ProxyError(
            503,
            "The proxy cannot check quotas right now (its quota store is unreachable); "
            "try again shortly.",
            type="server_error",
            code="quota_unavailable",
            headers={"retry-after": "1"},
        ) from None

    def refusal(
        self, charge: Charge, key: ProxyKey, limits: LimitArgs, tokens: int, now: float
    ) -> ProxyError:
        """The 429 of a charge the ledger denied at `now`."""
        self.rejected += 1
        exact = windows_at(now)
        headers = rate_limit_headers(limits, charge, exact)
        return _denial(key, limits, charge, tokens, exact, headers)


# Told whether a given-up request's charge counted it (True) or not (denied, or the ledger
# could not say).
Settled = Callable[[bool], None]

# Charges settling after their request was given up (kept referenced until they are done).
_settling: set[asyncio.Task[None]] = set()


class Charging:
    """One request's charge, sent to the ledger ahead of the upstream request it admits
    (see `proxy.clearance.Clearance`): making that request and taking a pooled connection
    overlap the ledger's round trip, and nothing goes upstream before `cleared` says so.

    `cleared` raises ProxyError 429 over a limit, 503 if the ledger is down and on_error =
    "closed"; once it has cleared, `headers` are the remaining-quota headers for the reply, as
    wire bytes (made when read, after the request has gone). On a normal reply the
    upstream's own `x-ratelimit-*` pass through untouched, so the key's quota goes beside
    them as `x-compaction-ratelimit-*`; a 429 carries OpenAI's own names.

    A charge once made is settled however its request ends: given up before its verdict
    came back (the client left while it was on its way, or while a connection was taken),
    it is still counted or refused as the ledger decides, on every backend (Redis runs a
    charge sent; the memory ledger runs one given up unasked), and `settled` is told which,
    so usage can count the requests the quota counted."""

    __slots__ = (
        "_charge", "_key", "_now", "_quota", "_quotas", "_settled", "_tokens", "cleared_at", "sent",
        "settling",
    )  # fmt: skip

    def __init__(
        self,
        quotas: Quotas,
        key: ProxyKey,
        quota: _KeyQuota,
        tokens: int,
        now: float,
        settled: Settled | None,
    ) -> None:
        # The ledger's answer, until asked for (None from the start: decided when asked).
        self.sent: Awaitable[Charge] | None = None
        self._quotas, self._key, self._quota = quotas, key, quota
        self._tokens, self._now = tokens, now
        self._charge: Charge | None = None
        self._settled = settled
        # Given up before its verdict: `settled` will be told (see `abandon`, `lost`).
        self.settling = False
        self.cleared_at = 0.0  # see Clearance.cleared_at

    def cleared(self) -> Awaitable[None] | None:
        """The ledger's verdict, once (later calls return None at once): None when decided
        here (a ledger that answers at once), else the wait for the ledger's answer, in
        which the verdict is raised or the charge kept."""
        if self.cleared_at:
            return None
        self.cleared_at = -1.0  # asked: a refusal, once raised, stays one (not cleared)
        sent = self.sent
        if sent is not None:
            self.sent = None
            return self._verdict(sent)
        try:
            charge = self._decide()
        except LedgerUnavailable as exc:
            self._unmetered(exc)
            return None
        self._accept(charge)
        return None

    def _decide(self) -> Charge:
        """The charge, by a ledger that answers at once (`Quotas.charge_now`)."""
        charge_now = self._quotas.charge_now
        assert charge_now is not None  # (a charge with nothing sent is one decided here)
        quota = self._quota
        return charge_now(self._key.id, quota.limits, self._tokens, whole_second(self._now))

    async def _verdict(self, sent: Awaitable[Charge]) -> None:
        """The ledger's answer is awaited here, not in a helper coroutine: this frame is part
        of the request's stack every time it waits and resumes."""
        try:
            charge = await sent
        except asyncio.CancelledError:
            self.settling = True  # the ledger asks again and tells `lost`
            raise
        except LedgerUnavailable as exc:
            self._unmetered(exc)
            return
        self._accept(charge)

    def _accept(self, charge: Charge) -> None:
        """The ledger's verdict: the 429 raised, or the charge kept for the reply headers."""
        if charge.denied is not None:
            quota = self._quota
            raise self._quotas.refusal(charge, self._key, quota.limits, self._tokens, self._now)
        self._charge = charge
        self.cleared_at = time.perf_counter()

    def _unmetered(self, exc: LedgerUnavailable) -> None:
        """The ledger could not answer: through unmetered (no headers), or the 503 raised."""
        self._quotas.unavailable(exc)
        self.cleared_at = time.perf_counter()

    @property
    def headers(self) -> RawHeaders:
        charge = self._charge
        return [] if charge is None else self._quota.reply_headers(charge, self._now)

    def abandon(self) -> None:
        """The request was given up before asking for the verdict: the charge is settled
        all the same (sent now if it was not yet), and `settled` told whether it counted."""
        if self.cleared_at:
            return  # asked already: its verdict is the caller's
        self.cleared_at = -1.0
        sent, self.sent = self.sent, None
        self.settling = True
        if sent is None:  # a ledger that answers at once: decided now, told now
            try:
                charge: Charge | None = self._decide()
            except LedgerUnavailable:
                charge = None
            self.lost(charge)
            return
        try:
            task = asyncio.get_running_loop().create_task(self._settle(sent))
        except RuntimeError:  # no loop left (a request closed at exit): nothing to tell
            if isinstance(sent, Coroutine):
                sent.close()
            return
        _settling.add(task)
        task.add_done_callback(_settling.discard)

    async def _settle(self, sent: Awaitable[Charge]) -> None:
        try:
            charge: Charge | None = await sent
        except LedgerUnavailable:
            charge = None
        self.lost(charge)

    def lost(self, charge: Charge | None) -> None:
        """The verdict of a charge whose request was given up (None: the ledger could not
        give it): told to `settled`. The ledger calls this for a charge whose wait was
        cancelled (see `Ledger.charge`)."""
        settled = self._settled
        if settled is not None:
            settled(charge is not None and charge.denied is None)


# OpenAI's names: x-ratelimit-{limit,remaining,reset}-{requests,tokens}.
_NAMES = tuple(
    f"x-ratelimit-{what}-{kind}"
    for kind in ("requests", "tokens")
    for what in ("limit", "remaining", "reset")
)
_REPLY_NAMES = tuple(f"x-compaction-{name[2:]}" for name in _NAMES)


_RAW_REPLY_NAMES = tuple(name.encode() for name in _REPLY_NAMES)


# A whole-second reset text ("42s") holds for the rest of its second up to here (past it,
# `duration_text` may round to the next second down; kept clear of float error).
_TEXTS_HOLD_S = 0.998


class _KeyQuota:
    """One key's limits as the ledger takes them, and its reply headers as wire bytes: the
    names and limits made once per key, the reset texts once per second, so a reply only
    writes what remains."""

    __slots__ = ("_second", "_template", "key", "limits", "requests", "tokens", "tokens_at")

    def __init__(self, key: ProxyKey) -> None:
        self.key = key
        limits = self.limits = LimitArgs.of(key.limits)
        self.requests = b"%d" % limits.requests
        self.tokens = b"%d" % (limits.tokens_minute or limits.tokens_day)
        # Where the token headers start in a reply's list (-1: no token limit shown).
        self.tokens_at = -1
        if limits.tokens_minute or limits.tokens_day:
            self.tokens_at = 3 if limits.requests else 0
        self._second = -1  # the second `_template` holds for
        self._template: RawHeaders = []

    def reply_headers(self, charge: Charge, now: float) -> RawHeaders:
        """`rate_limit_headers(limits, charge, windows_at(now), _REPLY_NAMES)`, as wire bytes."""
        second = int(now)
        if second == self._second and now - second < _TEXTS_HOLD_S:
            headers = self._template.copy()
        else:
            headers = self._fixed(now)
        limits = self.limits
        if limits.requests:
            remaining = limits.requests - charge.requests
            headers[1] = (_RAW_REPLY_NAMES[1], b"%d" % (remaining if remaining > 0 else 0))
        at = self.tokens_at
        if at >= 0:
            if limits.tokens_minute:
                remaining = limits.tokens_minute - charge.tokens_minute
            else:
                remaining = limits.tokens_day - charge.tokens_day
            headers[at + 1] = (_RAW_REPLY_NAMES[4], b"%d" % (remaining if remaining > 0 else 0))
        return headers

    def _fixed(self, now: float) -> RawHeaders:
        """The reply headers at `now` with what remains left blank; kept as the template of
        the rest of this second when its reset texts hold that long."""
        limits = self.limits
        names = _RAW_REPLY_NAMES
        w = windows_at(now)
        headers: RawHeaders = []
        minute_reset = b""
        if limits.requests:
            minute_reset = duration_text(w.minute_reset_s).encode()
            headers += ((names[0], self.requests), (names[1], b""), (names[2], minute_reset))
        if self.tokens_at >= 0:
            if limits.tokens_minute:
                reset = minute_reset or duration_text(w.minute_reset_s).encode()
            else:
                reset = duration_text(w.day_reset_s).encode()
            headers += ((names[3], self.tokens), (names[4], b""), (names[5], reset))
        second = int(now)
        base = whole_second(now)
        if now - second < _TEXTS_HOLD_S and min(base.minute_reset_s, base.day_reset_s) >= 2:
            self._second, self._template = second, headers
            return headers.copy()
        self._second = -1  # under a second to a reset: its text is in ms, made per reply
        return headers


def rate_limit_headers(
    limits: LimitArgs, charge: Charge, w: Windows, names: tuple[str, ...] = _NAMES
) -> dict[str, str]:
    """x-ratelimit-{limit,remaining,reset}-{requests,tokens} (or `names` in that order)."""
    headers: dict[str, str] = {}
    minute_reset = ""
    if limits.requests:
        minute_reset = duration_text(w.minute_reset_s)
        headers[names[0]] = str(limits.requests)
        headers[names[1]] = str(max(0, limits.requests - charge.requests))
        headers[names[2]] = minute_reset
    if limits.tokens_minute:
        used, limit = charge.tokens_minute, limits.tokens_minute
        reset = minute_reset or duration_text(w.minute_reset_s)
    elif limits.tokens_day:
        used, limit, reset = charge.tokens_day, limits.tokens_day, duration_text(w.day_reset_s)
    else:
        return headers
    headers[names[3]] = str(limit)
    headers[names[4]] = str(max(0, limit - used))
    headers[names[5]] = reset
    return headers


def _denial(
    key: ProxyKey,
    limits: LimitArgs,
    charge: Charge,
    tokens: int,
    w: Windows,
    headers: dict[str, str],
) -> ProxyError:
    code, kind = "rate_limit_exceeded", "tokens"
    if charge.denied == "requests":
        what, limit, used, asked, reset = (
            "requests per minute (RPM)", limits.requests, charge.requests, 1, w.minute_reset_s
        )  # fmt: skip
        kind = "requests"
    elif charge.denied == "tokens_minute":
        what, limit, used, asked, reset = (
            "prompt tokens per minute (TPM)", limits.tokens_minute, charge.tokens_minute,
            tokens, w.minute_reset_s,
        )  # fmt: skip
    elif charge.denied == "tokens_day":
        what, limit, used, asked, reset = (
            "prompt tokens per day (TPD)", limits.tokens_day, charge.tokens_day, tokens,
            w.day_reset_s,
        )  # fmt: skip
    else:
        daily = charge.denied == "spend_day"
        cap = limits.spend_day_nano if daily else limits.spend_month_nano
        spent = charge.spend_day_nano if daily else charge.spend_month_nano
        reset = w.day_reset_s if daily else w.month_reset_s
        period = "daily" if daily else "monthly"
        message = (
            f"You exceeded your current quota: key {key.id!r} has spent ${spent / NANO:.4f} of "
            f"its {period} cap of ${cap / NANO:.2f}. It resets in {duration_text(reset)}."
        )
        return _too_many(message, "insufficient_quota", "insufficient_quota", reset, headers)
    message = (
        f"Rate limit reached for key {key.id!r} on {what}: Limit {limit}, Used {used}, "
        f"Requested {asked}."
    )
    if asked > limit:
        message += " This request alone is over the limit; make it smaller."
    else:
        message += f" Please try again in {duration_text(reset)}."
    return _too_many(message, kind, code, reset, headers)


def _too_many(
    message: str, kind: str, code: str, reset_s: float, headers: dict[str, str]
) -> ProxyError:
    retry = {
        "retry-after": str(max(1, math.ceil(reset_s))),
        "retry-after-ms": str(max(1, math.ceil(reset_s * 1000))),
    }
    return ProxyError(429, message, type=kind, code=code, headers={**headers, **retry})
