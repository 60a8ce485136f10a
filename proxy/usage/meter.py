"""Usage accounting for chat completions: what each key used, per model and day.

The upstream's own `usage` is the truth: prompt tokens as forwarded, cached prompt tokens
(`prompt_tokens_details.cached_tokens`) and completion tokens are taken from the reply
(`tap.py` reads them from the relayed bytes, streams included). When a reply carries none,
our own counts stand in and the row counts the request as estimated. Recording happens off
the hot path: counts are summed in memory per key, model and day and written in one batch
every `FLUSH_S` (so a spend cap sees spend up to that much later), and at shutdown.

A row whose write failed (the ledger unavailable, after its own resend) is held and written
again at the next flush, so usage during a Redis outage appears once Redis answers. Each
written row carries an idempotency id (`RecordId`: this meter's random writer id and a
number that only grows), and which id a retry uses is what keeps it exact:
- a held row is resent as it was, content and id unchanged, however long the outage: if
  its first write did land (the script ran, the reply was lost), the ledger sees the id
  and adds nothing;
- usage recorded for the same key, model and day meanwhile is not merged into it (that
  would change what the id stands for, or count the held part twice under a fresh id): it
  waits in the next batch, unsent, and goes out with a later id of its own once the held
  row is written. So one key, model and day's ids reach the ledger in order, and it need
  keep only the last one written (see `proxy.quota.ledger.RecordId`).
After one failed write a flush sends no more (the rest wait, unsent, for the next one), so
only rows actually sent are held under an id. Rows kept for a retry, held or unsent, are
bounded by `MAX_HELD_ROWS` (with the usage recorded since the last flush); one past that is
dropped, counted (`dropped_rows`, and its replies in `errors`) and warned about once per
outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import orjson

from proxy import jsonbytes
from proxy.compaction.protocol import Spend, Usage
from proxy.headers import RawHeaders
from proxy.quota.ledger import (
    NANO,
    Ledger,
    LedgerUnavailable,
    RecordId,
    Reservation,
    UsageCounts,
)
from proxy.quota.windows import day_of
from proxy.report import Outcome
from proxy.settings import Settings
from proxy.store.protocol import RateLimitedLog
from proxy.usage.pricing import Pricing, request_cost_nano
from proxy.usage.tap import BodyTail, ReportedUsage, StreamTap, usage_of_body

log = logging.getLogger("proxy.usage")

COST_HEADER = "x-compaction-cost-usd"
_COST_HEADER_RAW = COST_HEADER.encode()
FLUSH_S = 0.5
# Rows kept for a retry while the ledger is unavailable (one per key, model and day; at most
# ~1 KB each with a 100-character model name): bounds the meter during a long outage.
MAX_HELD_ROWS = 10_000
# Model names come from clients: kept bounded where they become stored keys.
_MODEL_CHARS = 100


Entry = tuple[str, str | None, str, str, str]  # key id, team, model, day, end user ("" none)
# The metrics hook (`Meter.observer`): at each flush, per key, team and model, the usage
# accounted since the last (summed: a call per series and flush, not per reply).
Observer = Callable[[str, str | None, str, UsageCounts], None]
# A failed settlement is tried again at each flush for this long (less than the ledger keeps
# its marker: proxy.quota.redis.SETTLE_TTL_S), then given up with a warning.
SETTLE_RETRY_S = 600.0
MAX_UNSETTLED = 10_000


@dataclass
class _Held:
    """A row whose write failed: resent as it was, under the same id."""

    at: float  # a timestamp in the row's day
    counts: UsageCounts  # never changed once written
    record_id: RecordId
    spend: int = 0  # what it adds to the spend counters (its unreserved requests' cost)


class Meter:
    """Per app. Accounting is on when proxy keys are (usage is kept per key)."""

    def __init__(
        self,
        settings: Settings,
        ledger: Ledger,
        pricing: Pricing,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ledger = ledger
        self.pricing = pricing
        self.clock = clock
        self.request_stream_usage = settings.quota.request_stream_usage
        self.summarizer_model = settings.compaction.summarizer.model
        self.errors = 0
        self.flush_s = FLUSH_S
        # (key id, team, model, day, user) -> (a timestamp in that day, the sum of its
        # replies' counts, what they add to the spend counters)
        self._batch: dict[Entry, tuple[float, UsageCounts, int]] = {}
        self._flusher: asyncio.Task[None] | None = None  # sleeping until the next flush
        self._writing: set[asyncio.Task[None]] = set()  # flushes in progress
        self._log = RateLimitedLog(log)
        self.max_held_rows = MAX_HELD_ROWS
        self.dropped_rows = 0  # held rows dropped past `max_held_rows`
        self._held: dict[Entry, _Held] = {}  # failed writes, resent at the next flush
        self._flushing = asyncio.Lock()  # one flush at a time: each row is held once
        self._cap_warned = False  # one warning per outage when the cap drops rows
        self._writer = os.urandom(16).hex()  # this meter's half of every RecordId
        self._written = 0  # the last RecordId number given
        self.observer: Observer | None = None
        self._observed: dict[tuple[str, str | None, str], UsageCounts] = {}  # for `observer`
        # Settlements whose write failed: (first tried at, reservation, delta), retried.
        self._unsettled: list[tuple[float, Reservation, int]] = []
        self.unsettled_dropped = 0

    def with_stream_usage(
        self, body: dict[str, Any], raw: bytes
    ) -> tuple[dict[str, Any], bytes] | None:
        """(body, bytes) asking the upstream for a usage event if the client streams without
        one; else None. Without `stream_options` in the body, the field is appended to the
        client's bytes (nothing else re-encoded)."""
        if not self.request_stream_usage or body.get("stream") is not True:
            return None
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") is True:
            return None
        extra = options if isinstance(options, dict) else {}
        asked = {**body, "stream_options": {**extra, "include_usage": True}}
        if "stream_options" not in body:
            return asked, raw.rstrip()[:-1] + b',"stream_options":{"include_usage":true}}'
        return asked, jsonbytes.forwarded(asked)

    def tap(
        self,
        key_id: str,
        model: str,
        outcome: Outcome,
        *,
        hide_usage: bool,
        spend: Spend | None = None,
        team: str | None = None,
        user: str = "",
    ) -> ChatTap:
        """`team`: the key's; `user`: the request's end user (`end_user(body)`)."""
        return ChatTap(self, key_id, model, outcome, hide_usage, spend, team, user)

    def cost_nano(
        self, model: str, summary: Usage, prompt: int, cached: int, completion: int
    ) -> tuple[int, bool]:
        """Nano-dollars for the reply plus this request's summarizer calls (`summary`);
        (cost, priced)."""
        cost = request_cost_nano(
            self.pricing, model, self.summarizer_model, summary, prompt, completion, cached
        )
        return cost, self.pricing.price_of(model) is not None

    def add(
        self,
        key_id: str,
        model: str,
        counts: UsageCounts,
        *,
        team: str | None = None,
        user: str = "",
        reserved: bool = False,
    ) -> None:
        """Add one reply's counts to the batch, summed per key, model, day and end user; the
        flusher writes it within `flush_s`. `reserved`: its cost reached the spend counters
        already (a reservation, settled)."""
        now = self.clock()
        entry = (key_id, team, model[:_MODEL_CHARS], day_of(now), user)
        spend = 0 if reserved else counts.cost_nano_usd
        found = self._batch.get(entry)
        self._batch[entry] = (
            (now, counts, spend)
            if found is None
            else (found[0], found[1].plus(counts), found[2] + spend)
        )
        if self.observer is not None:  # told at the flush, summed: once per series a flush
            seen = (key_id, team, model)
            found_seen = self._observed.get(seen)
            self._observed[seen] = counts if found_seen is None else found_seen.plus(counts)
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_later())

    def settle(self, reservation: Reservation, cost_nano: int) -> None:
        """Settle a request's reservation with what it cost (0: it never went upstream),
        now: the next request of the key sees its real spend, not the estimate. A write
        that fails is tried again at the next flushes (see SETTLE_RETRY_S)."""
        delta = cost_nano - reservation.nano
        if not delta:
            return
        if not self.ledger.remote:  # applied as it returns
            self.ledger.settle(reservation, delta)
            return
        task = asyncio.get_running_loop().create_task(self._settle(reservation, delta))
        self._writing.add(task)
        task.add_done_callback(self._writing.discard)

    async def _settle(self, reservation: Reservation, delta: int, since: float = 0.0) -> None:
        try:
            pending = self.ledger.settle(reservation, delta)
            if pending is not None:
                await pending
        except LedgerUnavailable as exc:
            now = time.monotonic()
            if now - (since or now) >= SETTLE_RETRY_S or len(self._unsettled) >= MAX_UNSETTLED:
                self.unsettled_dropped += 1
                self._log.warning(
                    "quota: a reservation of key %r could not be settled (%s): its spend "
                    "counter is off by $%.6f until the window ends",
                    reservation.key_id, exc, delta / NANO,
                )  # fmt: skip
                return
            self._unsettled.append((since or now, reservation, delta))
            if self._flusher is None:
                self._flusher = asyncio.get_running_loop().create_task(self._flush_later())

    @property
    def held_rows(self) -> int:
        """Rows held after a failed write (sent, maybe written: resent under their ids)."""
        return len(self._held)

    async def _flush_later(self) -> None:
        try:
            await asyncio.sleep(self.flush_s)
        finally:
            self._flusher = None
        task = asyncio.current_task()
        if task is not None:
            self._writing.add(task)
            task.add_done_callback(self._writing.discard)
        await self.flush()
        if (self._held or self._unsettled) and self._flusher is None:  # retried on their own
            self._flusher = asyncio.get_running_loop().create_task(self._flush_later())

    async def flush(self) -> None:
        """Write the batch now (one ledger call per key, model and day), held rows first.
        After one failed write the rest are kept unsent: the ledger is down for them too."""
        observed, self._observed = self._observed, {}
        if self.observer is not None:
            for (key_id, team, model), counts in observed.items():
                self.observer(key_id, team, model, counts)
        unsettled, self._unsettled = self._unsettled, []
        for since, reservation, delta in unsettled:
            await self._settle(reservation, delta, since)
        async with self._flushing:
            batch, self._batch = self._batch, {}
            held, self._held = self._held, {}
            down = False
            for entry, row in held.items():
                if down or not await self._write(entry, row):
                    down = True
                    self._hold(entry, row)
                    waiting = batch.pop(entry, None)
                    if waiting is not None:  # never sent: merges with what comes next
                        self._carry(entry, *waiting)
            for entry, (at, counts, spend) in batch.items():
                if down:
                    self._carry(entry, at, counts, spend)
                    continue
                self._written += 1
                row = _Held(at, counts, (self._writer, self._written), spend)
                if not await self._write(entry, row):
                    down = True
                    self._hold(entry, row)
            if not down:
                self._cap_warned = False

    async def _write(self, entry: Entry, row: _Held) -> bool:
        key_id, team, model, _, user = entry
        try:
            await self.ledger.record(
                key_id, model, row.counts, row.at, record_id=row.record_id, team=team,
                user=user, spend_nano=row.spend,
            )  # fmt: skip
        except LedgerUnavailable as exc:
            self._log.warning(
                "usage: %s ledger unavailable (%s); usage held for the next flush",
                self.ledger.name, exc,
            )  # fmt: skip
            return False
        return True

    def _room(self) -> bool:
        """Whether one more row may be kept for a retry (held, or carried to the next batch)."""
        if len(self._held) + len(self._batch) < self.max_held_rows:
            return True
        if not self._cap_warned:
            self._cap_warned = True
            log.warning(
                "usage: %s ledger unavailable and %d rows kept for it (the cap): usage of "
                "further rows is dropped until it answers (counted in "
                "compaction_proxy_usage_dropped_rows_total)", self.ledger.name, self.max_held_rows,
            )  # fmt: skip
        return False

    def _drop(self, counts: UsageCounts) -> None:
        self.dropped_rows += 1
        self.errors += counts.requests  # its replies

    def _hold(self, entry: Entry, row: _Held) -> None:
        if self._room():
            self._held[entry] = row
        else:
            self._drop(row.counts)

    def _carry(self, entry: Entry, at: float, counts: UsageCounts, spend: int) -> None:
        """Back into the batch, unsent: summed with what was recorded since."""
        found = self._batch.get(entry)
        if found is not None:
            self._batch[entry] = (found[0], found[1].plus(counts), found[2] + spend)
        elif self._room():
            self._batch[entry] = (at, counts, spend)
        else:
            self._drop(counts)

    async def join(self) -> None:
        """Write everything recorded so far (tests, shutdown)."""
        for _ in range(2):  # a flush in progress may schedule one more
            flusher = self._flusher
            if flusher is not None:
                flusher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await flusher
            self._flusher = None
            if self._writing:
                await asyncio.gather(*list(self._writing), return_exceptions=True)
        await self.flush()
        left = [row.counts for row in self._held.values()]
        left += [counts for _, counts, _ in self._batch.values()]
        if left:  # held, or unsent behind a failed write
            log.warning(
                "usage: %d rows (%d replies) still not written: the %s ledger is unavailable",
                len(left), sum(counts.requests for counts in left), self.ledger.name,
            )  # fmt: skip


