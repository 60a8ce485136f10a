"""Quota policy: a key's limits against its ledger, decided as a value, the `Verdict`.

One `charge` per request, after compaction (prompt tokens count as forwarded, so compaction
visibly saves quota) and before the request goes upstream, only for keys that have limits.
Spend caps compare what the key has spent so far (recorded when replies finish) with its
cap, so the request that crosses a cap still completes and the next one is refused.

A charge once made is settled however its request ends: given up while the ledger's answer
is on its way (the client left), it is still counted or refused as the ledger decides, and
the caller's `given_up` is told which, so usage counts the requests the quota counted.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Literal, NamedTuple

from proxy.auth.keys import Limits, ProxyKey
from proxy.errors import ProxyError
from proxy.quota.ledger import NANO, Charge, Ledger, LedgerUnavailable, LimitArgs
from proxy.quota.windows import Windows, duration_text, windows_at
from proxy.store.protocol import RateLimitedLog

log = logging.getLogger("proxy.quota")

# Told whether the charge of a request given up before its verdict came back counted the
# request (True) or not (refused, or the ledger could not say).
GivenUp = Callable[[bool], None]


class Verdict(NamedTuple):
    """A request's quota verdict. Allowed (`refusal` is None): the request may go, and
    `headers` are the key's remaining quota for its reply. Refused: `refusal` is the answer
    instead (429 over a limit; 503 when the ledger is down and on_redis_error = "closed").

    `counted`: the ledger counted the request, so its usage must count it too, however it
    ends. Not counted: refused, a key without limits, or let through unmetered while the
    ledger is down."""

    counted: bool
    headers: Mapping[str, str] = MappingProxyType({})
    refusal: ProxyError | None = None


UNCHARGED = Verdict(counted=False)  # no limits, or unmetered: nothing counted, no headers


# OpenAI's names: x-ratelimit-{limit,remaining,reset}-{requests,tokens}. On a normal reply
# the upstream's own pass through untouched, so the key's quota goes beside them under
# `x-compaction-ratelimit-*`; a 429 of ours carries OpenAI's own names.
_NAMES = tuple(
    f"x-ratelimit-{what}-{kind}"
    for kind in ("requests", "tokens")
    for what in ("limit", "remaining", "reset")
)
_REPLY_NAMES = tuple(f"x-compaction-{name[2:]}" for name in _NAMES)


@functools.lru_cache(maxsize=1024)
def _limit_args(limits: Limits) -> LimitArgs:
    return LimitArgs.of(limits)


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
        self._settling: set[asyncio.Future[Charge]] = set()  # charges of requests given up

    def counts_tokens(self, key: ProxyKey | None) -> bool:
        """Does this key's quota need the request's prompt tokens?"""
        if key is None:
            return False
        limits = key.limits
        return (
            limits.prompt_tokens_per_minute is not None or limits.prompt_tokens_per_day is not None
        )

    async def charge(
        self, key: ProxyKey | None, tokens: int, *, given_up: GivenUp | None = None
    ) -> Verdict:
        """Charge one request of `tokens` forwarded prompt tokens to `key`'s quota, and say
        whether it may go. A key without limits is not charged.

        If the caller is cancelled while the ledger's answer is on its way (the request was
        given up), the charge still runs to its end and `given_up` is told whether it
        counted the request."""
        if key is None or not key.limits.any:
            return UNCHARGED
        limits = _limit_args(key.limits)
        w = windows_at(self.clock())
        charging = self.ledger.charge(key.id, limits, tokens, w)
        try:
            if self.ledger.remote:
                charge = await self._settled(charging, given_up)
            else:
                charge = await charging
        except LedgerUnavailable as exc:
            return self._unavailable(exc)
        if charge.denied is not None:
            self.rejected += 1
            return Verdict(counted=False, refusal=_denial(key, limits, charge, tokens, w))
        return Verdict(counted=True, headers=rate_limit_headers(limits, charge, w, _REPLY_NAMES))

    async def _settled(self, charging: Awaitable[Charge], given_up: GivenUp | None) -> Charge:
        """The ledger's answer, from a future of its own (a task, if the ledger gave a
        coroutine): a cancelled caller leaves it running, so a charge sent is settled as
        the ledger decides, and `given_up` hears how."""
        task = asyncio.ensure_future(charging)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._settling.add(task)  # referenced until it is done
            task.add_done_callback(functools.partial(self._settle, given_up))
            raise

    def _settle(self, given_up: GivenUp | None, task: asyncio.Future[Charge]) -> None:
        self._settling.discard(task)
        counted = not task.cancelled() and task.exception() is None and task.result().denied is None
        if given_up is not None:
            given_up(counted)

    def _unavailable(self, exc: LedgerUnavailable) -> Verdict:
        """A charge the ledger could not answer: through unmetered (on_error "open") or
        refused with a 503."""
        self._log.warning(
            "quota: %s ledger unavailable (%s); requests go through %s (errors=%d)",
            self.ledger.name, exc,
            "unmetered" if self.on_error == "open" else "refused", self.ledger.errors,
        )  # fmt: skip
        if self.on_error == "open":
            self.failed_open += 1
            return UNCHARGED
        refusal = ProxyError(
            503,
            "The proxy cannot check quotas right now (its quota store is unreachable); "
            "try again shortly.",
            type="server_error",
            code="quota_unavailable",
            headers={"retry-after": "1"},
        )
        return Verdict(counted=False, refusal=refusal)


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
    key: ProxyKey, limits: LimitArgs, charge: Charge, tokens: int, w: Windows
) -> ProxyError:
    """The 429 of a charge the ledger denied, with OpenAI's rate-limit headers."""
    headers = rate_limit_headers(limits, charge, w)
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
