"""Redis ledger: quota counters and usage shared by every replica, through redis-py.

Every key of one proxy key id carries the hash tag `{<id>}`, so on a Redis Cluster they
share a slot and the charge script (read every counter, decide, increment) runs atomically
on one node: a charge is one EVALSHA, one round trip (the script is loaded and the command
sent again when Redis answers NOSCRIPT, as redis-py's registered scripts do). Charges asked
for at the same time (in one event-loop iteration) share that round trip: they go out as
one pipeline, each script still run on its own. `record` (off the hot path: the meter's
batch) is one script beside the key's counters, then one SADD to the key index.

A charge is idempotent: each carries an id, and the script keeps its result under
`<prefix>{<id>}:charge:<charge id>` (same slot) for `_CHARGE_TTL_S`. Resent with the same id
(after a dropped connection the ledger sends a call once more, and the script may already
have run), it returns the stored result instead of counting the request twice, and a stale
pooled connection costs no fail-open window. Memory: one short string key (~150 bytes with
its expiry) per charge for 60 s, so charges/s x 60 live keys: 1,000 charges/s hold ~60,000
keys, ~9 MB.

A usage write is idempotent too: each `record` carries its writer's id and a sequence
number (`RecordId`), and the script adds the counts only if that number is above the last
one it wrote for the writer and model, kept in the hash `<prefix>{<id>}:writes:<day>` (same
slot, one field of ~60 bytes per writer and model, kept `_DAY_TTL_S` past the day's last
write). So a write resent after a dropped connection (a reply lost after the script ran),
or held by the meter through an outage (of up to two days) and resent then, is counted
once, not lost, and not an outage.

While Redis is failing, calls raise LedgerUnavailable at once for `retry_after_s` instead of
waiting on a timeout per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError

from proxy.quota.ledger import (
    USAGE_FIELDS,
    Charge,
    LedgerUnavailable,
    LimitArgs,
    RecordId,
    UsageCounts,
    UsageRow,
    days_between,
)
from proxy.quota.windows import Windows, windows_at
from proxy.store.connect import RedisClient

T = TypeVar("T")

# The result, stored under the charge id and returned, is one JSON array (denial, then the
# five counters): one string to read back. The counters are read in one MGET and get their
# expiry only from the charge that creates them (a window's key is named by its window: its
# TTL only has to outlast it).
_CHARGE_LUA = """
local seen = redis.call('GET', KEYS[6])
if seen then
  return seen
