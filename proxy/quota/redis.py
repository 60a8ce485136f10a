"""Redis ledger: quota counters and usage shared by every replica.

Every key of one proxy key id carries the hash tag `{<id>}`, so on a Redis Cluster they
share a slot and the charge script (one EVALSHA: read every counter, decide, increment)
runs atomically on one node. `record` (off the hot path: the meter's batch) is one script
beside the key's counters plus one SADD to the key index, in one non-transactional pipeline
(on a cluster, which pipelines no scripts: one after the other).

A charge is idempotent: each carries a random id, and the script keeps its result under
`<prefix>{<id>}:charge:<charge id>` (same slot) for `_CHARGE_TTL_S`. Resent with the same id
(after a dropped connection the ledger resends a charge once, on every path, and the
script may already have run), it returns the stored result instead of counting the request
twice, and a stale connection costs no fail-open window. Memory: one short string key
(~150 bytes with its expiry; MEMORY USAGE says 136) per charge for 60 s, so charges/s x 60
live keys: 1,000 charges/s hold ~60,000 keys, ~9 MB.

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
from typing import Any, TypeVar, cast

import orjson
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.typing import ScriptTextT

from proxy.quota.ledger import (
    Charge,
    LedgerUnavailable,
    LimitArgs,
    LostVerdict,
    RecordId,
    UsageRow,
    days_between,
    new_charge,
)
from proxy.quota.resp import ChargeLine, pack
from proxy.quota.windows import Windows, windows_at
from proxy.store.connect import RedisClient

T = TypeVar("T")

# The result, stored under the charge id and returned, is one JSON array (denial, then the
# five counters): one bulk string to read and one orjson call, not six RESP values. The
# counters are read in one MGET and get their expiry only from the charge that creates them
# (a window's key is named by its window: its TTL only has to outlast it), so a charge is
# six Redis calls, not thirteen.
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
_TOKENS_BELOW = 10**20  # tokens a charge template writes (20 digits); more: packed as text


def _limit_args(limits: LimitArgs) -> tuple[int, ...]:
    return (
        limits.requests,
        limits.tokens_minute,
        limits.tokens_day,
        limits.spend_day_nano,
        limits.spend_month_nano,
    )


def _charge_of(result: bytes | str) -> Charge:
    """The charge script's result: `["<denial or empty>", requests, tokens per minute, tokens
    per day, spend today, spend this month]`."""
    denied, *counts = orjson.loads(result)
    return new_charge((denied or None, *counts))


async def _resent(call: Callable[[], Awaitable[T]]) -> T:
    """A charge, sent once more after a dropped connection (a stale pooled one, or a reply
    lost after the script ran: safe, a charge is idempotent). Never after a timeout: that
    would double the stall."""
    try:
        return await call()
    except RedisConnectionError:
        return await call()


class RedisLedger:
    name = "redis"

    def __init__(
        self,
        client: RedisClient,
        key_prefix: str,
        *,
        retention_days: int = 400,
        retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # The client never sends a command again: one whose reply was lost may have run.
        # Charges and usage writes are idempotent (their ids): the ledger resends those
        # itself, once, after a dropped connection (`_resent`).
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
        # A single node: charges go on one dedicated pipelined connection (see resp.py), or
        # over TLS as redis-py pipelines; a cluster client sends each on its own.
        self.line = (
            ChargeLine.of(client, _CHARGE_LUA)
            if isinstance(client, Redis) and ChargeLine.supports(client)
            else None
        )
        self._batching = isinstance(client, Redis)
        self._queue: list[tuple[list[str], list[int], asyncio.Future[bytes]]] = []
        self._senders: set[asyncio.Task[None]] = set()
        # key id -> (windows, limits, the packed pieces of its charge command, its template)
        self._commands: dict[str, list[Any]] = {}
        # Charge ids: random per ledger, then counted, 16 hex digits (unique without a
        # syscall per charge; 2**64 charges before the counter would outgrow its width).
        self._id_prefix = os.urandom(12).hex()
        self._ids = itertools.count()

    def key(self, key_id: str, *parts: str) -> str:
        return ":".join([f"{self.prefix}{{{key_id}}}", *parts])

    @property
    def index_key(self) -> str:
        return f"{self.prefix}usage-keys"

    async def _guarded(self, call: Callable[[], Awaitable[T]]) -> T:
        if self._clock() < self._retry_at:
            raise LedgerUnavailable(self.last_error or "redis unavailable")
        try:
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
        lost: LostVerdict | None = None,
    ) -> Awaitable[Charge]:
        """`charge_id`: the same for every resend of one request's charge (made here if
        None); a second charge with an id already seen returns the first one's result.
        `lost`: told the verdict of a charge whose wait was cancelled, asked for again
        under its id (the script ran at most once; see `Ledger.charge`).

        On the proxy's own line, once open, the command is sent before this returns (see
        `Ledger.charge`); otherwise when the result is awaited."""
        line = self.line
        if line is None:
            return self._pooled_charge(key_id, limits, tokens, w, charge_id, lost)
        if self._clock() < self._retry_at:
            return self._unavailable()
        if charge_id is None and 0 <= tokens < _TOKENS_BELOW:
            command = self._template(key_id, limits, w) % (next(self._ids), tokens)
        else:
            cid = charge_id or f"{self._id_prefix}{next(self._ids):016x}"
            command = self._command(key_id, limits, w, tokens, cid)
        return self._line_charge(command, line.send_now(command), lost)

    def _ask_again(self, again: Callable[[], Awaitable[Charge]], lost: LostVerdict) -> None:
        """A charge whose wait was cancelled: asked again under its id in the background
        (the stored result of the script that ran, or it runs now), its verdict to `lost`."""

        async def ask() -> None:
            try:
                charge: Charge | None = await again()
            except (LedgerUnavailable, *_OUTAGE):
                charge = None
            lost.lost(charge)

        task = asyncio.get_running_loop().create_task(ask())
        self._senders.add(task)
        task.add_done_callback(self._senders.discard)

    async def _unavailable(self) -> Charge:
        raise LedgerUnavailable(self.last_error or "redis unavailable")

    async def _pooled_charge(
        self,
        key_id: str,
        limits: LimitArgs,
        tokens: int,
        w: Windows,
        charge_id: str | None,
        lost: LostVerdict | None = None,
    ) -> Charge:
        keys = [
            self.key(key_id, "rpm", w.minute),
            self.key(key_id, "tpm", w.minute),
            self.key(key_id, "tpd", w.day),
            self.key(key_id, "spend", w.day),
            self.key(key_id, "spend", w.month),
            self.key(key_id, "charge", charge_id or os.urandom(16).hex()),
        ]
        args = [*_limit_args(limits), tokens, _MINUTE_TTL_S, _DAY_TTL_S, _CHARGE_TTL_S]
        try:
            return await self._pooled_result(keys, args)
        except asyncio.CancelledError:
            if lost is not None:  # sent, or about to be: the same keys (id) once more
                self._ask_again(lambda: self._pooled_result(keys, args), lost)
            raise

    async def _pooled_result(self, keys: list[str], args: list[int]) -> Charge:
        if self._batching:
            result = await self._batched_charge(keys, args)
        else:

            async def call() -> bytes:
                return cast(bytes, await self._charge(keys=keys, args=args))

            result = await self._guarded(lambda: _resent(call))
        return _charge_of(result)

    def _template(self, key_id: str, limits: LimitArgs, w: Windows) -> bytes:
        """The packed EVALSHA of this key's charges as a bytes %-template of the two things
        that change per charge, the charge id's counter (`%016x`) and the tokens (`%020d`):
        fixed widths, so the RESP lengths around them are in the template too, and a charge
        is one `%` (Lua's tonumber reads the leading zeros as decimal). Made once per key,
        limits and windows (a minute at most)."""
        found = self._commands.get(key_id)
        if found is None or found[1] is not limits:
            found = self._found(key_id, limits, w)
        elif found[0] is not w:  # another second: the same minute, day and month?
            if found[0][:3] != w[:3]:
                found = self._pack(key_id, limits, w)
            found[0] = w
        template: bytes = found[6]
        return template

    def _found(self, key_id: str, limits: LimitArgs, w: Windows) -> list[Any]:
        found = self._commands.get(key_id)
        if found is None or found[0][:3] != w[:3] or found[1] != limits:
            return self._pack(key_id, limits, w)
        found[0], found[1] = w, limits
        return found

    def _pack(self, key_id: str, limits: LimitArgs, w: Windows) -> list[Any]:
        if len(self._commands) > 100_000:  # ids from many reloads: start over
            self._commands.clear()
        head, charge_key, middle, tail = self._pieces(key_id, limits, w)
        cid = (charge_key + self._id_prefix.encode()).replace(b"%", b"%%")
        template = b"%s$%d\r\n%s%%016x\r\n%s$20\r\n%%020d\r\n%s" % (
            head.replace(b"%", b"%%"), len(charge_key) + len(self._id_prefix) + 16, cid,
            middle.replace(b"%", b"%%"), tail.replace(b"%", b"%%"),
        )  # fmt: skip
        found = self._commands[key_id] = [w, limits, head, charge_key, middle, tail, template]
        return found

    def _command(self, key_id: str, limits: LimitArgs, w: Windows, tokens: int, cid: str) -> bytes:
        """The packed EVALSHA of a charge with id `cid` (as `_template` makes for ids of its
        own): the id and the tokens spliced into the bytes of the rest, packed once per key,
        limits and windows."""
        head, charge_key, middle, tail = self._found(key_id, limits, w)[2:6]
        cid_bytes = cid.encode()
        tokens_bytes = b"%d" % tokens
        return b"%s$%d\r\n%s%s\r\n%s$%d\r\n%s\r\n%s" % (
            head, len(charge_key) + len(cid_bytes), charge_key, cid_bytes,
            middle, len(tokens_bytes), tokens_bytes, tail,
        )  # fmt: skip

    def _pieces(self, key_id: str, limits: LimitArgs, w: Windows) -> tuple[bytes, ...]:
        """(head, charge key prefix, middle, tail) of `pack(EVALSHA ...)` around the charge
        id and the tokens."""
        keys = [
            self.key(key_id, "rpm", w.minute),
            self.key(key_id, "tpm", w.minute),
            self.key(key_id, "tpd", w.day),
            self.key(key_id, "spend", w.day),
            self.key(key_id, "spend", w.month),
        ]
        whole = pack("EVALSHA", self._charge.sha, 6, *keys)
        head = b"*%d\r\n" % (3 + 6 + 9) + whole[whole.index(b"\r\n") + 2 :]
        middle = pack(*_limit_args(limits))
        tail = pack(_MINUTE_TTL_S, _DAY_TTL_S, _CHARGE_TTL_S)
        charge_key = self.key(key_id, "charge", "").encode()
        return (
            head,
            charge_key,
            middle[middle.index(b"\r\n") + 2 :],
            tail[tail.index(b"\r\n") + 2 :],
        )

    async def _line_charge(
        self, command: bytes, sent: Awaitable[Any] | None, lost: LostVerdict | None = None
    ) -> Charge:
        """The charge's result: the reply to `sent` (None: not sent yet, the line connects
        first), resent once after a dropped connection and once after loading the script."""
        line = self.line
        assert line is not None
        try:
            try:
                try:
                    result = await (line.call(command) if sent is None else sent)
                except RedisConnectionError:  # once more, as `_resent` does
                    result = await line.call(command)
            except NoScriptError:  # Redis's script cache was flushed: load it, resend once
                script = self._charge.script
                text = script if isinstance(script, str | bytes) else bytes(script)
                await line.call(pack("SCRIPT", "LOAD", text))
                result = await line.call(command)
        except _OUTAGE as exc:
            self.errors += 1
            self.last_error = type(exc).__name__
            self._retry_at = self._clock() + self._retry_after_s
            raise LedgerUnavailable(self.last_error) from exc
        except asyncio.CancelledError:
            if lost is not None:  # the command (its charge id) once more: its stored result
                self._ask_again(lambda: self._line_charge(command, None), lost)
            raise
        fields = orjson.loads(result)  # `_charge_of`, inline: two call frames fewer
        if not fields[0]:
            fields[0] = None
        return tuple.__new__(Charge, fields)

    async def _batched_charge(self, keys: list[str], args: list[int]) -> bytes:
        """Charges made in the same loop iteration go out as one pipeline: one write and one
        read for all of them, instead of a round trip each (each script still runs
        atomically on its own)."""
        if self._clock() < self._retry_at:
            raise LedgerUnavailable(self.last_error or "redis unavailable")
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._queue.append((keys, args, future))
        if len(self._queue) == 1:
            task = asyncio.get_running_loop().create_task(self._send_charges())
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)
        return await future

    async def _send_charges(self) -> None:
        queue, self._queue = self._queue, []
        try:
            results = await _resent(lambda: self._pipeline_charges(queue))
        except _OUTAGE as exc:
            self.errors += 1
            self.last_error = type(exc).__name__
            self._retry_at = self._clock() + self._retry_after_s
            for _, _, future in queue:
                if not future.done():
                    future.set_exception(LedgerUnavailable(self.last_error))
            return
        except BaseException as exc:  # cancelled at shutdown: nobody may wait forever
            for _, _, future in queue:
                if not future.done():
                    future.set_exception(LedgerUnavailable(type(exc).__name__))
            raise
        for (_, _, future), result in zip(queue, results, strict=True):
            if not future.done():
                future.set_result(result)

    async def _pipeline_charges(
        self, queue: list[tuple[list[str], list[int], asyncio.Future[bytes]]]
    ) -> list[bytes]:
        if len(queue) == 1:  # alone: a plain EVALSHA is cheaper than a pipeline of one
            keys, args, _ = queue[0]
            return [cast(bytes, await self._charge(keys=keys, args=args))]

        def build(pipe: Any) -> None:
            for keys, args, _ in queue:
                pipe.evalsha(self._charge.sha, len(keys), *keys, *args)

        return cast(list[bytes], await self._pipelined(build, self._charge.script))

    async def _pipelined(self, build: Callable[[Any], None], script: ScriptTextT) -> list[Any]:
        """One non-transactional pipeline, filled by `build`; sent once more after loading
        `script` when Redis did not know it (first use, or Redis restarted). Raises the first
        error among the replies."""
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            build(pipe)
            results = await pipe.execute(raise_on_error=False)
            if not any(isinstance(r, NoScriptError) for r in results):
                break
            if attempt == 0:
                await self.client.script_load(script)
        for result in results:
            if isinstance(result, Exception):
                raise result if isinstance(result, RedisError) else RedisError(str(result))
        return results

    async def record(
        self,
        key_id: str,
        model: str,
        counts: dict[str, int],
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
            counts.get("cost_nano_usd", 0),
        ]
        for name, value in counts.items():
            if value:
                args += [f"{model}{_SEP}{name}", value]

        async def call() -> object:
            if not self._batching:  # a cluster pipelines no scripts: the index on its own
                await self._record(keys=keys, args=args)
                return await self.client.sadd(self.index_key, key_id)

            def build(pipe: Any) -> None:
                pipe.evalsha(self._record.sha, len(keys), *keys, *args)
                pipe.sadd(self.index_key, key_id)

            return await self._pipelined(build, self._record.script)

        await self._guarded(lambda: _resent(call))

    async def usage(self, key_ids: list[str] | None, since: str, until: str) -> list[UsageRow]:
        days = days_between(since, until, self.retention_days)

        async def call() -> list[UsageRow]:
            ids = key_ids
            if ids is None:
                members = await self.client.smembers(self.index_key)
                ids = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)
            pipe = self.client.pipeline(transaction=False)
            pairs = [(key_id, day) for key_id in ids for day in days]
            for key_id, day in pairs:
                pipe.hgetall(self.key(key_id, "usage", day))
            hashes = await pipe.execute() if pairs else []
            rows: list[UsageRow] = []
            for (key_id, day), fields in zip(pairs, hashes, strict=True):
                by_model: dict[str, UsageRow] = {}
                for raw_field, raw_value in fields.items():
                    text = raw_field.decode() if isinstance(raw_field, bytes) else raw_field
                    model, _, name = text.rpartition(_SEP)
                    row = by_model.setdefault(model, UsageRow(key_id, model, day))
                    row.counts[name] = int(raw_value)
                rows.extend(by_model[m] for m in sorted(by_model))
            return rows

        return await self._guarded(call)

    async def close(self) -> None:
        if self.line is not None:
            self.line.close()
        with contextlib.suppress(*_OUTAGE):
            await self.client.aclose()