# A JSON reply up to this size is parsed by orjson (faster than reading its end in Python); a
# larger one has its `usage` read from its end (`usage_of_body`).
WHOLE_PARSE_BYTES = 4096


def whole_usage(body: bytes, headers: httpx.Headers) -> ReportedUsage | None:
    """The `usage` of a reply read whole: what `usage_of_body` finds, sooner for small ones.

    A small reply's top-level `usage` is its last `"usage"` key when `{` followed by the
    bytes from that key on is one JSON object, which orjson checks while it reads only that
    tail (not the choices before it): a `"usage"` nested deeper leaves brackets to close
    over and does not parse, nor does one that is a value; one right after a backslash may
    be inside a string, so the whole reply is parsed then, as it is when the tail fails.
    """
    encoding = content_encoding(headers)
    if encoding or len(body) > WHOLE_PARSE_BYTES:
        return usage_of_body(body, encoding)
    at = body.rfind(b'"usage"')
    if at > 0 and body[at - 1] != 0x5C:  # backslash
        try:
            tail = orjson.loads(b"{" + body[at:])
        except orjson.JSONDecodeError:
            pass
        else:
            return ReportedUsage.parse(tail.get("usage"))
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:  # orjson refuses what json may read (NaN, lone surrogates)
        return usage_of_body(body)
    # Counts past 64 bits come back as floats, which `parse` refuses: estimated, as no
    # ledger could add them anyway.
    return ReportedUsage.parse(data.get("usage")) if type(data) is dict else None


