"""Quota policy: a key's limits against its ledger, decided as a value, the `Verdict`.

One `charge` per request, after compaction (prompt tokens count as forwarded, so compaction
visibly saves quota) and before the request goes upstream, only for keys that have limits
(their own or their team's). The key's and its team's limits are checked in the same
atomic call.

Spend caps hold with requests in flight: a request of a key with a spend cap reserves its
estimated price (`estimate`: its prompt as forwarded, at most `max_completion_tokens` /
`max_tokens` / `max_output_tokens` completion tokens or `quota.reserve_completion_tokens`,
and what its compaction's summarizer calls cost) in the same call that admits it, and a
spend cap admits a request while what was spent plus what is reserved is under the cap.
When the request ends, the reservation is settled with what the upstream billed
(`Reservation`, see proxy.usage). So concurrent requests, on any number of replicas, see
each other's reservations, and a cap is passed by at most the price of the one request
admitted last (when the estimate bounds it: a reply longer than its bound, or a price the
table lacks, can pass it by more).

A charge once made is settled however its request ends: given up while the ledger's answer
is on its way (the client left), it is still counted or refused as the ledger decides, and
the caller's `given_up` is told which, so usage counts the requests the quota counted.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

import orjson

from proxy.auth.keys import Limits, ProxyKey
from proxy.compaction.protocol import Usage
from proxy.errors import ProxyError
from proxy.quota.ledger import (
    NANO,
    Charge,
    Counters,
    Ledger,
    LedgerUnavailable,
    LimitArgs,
    Reservation,
)
from proxy.quota.windows import Windows, duration_text, windows_at
from proxy.store.protocol import RateLimitedLog
from proxy.usage.pricing import Pricing, request_cost_nano

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
    # The price reserved for the request (a key with a spend cap, counted), to settle.
    reservation: Reservation | None = None
    # Which limit refused it ("requests_per_minute", "team_spend_usd_per_day", ...;
    # "quota_unavailable"): for the access line and the rejection metric.
    limit: str | None = None


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


# The limit names a denial stands for (config names; a team's with "team_" before them).
LIMIT_NAMES: dict[str, str] = {
    "requests": "requests_per_minute",
    "tokens_minute": "prompt_tokens_per_minute",
    "tokens_day": "prompt_tokens_per_day",
    "spend_day": "spend_usd_per_day",
    "spend_month": "spend_usd_per_month",
}
LIMIT_NAMES.update({f"team_{denial}": f"team_{name}" for denial, name in LIMIT_NAMES.items()})

Release = Callable[[Reservation], None]


class Quotas:
    def __init__(
        self,
        ledger: Ledger,
        *,
        on_error: Literal["open", "closed"] = "open",
        clock: Callable[[], float] = time.time,
        pricing: Pricing | None = None,
        summarizer_model: str | None = None,
        reserve_completion_tokens: int = 4096,
        release: Release | None = None,
    ) -> None:
        self.ledger = ledger
        self.on_error = on_error
        self.clock = clock
        self.pricing = pricing or Pricing()
        self.summarizer_model = summarizer_model
        self.reserve_completion_tokens = reserve_completion_tokens
        # Gives back the reservation of a request given up before its charge came back.
        self.release = release
        self.failed_open = 0  # requests let through unmetered while the ledger was down
        self.rejected = 0
        self._log = RateLimitedLog(log)
        self._settling: set[asyncio.Future[Charge]] = set()  # charges of requests given up
        # Reservation tokens: random per process, then counted (unique across replicas).
        self._token_prefix = os.urandom(9).hex()
        self._tokens = itertools.count()

    def counts_tokens(self, key: ProxyKey | None) -> bool:
        """Does this key's quota need the request's prompt tokens (a token limit, or a
        spend cap: the reservation prices the prompt)?"""
        if key is None:
            return False
        return key.limits.counts_tokens or key.team_limits.counts_tokens or key.spends

    def estimate(
        self,
        key: ProxyKey | None,
        body: Mapping[str, Any],
        prompt_tokens: int,
        summary: Usage | None = None,
    ) -> int:
        """Nano-dollars to reserve for a chat request of `prompt_tokens` forwarded prompt
        tokens (0 when no spend cap applies to the key): see the module's docstring."""
        if key is None or not key.spends:
            return 0
        model = body.get("model")
        model = model if isinstance(model, str) else ""
        completion = completion_bound(body, self.reserve_completion_tokens)
        return request_cost_nano(
            self.pricing, model, self.summarizer_model, summary, prompt_tokens, completion
        )

    def estimate_content(self, key: ProxyKey | None, content: object) -> int:
        """The reservation of a request on another route (embeddings, responses...), whose
        prompt is not counted: its body's bytes / 3 as prompt tokens (more than a JSON body
        of text holds), and its completion bound as for chat."""
        if key is None or not key.spends or not isinstance(content, bytes):
            return 0
        try:
            body = orjson.loads(content)
        except orjson.JSONDecodeError:
            return 0
        if not isinstance(body, dict):
            return 0
        return self.estimate(key, body, len(content) // 3 + 1)

    async def charge(
        self,
        key: ProxyKey | None,
        tokens: int,
        *,
        reserve_nano: int = 0,
        given_up: GivenUp | None = None,
    ) -> Verdict:
        """Charge one request of `tokens` forwarded prompt tokens to `key`'s quota (and its
        team's), reserving `reserve_nano` of spend, and say whether it may go. A key
        without limits is not charged.

        If the caller is cancelled while the ledger's answer is on its way (the request was
        given up), the charge still runs to its end, `given_up` is told whether it counted
        the request, and a reservation it made is given back (`release`)."""
        if key is None or not key.limited:
            return UNCHARGED
        limits = _limit_args(key.limits)
        now = self.clock()
        w = windows_at(now)
        team = key.team
        reservation: Reservation | None = None
        if team is None and not reserve_nano:
            charging = self.ledger.charge(key.id, limits, tokens, w)
        else:
            team_limits = None if team is None else _limit_args(key.team_limits)
            charging = self.ledger.charge(
                key.id, limits, tokens, w, team=team, team_limits=team_limits,
                reserve_nano=reserve_nano,
            )  # fmt: skip
            if reserve_nano:
                token = f"{self._token_prefix}{next(self._tokens):x}"
                reservation = Reservation(key.id, team, w.day, w.month, reserve_nano, token)
        try:
            if self.ledger.remote:
                charge = await self._settled(charging, given_up, reservation)
            else:
                charge = await charging
        except LedgerUnavailable as exc:
            return self._unavailable(exc)
        if charge.denied is not None:
            self.rejected += 1
            return Verdict(
                counted=False,
                refusal=_denial(key, limits, charge, tokens, w),
                limit=LIMIT_NAMES[charge.denied],
            )
        headers = rate_limit_headers(limits, charge.key, w, _REPLY_NAMES)
        if team is not None and key.team_limits.any:
            headers = _with_team(headers, key, charge, w)
        return Verdict(counted=True, headers=headers, reservation=reservation)

    async def _settled(
        self,
        charging: Awaitable[Charge],
        given_up: GivenUp | None,
        reservation: Reservation | None,
    ) -> Charge:
        """The ledger's answer, from a future of its own (a task, if the ledger gave a
        coroutine): a cancelled caller leaves it running, so a charge sent is settled as
        the ledger decides, and `given_up` hears how."""
        task = asyncio.ensure_future(charging)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._settling.add(task)  # referenced until it is done
            task.add_done_callback(functools.partial(self._settle, given_up, reservation))
            raise

    def _settle(
        self,
        given_up: GivenUp | None,
        reservation: Reservation | None,
        task: asyncio.Future[Charge],
    ) -> None:
        self._settling.discard(task)
        counted = not task.cancelled() and task.exception() is None and task.result().denied is None
        if counted and reservation is not None and self.release is not None:
            self.release(reservation)  # the request never went: nothing of it was billed
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
        return Verdict(counted=False, refusal=refusal, limit="quota_unavailable")


def completion_bound(body: Mapping[str, Any], default: int) -> int:
    """The most completion tokens a request asks for: `max_completion_tokens`, `max_tokens`
    or `max_output_tokens` (else `default`), times its `n` choices."""
    bound = default
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(name)
        if type(value) is int and value > 0:
            bound = value
            break
    n = body.get("n")
    if type(n) is int and 1 < n <= 128:
        bound *= n
    return bound


def _with_team(
    headers: dict[str, str], key: ProxyKey, charge: Charge, w: Windows
) -> dict[str, str]:
    """The reply's quota headers: the key's, and the team's for a kind (requests, tokens)
    the key has no limit of its own for."""
    team_headers = rate_limit_headers(
        _limit_args(key.team_limits), charge.team, w, _REPLY_NAMES
    )
    return {**team_headers, **headers}


def usd_text(nano: int, least: int = 2) -> str:
    """Dollars with as many decimals as the amount needs (at least `least`, at most 9):
    $0.001 stays $0.001, $0.10 is $0.10, $1.5 is $1.50."""
    text = f"{nano / NANO:.9f}".rstrip("0")
    whole, _, decimals = text.partition(".")
    return f"${whole}.{decimals.ljust(least, '0')}"


def rate_limit_headers(
    limits: LimitArgs, counters: Counters, w: Windows, names: tuple[str, ...] = _NAMES
) -> dict[str, str]:
    """x-ratelimit-{limit,remaining,reset}-{requests,tokens} (or `names` in that order)."""
    headers: dict[str, str] = {}
    minute_reset = ""
    if limits.requests:
        minute_reset = duration_text(w.minute_reset_s)
        headers[names[0]] = str(limits.requests)
        headers[names[1]] = str(max(0, limits.requests - counters.requests))
        headers[names[2]] = minute_reset
    if limits.tokens_minute:
        used, limit = counters.tokens_minute, limits.tokens_minute
        reset = minute_reset or duration_text(w.minute_reset_s)
    elif limits.tokens_day:
        used, limit, reset = counters.tokens_day, limits.tokens_day, duration_text(w.day_reset_s)
    else:
        return headers
    headers[names[3]] = str(limit)
    headers[names[4]] = str(max(0, limit - used))
    headers[names[5]] = reset
    return headers


def _denial(
    key: ProxyKey, limits: LimitArgs, charge: Charge, tokens: int, w: Windows
) -> ProxyError:
    """The 429 of a charge the ledger denied, with OpenAI's rate-limit headers (of the
    key's limits, or of its team's when the team's refused)."""
    denied: str = charge.denied or ""
    team = denied.startswith("team_")
    if team:
        limits = _limit_args(key.team_limits)
        denied = denied[5:]
    counters = charge.team if team else charge.key
    who = f"team {key.team!r} (key {key.id!r})" if team else f"key {key.id!r}"
    headers = rate_limit_headers(limits, counters, w)
    code, kind = "rate_limit_exceeded", "tokens"
    if denied == "requests":
        what, limit, used, asked, reset = (
            "requests per minute (RPM)", limits.requests, counters.requests, 1, w.minute_reset_s
        )  # fmt: skip
        kind = "requests"
    elif denied == "tokens_minute":
        what, limit, used, asked, reset = (
            "prompt tokens per minute (TPM)", limits.tokens_minute, counters.tokens_minute,
            tokens, w.minute_reset_s,
        )  # fmt: skip
    elif denied == "tokens_day":
        what, limit, used, asked, reset = (
            "prompt tokens per day (TPD)", limits.tokens_day, counters.tokens_day, tokens,
            w.day_reset_s,
        )  # fmt: skip
    else:
        daily = denied == "spend_day"
        cap = limits.spend_day_nano if daily else limits.spend_month_nano
        spent = counters.spend_day_nano if daily else counters.spend_month_nano
        reset = w.day_reset_s if daily else w.month_reset_s
        period = "daily" if daily else "monthly"
        message = (
            f"You exceeded your current quota: {who} has spent {usd_text(spent, 4)} of its "
            f"{period} cap of {usd_text(cap)} (requests in flight count at their reserved "
            f"price). It resets in {duration_text(reset)}."
        )
        return _too_many(message, "insufficient_quota", "insufficient_quota", reset, headers)
    message = (
        f"Rate limit reached for {who} on {what}: Limit {limit}, Used {used}, Requested {asked}."
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