end
local v = redis.call('MGET', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
local r, tm, td = tonumber(v[1] or '0'), tonumber(v[2] or '0'), tonumber(v[3] or '0')
local sd, sm = tonumber(v[4] or '0'), tonumber(v[5] or '0')
local lr, ltm, ltd = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local lsd, lsm = tonumber(ARGV[4]), tonumber(ARGV[5])
local tokens = tonumber(ARGV[6])
local denied = ''
if lr > 0 and r + 1 > lr then denied = 'requests'
elseif ltm > 0 and tm + tokens > ltm then denied = 'tokens_minute'
elseif ltd > 0 and td + tokens > ltd then denied = 'tokens_day'
elseif lsd > 0 and sd >= lsd then denied = 'spend_day'
elseif lsm > 0 and sm >= lsm then denied = 'spend_month'
end
if denied == '' then
  if lr > 0 then
    r = redis.call('INCR', KEYS[1])
    if not v[1] then redis.call('EXPIRE', KEYS[1], ARGV[7]) end
  end
  if ltm > 0 and tokens > 0 then
    tm = redis.call('INCRBY', KEYS[2], tokens)
    if not v[2] then redis.call('EXPIRE', KEYS[2], ARGV[7]) end
  end
  if ltd > 0 and tokens > 0 then
    td = redis.call('INCRBY', KEYS[3], tokens)
    if not v[3] then redis.call('EXPIRE', KEYS[3], ARGV[8]) end
  end
end
local result = string.format('["%s",%d,%d,%d,%d,%d]', denied, r, tm, td, sd, sm)
redis.call('SET', KEYS[6], result, 'EX', ARGV[9])
return result
"""

# KEYS: usage hash, spend day, spend month, the day's writes hash. ARGV: usage TTL, day TTL,
# month TTL, the writer's field, the batch's sequence number, cost in nano-dollars, then
# field, increment pairs.
_RECORD_LUA = """
local last = redis.call('HGET', KEYS[4], ARGV[4])
if last and tonumber(last) >= tonumber(ARGV[5]) then
  return 0
end
redis.call('HSET', KEYS[4], ARGV[4], ARGV[5])
redis.call('EXPIRE', KEYS[4], ARGV[2])
for i = 7, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
local cost = tonumber(ARGV[6])
if cost ~= 0 then
  redis.call('INCRBY', KEYS[2], cost); redis.call('EXPIRE', KEYS[2], ARGV[2])
  redis.call('INCRBY', KEYS[3], cost); redis.call('EXPIRE', KEYS[3], ARGV[3])
end
return 1
"""

_OUTAGE = (RedisError, OSError, TimeoutError)
_MINUTE_TTL_S = 120
_DAY_TTL_S = 2 * 86400
_MONTH_TTL_S = 32 * 86400
_CHARGE_TTL_S = 60  # a charge's stored result: longer than any timeout plus one resend
_SEP = "\n"  # between model and field in a usage hash (model names never hold one)

# A charge waiting to be sent: its script's keys and arguments, and where its result goes.
_Queued = tuple[list[str], list[int], "asyncio.Future[Charge]"]


def _charge_of(result: bytes | str) -> Charge:
    """The charge script's result: `["<denial or empty>", requests, tokens per minute, tokens
    per day, spend today, spend this month]`."""
    denied, *counts = orjson.loads(result)
    return Charge(denied or None, *counts)


class RedisLedger:
    name = "redis"
    remote = True

    def __init__(
        self,
        client: RedisClient,
        key_prefix: str,
        *,
        retention_days: int = 400,
        retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # redis-py never sends a command again: one whose reply was lost may have run.
        # Charges and usage writes are idempotent (their ids): the ledger sends those again
        # itself, once, after a dropped connection (see `_guarded`).
        client.set_retry(Retry(NoBackoff(), 0))
        self.client = client
        self.prefix = key_prefix
        self.retention_days = retention_days
        self.errors = 0
        self.last_error: str | None = None
        self._retry_after_s = retry_after_s
        self._retry_at = float("-inf")
        self._clock = clock
        self._charge = client.register_script(_CHARGE_LUA)
        self._record = client.register_script(_RECORD_LUA)
        # Charge ids: random per ledger, then counted: unique across replicas and restarts.
        self._id_prefix = os.urandom(12).hex()
        self._ids = itertools.count()
        # Charges waiting to go out together (see `charge`), and the task sending them.
        self._queue: list[_Queued] = []
        self._senders: set[asyncio.Task[None]] = set()

    def key(self, key_id: str, *parts: str) -> str:
        return ":".join([f"{self.prefix}{{{key_id}}}", *parts])

    @property
    def index_key(self) -> str:
        return f"{self.prefix}usage-keys"

    async def _guarded(self, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`, sent once more after a dropped connection (a stale pooled one, or a
        reply lost after the command ran: safe, every call here is idempotent), never after
        a timeout (that would double the stall). A failure is an outage: LedgerUnavailable,
        now and for `retry_after_s`."""
        if self._clock() < self._retry_at:
            raise LedgerUnavailable(self.last_error or "redis unavailable")
        try:
            try:
                return await call()
            except RedisConnectionError:
                return await call()
        except _OUTAGE as exc:
            self.errors += 1
            self.last_error = type(exc).__name__
            self._retry_at = self._clock() + self._retry_after_s
            raise LedgerUnavailable(self.last_error) from exc

    def charge(
        self,
        key_id: str,
        limits: LimitArgs,
        tokens: int,
        w: Windows,
        *,
        charge_id: str | None = None,
    ) -> asyncio.Future[Charge]:
        """The charge's result, to come: it goes to Redis with the others asked for in this
        event-loop iteration (concurrent requests), as one pipeline: one write and one read
        for all of them, instead of a pooled connection and a round trip each. Redis still
        runs each script on its own, atomically, so limits stay exact. The future is the
        ledger's own: a caller that stops waiting does not stop the charge.

        `charge_id`: the same for every resend of one request's charge (made here if None);
        a second charge with an id already seen returns the first one's result."""
        if charge_id is None:
            charge_id = f"{self._id_prefix}{next(self._ids):016x}"
        keys = [
            self.key(key_id, "rpm", w.minute),
            self.key(key_id, "tpm", w.minute),
            self.key(key_id, "tpd", w.day),
            self.key(key_id, "spend", w.day),
            self.key(key_id, "spend", w.month),
            self.key(key_id, "charge", charge_id),
        ]
        args = [
            limits.requests,
            limits.tokens_minute,
            limits.tokens_day,
            limits.spend_day_nano,
            limits.spend_month_nano,
            tokens,
            _MINUTE_TTL_S,
            _DAY_TTL_S,
            _CHARGE_TTL_S,
        ]
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Charge] = loop.create_future()
        if self._clock() < self._retry_at:
            future.set_exception(LedgerUnavailable(self.last_error or "redis unavailable"))
            return future
        self._queue.append((keys, args, future))
        if len(self._queue) == 1:  # the first: the rest of this iteration's join it
            task = loop.create_task(self._send_queued())
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)
        return future

    async def _send_queued(self) -> None:
        queue, self._queue = self._queue, []
        try:
            results = await self._guarded(lambda: self._run_charges(queue))
            charges = [_charge_of(result) for result in results]
        except BaseException as exc:  # (cancelled at shutdown too: nobody may wait forever)
            failure = exc if isinstance(exc, LedgerUnavailable) else LedgerUnavailable(repr(exc))
            for *_, future in queue:
                if not future.done():
                    future.set_exception(failure)
            if not isinstance(exc, Exception):
                raise
            return
        for (*_, future), charge in zip(queue, charges, strict=True):
            if not future.done():
                future.set_result(charge)

    async def _run_charges(self, queue: list[_Queued]) -> list[Any]:
        if len(queue) == 1:  # alone: the registered script's own call
            keys, args, _ = queue[0]
            return [await self._charge(keys=keys, args=args)]
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            for keys, args, _ in queue:
                pipe.evalsha(self._charge.sha, len(keys), *keys, *args)
            results: list[Any] = await pipe.execute(raise_on_error=False)
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in results):
                # Redis forgot the script (a restart, SCRIPT FLUSH): loaded, and the charges
                # sent again, as the registered script does for one (none of them ran).
                await self.client.script_load(self._charge.script)
                continue
            break
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results

    async def record(
        self,
        key_id: str,
        model: str,
        counts: UsageCounts,
        now: float,
        *,
        record_id: RecordId | None = None,
    ) -> None:
        """Add one batch's counts to the key's usage and spend. `record_id`: the same for
        every resend of one batch (made here if None); one written already adds nothing."""
        w = windows_at(now)
        writer, seq = record_id or (os.urandom(16).hex(), 1)
        keys = [
            self.key(key_id, "usage", w.day),
            self.key(key_id, "spend", w.day),
            self.key(key_id, "spend", w.month),
            self.key(key_id, "writes", w.day),
        ]
        args: list[str | int] = [
            self.retention_days * 86400,
            _DAY_TTL_S,
            _MONTH_TTL_S,
            f"{writer}{_SEP}{model}",
            seq,
            counts.cost_nano_usd,
        ]
        for name, value in counts.nonzero().items():
            args += [f"{model}{_SEP}{name}", value]

        async def write() -> None:
            await self._record(keys=keys, args=args)
            await self.client.sadd(self.index_key, key_id)  # another slot on a cluster

        await self._guarded(write)

    async def usage(self, key_ids: list[str] | None, since: str, until: str) -> list[UsageRow]:
        days = days_between(since, until, self.retention_days)

        async def read() -> list[UsageRow]:
            ids = key_ids
            if ids is None:
                members = await self.client.smembers(self.index_key)
                ids = sorted(_text(member) for member in members)
            pairs = [(key_id, day) for key_id in ids for day in days]
            if not pairs:
                return []
            pipe = self.client.pipeline(transaction=False)
            for key_id, day in pairs:
                pipe.hgetall(self.key(key_id, "usage", day))
            hashes = await pipe.execute()
            rows: list[UsageRow] = []
            for (key_id, day), fields in zip(pairs, hashes, strict=True):
                by_model: dict[str, dict[str, int]] = {}
                for raw_field, raw_value in fields.items():
                    model, _, name = _text(raw_field).rpartition(_SEP)
                    if name in USAGE_FIELDS:  # (a field a newer version added: not ours)
                        by_model.setdefault(model, {})[name] = int(raw_value)
                rows += [
                    UsageRow(key_id, model, day, UsageCounts(**by_model[model]))
                    for model in sorted(by_model)
                ]
            return rows

        return await self._guarded(read)

    async def close(self) -> None:
        with contextlib.suppress(*_OUTAGE):
            await self.client.aclose()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