def content_encoding(headers: httpx.Headers) -> str:
    """The reply's content-encoding ("" if none; several are joined by ", ", as
    `headers.get` joins them, without the KeyError `get` raises and catches when, as
    usual, the reply has none)."""
    return ", ".join(headers.get_list("content-encoding"))


def summarizer_usage(
    meter: Meter,
    key_id: str,
    model: str,
    summary: Usage,
    team: str | None = None,
    user: str = "",
) -> None:
    """Summarizer calls alone (not a request), for a key (its team, the request's end
    user) and the model of its request."""
    if not (summary.input_tokens or summary.output_tokens):
        return
    cost, _ = meter.cost_nano(model, summary, 0, 0, 0)
    meter.add(
        key_id,
        model,
        UsageCounts(
            summarizer_prompt_tokens=summary.input_tokens,
            summarizer_completion_tokens=summary.output_tokens,
            cost_nano_usd=cost,
        ),
        team=team,
        user=user,
    )


class ChatTap:
    """One chat reply's accounting; satisfies `proxy.upstream.ReplyTap`.

    `spend`: the request's summarizer calls as they answered (what the upstream billed for
    them, the compaction step finished or not); without one, the outcome's usage."""

    __slots__ = (
        "_stream", "_tail", "hide_usage", "key_id", "meter", "model", "outcome", "reservation",
        "spend", "status", "team", "user",
    )  # fmt: skip

    def __init__(
        self,
        meter: Meter,
        key_id: str,
        model: str,
        outcome: Outcome,
        hide_usage: bool,
        spend: Spend | None = None,
        team: str | None = None,
        user: str = "",
    ) -> None:
        self.meter = meter
        self.key_id = key_id
        self.model = model
        self.outcome = outcome
        self.hide_usage = hide_usage
        self.spend = spend
        self.team = team
        self.user = user
        if spend is not None:  # a summary prepared ahead of need: the key's, on its own
            spend.on_detached(partial(summarizer_usage, meter, key_id, model, team=team, user=user))
        self.status = 0
        self.reservation: Reservation | None = None
        self._stream: StreamTap | None = None
        self._tail: BodyTail | None = None

    def reserved(self, reservation: Reservation | None) -> None:
        """The price its quota charge reserved: settled with the real one when it ends."""
        self.reservation = reservation

    @property
    def summary(self) -> Usage:
        """What the request's summarizer calls cost."""
        spend = self.spend
        return self.outcome.usage if spend is None else spend.usage

    def whole(self, status: int, headers: httpx.Headers, body: bytes) -> RawHeaders:
        if status >= 400:
            self._finish(False, None, events=0)
            return []
        cost, priced = self._finish(True, whole_usage(body, headers), events=0)
        if not priced:
            return []
        return [(_COST_HEADER_RAW, b"%.6f" % (cost / NANO))]

    def body(
        self, status: int, headers: httpx.Headers, streaming: bool
    ) -> StreamTap | BodyTail | None:
        """An SSE stream goes through a `StreamTap`; a JSON reply too big to be read whole
        passes untouched while its usage is read from its last bytes; anything else (an
        error, a content-encoded stream) passes untouched and our own counts are recorded."""
        self.status = status
        if status >= 400:
            return None
        encoding = content_encoding(headers)
        if not streaming:
            tail = self._tail = BodyTail(encoding)
            return tail
        if encoding:
            return None
        stream = self._stream = StreamTap(hide_usage_event=self.hide_usage)
        return stream

    def finish(self) -> None:
        stream = self._stream
        if stream is not None:
            self._finish(self.status < 400, stream.usage, events=stream.events)
        else:
            tail = self._tail
            self._finish(self.status < 400, None if tail is None else tail.usage(), events=0)

    def cut(self, status: int) -> None:
        """The reply's status came, its body never did: as a reply without `usage`."""
        self._finish(status < 400, None, events=0)

    def unanswered(self, sent: bool) -> None:
        """No reply at all, for a request let go upstream (the client left first, or the
        upstream failed or timed out): still one request, as its quota charge counted it.
        `sent`: the upstream may have the request, so it may bill its prompt: our count of
        it is recorded, marked estimated, as for a reply without `usage` (completion: 0).
        Not sent (the connection failed): nothing it could bill."""
        self._finish(sent, None, events=0)

    def given_up(self, counted: bool) -> None:
        """Never let go upstream (refused, failed, or the client left before): `counted`,
        its quota charge counted it (the charge was made and settled though its request
        went no further), so it is one request with no tokens, as one that never reached
        the upstream; else not a request. Either way the summarizer calls its compaction
        step made were billed by the upstream, and are recorded."""
        if counted:
            self._finish(False, None, events=0)
        else:
            self._summarized(self.summary)
        if self.spend is not None:  # a call still running for another request: when it answers
            self.spend.close(self._summarized)

    def _summarized(self, summary: Usage) -> None:
        """Summarizer calls alone (not a request)."""
        summarizer_usage(self.meter, self.key_id, self.model, summary, self.team, self.user)

    def _finish(
        self, billable: bool, reported: ReportedUsage | None, events: int
    ) -> tuple[int, bool]:
        """`billable`: the upstream took the request (a status under 400, or no reply to
        tell); else it refused or never saw it, and only the request is counted."""
        outcome = self.outcome
        summary = self.summary
        if billable:
            before = outcome.tokens_before
            after = outcome.tokens_after
            if after is None:
                after = before or 0
            estimated = 0
            if reported is None:
                # Our own counts: the forwarded prompt as counted, one token per stream event.
                prompt, cached, completion = after, 0, max(0, events - 1)
                estimated = 1
            else:
                prompt = reported.prompt_tokens
                cached = reported.cached_tokens
                completion = reported.completion_tokens
            # Compaction off: nothing counted, what was sent is what was billed.
            if before is None:
                sent, saved = prompt, 0
            else:
                sent, saved = before, (before - after if before > after else 0)
        else:
            prompt = cached = completion = sent = saved = estimated = 0
        meter, model = self.meter, self.model
        cost, priced = meter.cost_nano(model, summary, prompt, cached, completion)
        reservation = self.reservation
        if reservation is not None:
            self.reservation = None  # (settled once, however the request ended)
            meter.settle(reservation, cost)
        meter.add(
            self.key_id,
            model,
            UsageCounts(
                requests=1,
                prompt_tokens_sent=sent,
                prompt_tokens_forwarded=prompt,
                cached_prompt_tokens=cached,
                completion_tokens=completion,
                summarizer_prompt_tokens=summary.input_tokens,
                summarizer_completion_tokens=summary.output_tokens,
                tokens_saved=saved,
                cost_nano_usd=cost,
                estimated_requests=estimated,
            ),
            team=self.team,
            user=self.user,
            reserved=reservation is not None,
        )
        return cost, priced


# End-user names are the client's: kept this long at most.
_USER_CHARS = 64


def end_user(body: Mapping[str, Any]) -> str:
    """The end user a request is for: its `user` field, else `safety_identifier` (OpenAI's
    newer name for the same thing, on chat and Responses requests alike), cut to 64
    characters; "" none."""
    for field in ("user", "safety_identifier"):
        user = body.get(field)
        if isinstance(user, str) and user.strip():
            return user[:_USER_CHARS].strip()
    return ""
