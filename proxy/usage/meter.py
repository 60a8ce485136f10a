"""Usage accounting for chat completions: what each key used, per model and day.

The upstream's own `usage` is the truth: prompt tokens as forwarded, cached prompt tokens
(`prompt_tokens_details.cached_tokens`) and completion tokens are taken from the reply
(`tap.py` reads them from the relayed bytes, streams included). When a reply carries none,
our own counts stand in and the row counts the request as estimated. Recording happens off
the hot path: counts are summed in memory per key, model and day and written in one batch
every `FLUSH_S` (so a spend cap sees spend up to that much later), and at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from operator import add
from typing import Any

import httpx
import orjson

from proxy import jsonbytes
from proxy.quota.ledger import NANO, USAGE_FIELDS, Ledger, LedgerUnavailable
from proxy.quota.windows import day_of
from proxy.report import Outcome
from proxy.settings import Settings
from proxy.store.protocol import RateLimitedLog
from proxy.usage.pricing import Pricing
from proxy.usage.tap import BodyTail, ReportedUsage, StreamTap, usage_of_body

log = logging.getLogger("proxy.usage")

COST_HEADER = "x-compaction-cost-usd"
FLUSH_S = 0.5
# Model names come from clients: kept bounded where they become stored keys.
_MODEL_CHARS = 100


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
        # (key id, model, day) -> (a timestamp in that day, sums in USAGE_FIELDS order)
        self._batch: dict[tuple[str, str, str], tuple[float, list[int]]] = {}
        self._flusher: asyncio.Task[None] | None = None  # sleeping until the next flush
        self._writing: set[asyncio.Task[None]] = set()  # flushes in progress
        self._log = RateLimitedLog(log)

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

    def tap(self, key_id: str, model: str, outcome: Outcome, *, hide_usage: bool) -> ChatTap:
        return ChatTap(self, key_id, model, outcome, hide_usage)

    def cost_nano(
        self, model: str, outcome: Outcome, prompt: int, cached: int, completion: int
    ) -> tuple[int, bool]:
        """Nano-dollars for the reply plus this request's summarizer calls; (cost, priced)."""
        price = self.pricing.price_of(model)
        usd = 0.0 if price is None else price.cost_usd(prompt, cached, completion)
        summary = outcome.usage
        if summary.input_tokens or summary.output_tokens:
            summarizer = self.pricing.price_of(self.summarizer_model or model)
            if summarizer is not None:
                usd += summarizer.cost_usd(summary.input_tokens, 0, summary.output_tokens)
        return round(usd * NANO), price is not None

    def record(self, key_id: str, model: str, counts: dict[str, int]) -> None:
        """Add one reply's counts (by USAGE_FIELDS name) to the batch."""
        self.add(key_id, model, [counts.get(name, 0) for name in USAGE_FIELDS])

    def add(self, key_id: str, model: str, values: list[int]) -> None:
        """Add one reply's counts, in USAGE_FIELDS order, to the batch; the flusher writes it
        within `flush_s`. Summed into one list per key, model and day: no dict per reply."""
        now = self.clock()
        entry = (key_id, model[:_MODEL_CHARS], day_of(now))
        found = self._batch.get(entry)
        if found is None:
            self._batch[entry] = (now, values)
        else:
            found[1][:] = map(add, found[1], values)
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_later())

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

    async def flush(self) -> None:
        """Write the batch now (one ledger call per key, model and day)."""
        batch, self._batch = self._batch, {}
        for (key_id, model, _), (now, sums) in batch.items():
            counts = {name: value for name, value in zip(USAGE_FIELDS, sums, strict=True) if value}
            try:
                await self.ledger.record(key_id, model, counts, now)
            except LedgerUnavailable as exc:
                self.errors += 1
                self._log.warning(
                    "usage: %s ledger unavailable (%s); usage of key %r not recorded "
                    "(errors=%d)", self.ledger.name, exc, key_id, self.errors,
                )  # fmt: skip

    async def join(self) -> None:
        """Write everything recorded so far (tests, shutdown)."""
        flusher = self._flusher
        if flusher is not None:
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
        self._flusher = None
        await self.flush()
        if self._writing:
            await asyncio.gather(*list(self._writing), return_exceptions=True)


# A JSON reply up to this size is parsed whole (orjson: faster than reading its end in
# Python); a larger one has its `usage` read from its end (`usage_of_body`).
WHOLE_PARSE_BYTES = 4096


def whole_usage(body: bytes, headers: httpx.Headers) -> ReportedUsage | None:
    """The `usage` of a reply read whole: what `usage_of_body` finds, sooner for small ones."""
    encoding = headers.get("content-encoding", "")
    if encoding or len(body) > WHOLE_PARSE_BYTES:
        return usage_of_body(body, encoding)
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:  # orjson refuses what json may read (huge integers)
        return usage_of_body(body)
    return ReportedUsage.parse(data.get("usage")) if type(data) is dict else None


class ChatTap:
    """One chat reply's accounting; satisfies `proxy.upstream.ReplyTap`."""

    def __init__(
        self, meter: Meter, key_id: str, model: str, outcome: Outcome, hide_usage: bool
    ) -> None:
        self.meter = meter
        self.key_id = key_id
        self.model = model
        self.outcome = outcome
        self.hide_usage = hide_usage

    def whole(self, status: int, headers: httpx.Headers, body: bytes) -> Mapping[str, str]:
        if status >= 400:
            self._finish(status, None, events=0)
            return {}
        cost, priced = self._finish(status, whole_usage(body, headers), events=0)
        if not priced:
            return {}
        return {COST_HEADER: f"{cost / NANO:.6f}"}

    async def relay(
        self, status: int, headers: httpx.Headers, chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        streaming = headers.get("content-type", "").startswith("text/event-stream")
        encoding = headers.get("content-encoding", "")
        if not streaming or status >= 400 or encoding:
            # Relayed untouched. A JSON reply too big to be read whole: its usage is read from
            # its last bytes as they pass; anything else: our own counts are recorded.
            tail = BodyTail(encoding) if status < 400 and not streaming else None
            try:
                async for chunk in chunks:
                    if tail is not None:
                        tail.feed(chunk)
                    yield chunk
            finally:
                self._finish(status, None if tail is None else tail.usage(), events=0)
            return
        tap = StreamTap(hide_usage_event=self.hide_usage)
        feed = tap.feed
        try:
            async for chunk in chunks:
                out = feed(chunk)
                if out:
                    yield out
            rest = tap.end()
            if rest:
                yield rest
        finally:
            self._finish(status, tap.usage, events=tap.events)

    def _finish(self, status: int, reported: ReportedUsage | None, events: int) -> tuple[int, bool]:
        outcome = self.outcome
        summary = outcome.usage
        if status < 400:
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
                cached, completion = reported.cached_tokens, reported.completion_tokens
            # Compaction off: nothing counted, what was sent is what was billed.
            sent = prompt if before is None else before
            saved = 0 if before is None else max(0, before - after)
        else:
            prompt = cached = completion = sent = saved = estimated = 0
        cost, priced = self.meter.cost_nano(self.model, outcome, prompt, cached, completion)
        # USAGE_FIELDS order.
        self.meter.add(self.key_id, self.model, [
            1, sent, prompt, cached, completion, summary.input_tokens, summary.output_tokens,
            saved, cost, estimated,
        ])  # fmt: skip
        return cost, priced
