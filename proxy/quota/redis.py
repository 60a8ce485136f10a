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
    MAX_USERS_PER_DAY,
    USAGE_FIELDS,
    USER_FIELDS,
    Charge,
    Counters,
    LedgerUnavailable,
    LimitArgs,
    RecordId,
    Reservation,
    UsageCounts,
    UsageRow,
    days_between,
)
from proxy.quota.windows import Windows, windows_at
from proxy.store.connect import RedisClient

T = TypeVar("T")

# The result, stored under the charge id and returned, is one JSON array (denial, then the
# key's five counters, then its team's five when it has a team): one string to read back.
# Each holder's counters are read in one MGET; rate and token counters get their expiry
# only from the charge that creates them (a window's key is named by its window: its TTL
# only has to outlast it). A reservation adds to the spend counters of the key and team.
# KEYS: the key's rpm, tpm, tpd, spend day, spend month; the charge id; then the team's five
# (a key of a team). ARGV: the key's five limits, tokens, minute TTL, day TTL, charge TTL,
# reservation, month TTL, then the team's five limits.
_CHARGE_LUA = """
local seen = redis.call('GET', KEYS[6])
if seen then
  return seen
end
local tokens, reserve = tonumber(ARGV[6]), tonumber(ARGV[10])
local function read(first)
  local v = redis.call('MGET', KEYS[first], KEYS[first + 1], KEYS[first + 2],
    KEYS[first + 3], KEYS[first + 4])
  local c = {}
  for i = 1, 5 do c[i] = tonumber(v[i] or '0') end
  return v, c
end
local function limits(at)
  local l = {}
  for i = 0, 4 do l[i + 1] = tonumber(ARGV[at + i]) end
  return l
end
local function denial(c, l, prefix)
  if l[1] > 0 and c[1] + 1 > l[1] then return prefix .. 'requests' end
  if l[2] > 0 and c[2] + tokens > l[2] then return prefix .. 'tokens_minute' end
  if l[3] > 0 and c[3] + tokens > l[3] then return prefix .. 'tokens_day' end
  if l[4] > 0 and c[4] >= l[4] then return prefix .. 'spend_day' end
  if l[5] > 0 and c[5] >= l[5] then return prefix .. 'spend_month' end
  return ''
end
local function count(first, v, c, l)
  if l[1] > 0 then
    c[1] = redis.call('INCR', KEYS[first])
    if not v[1] then redis.call('EXPIRE', KEYS[first], ARGV[7]) end
  end
  if l[2] > 0 and tokens > 0 then
    c[2] = redis.call('INCRBY', KEYS[first + 1], tokens)
    if not v[2] then redis.call('EXPIRE', KEYS[first + 1], ARGV[7]) end
  end
  if l[3] > 0 and tokens > 0 then
    c[3] = redis.call('INCRBY', KEYS[first + 2], tokens)
    if not v[3] then redis.call('EXPIRE', KEYS[first + 2], ARGV[8]) end
  end
  if reserve > 0 then
    c[4] = redis.call('INCRBY', KEYS[first + 3], reserve)
    redis.call('EXPIRE', KEYS[first + 3], ARGV[8])
    c[5] = redis.call('INCRBY', KEYS[first + 4], reserve)
    redis.call('EXPIRE', KEYS[first + 4], ARGV[11])
  end
end
local kv, kc = read(1)
local kl = limits(1)
local denied = denial(kc, kl, '')
local team = #KEYS > 6
local tv, tc, tl
if team then
  tv, tc = read(7)
  tl = limits(12)
  if denied == '' then denied = denial(tc, tl, 'team_') end
end
if denied == '' then
  count(1, kv, kc, kl)
  if team then count(7, tv, tc, tl) end
end
local result = string.format('["%s",%d,%d,%d,%d,%d', denied, kc[1], kc[2], kc[3], kc[4], kc[5])
if team then
  result = result .. string.format(',%d,%d,%d,%d,%d', tc[1], tc[2], tc[3], tc[4], tc[5])
end
result = result .. ']'
redis.call('SET', KEYS[6], result, 'EX', ARGV[9])
return result
"""

# KEYS: usage hash, spend day, spend month, the day's writes hash, the day's end-user hash,
# the team's spend day and month (unused names in the same slot without a team).
# ARGV: usage TTL, day TTL, month TTL, the writer's field, the batch's sequence number,
# spend to add in nano-dollars, whether a team's spend is kept too, the end user's name
# ("" none), how many per-model pairs follow, then field, increment pairs (per model, then
# per end user), then the cap of distinct end users per key and day as the last argument.
_RECORD_LUA = """
local last = redis.call('HGET', KEYS[4], ARGV[4])
if last and tonumber(last) >= tonumber(ARGV[5]) then
  return 0
end
redis.call('HSET', KEYS[4], ARGV[4], ARGV[5])
redis.call('EXPIRE', KEYS[4], ARGV[2])
local last = 9 + 2 * tonumber(ARGV[9])
for i = 10, last, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
local user = ARGV[8]
if user ~= '' then
  local cap = tonumber(ARGV[#ARGV])
  local sep = string.char(10)
  if redis.call('HEXISTS', KEYS[5], user .. sep .. 'requests') == 0
     and redis.call('HLEN', KEYS[5]) >= cap * 6 then
    user = '(other)'
  end
  for i = last + 1, #ARGV - 1, 2 do
    redis.call('HINCRBY', KEYS[5], user .. sep .. ARGV[i], ARGV[i + 1])
  end
  redis.call('EXPIRE', KEYS[5], ARGV[1])
end
local cost = tonumber(ARGV[6])
if cost ~= 0 then
  redis.call('INCRBY', KEYS[2], cost); redis.call('EXPIRE', KEYS[2], ARGV[2])
  redis.call('INCRBY', KEYS[3], cost); redis.call('EXPIRE', KEYS[3], ARGV[3])
  if ARGV[7] == '1' then
    redis.call('INCRBY', KEYS[6], cost); redis.call('EXPIRE', KEYS[6], ARGV[2])
    redis.call('INCRBY', KEYS[7], cost); redis.call('EXPIRE', KEYS[7], ARGV[3])
  end
end
return 1
"""

# KEYS: the marker of this settlement, then spend counters (day, month; the team's too).
# ARGV: delta in nano-dollars, marker TTL, day TTL, month TTL.
_SETTLE_LUA = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[2]) then
  return 0
end
for i = 2, #KEYS do
  redis.call('INCRBY', KEYS[i], ARGV[1])
  redis.call('EXPIRE', KEYS[i], (i % 2 == 0) and ARGV[3] or ARGV[4])
end
return 1
"""

_OUTAGE = (RedisError, OSError, TimeoutError)
_MINUTE_TTL_S = 120
_DAY_TTL_S = 2 * 86400
_MONTH_TTL_S = 32 * 86400
_CHARGE_TTL_S = 60  # a charge's stored result: longer than any timeout plus one resend
# A settlement's marker: how long a resend of it is recognised (the meter retries failed
# settlements for less than this).
SETTLE_TTL_S = 900
_SEP = "\n"  # between model and field in a usage hash (model names never hold one)

# A charge waiting to be sent: its script's keys and arguments, and where its result goes.
_Queued = tuple[list[str], list[int], "asyncio.Future[Charge]"]


def _charge_of(result: bytes | str) -> Charge:
    """The charge script's result: `["<denial or empty>", requests, tokens per minute, tokens
    per day, spend today, spend this month]`, then the team's five."""
    denied, *counts = orjson.loads(result)
    return Charge(denied or None, Counters(*counts[:5]), Counters(*counts[5:]))


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
        self._settle = client.register_script(_SETTLE_LUA)
        # Charge ids: random per ledger, then counted: unique across replicas and restarts.
        self._id_prefix = os.urandom(12).hex()
        self._ids = itertools.count()
        # Charges waiting to go out together (see `charge`), and the task sending them.
        self._queue: list[_Queued] = []
        self._senders: set[asyncio.Task[None]] = set()

    def key(self, key_id: str, *parts: str) -> str:
        """A key's own Redis key (a key without a team: its id is the hash tag)."""
        return ":".join([f"{self.prefix}{{{key_id}}}", *parts])

    def holder_key(self, key_id: str, team: str | None, *parts: str) -> str:
        """A key's Redis key; a key of a team lives in the team's slot, beside the team's
        counters, so one script checks both (`=` is in no key id: no clash)."""
        if team is None:
            return self.key(key_id, *parts)
        return ":".join([f"{self.prefix}{{team={team}}}", "key", key_id, *parts])

    def team_key(self, team: str, *parts: str) -> str:
        return ":".join([f"{self.prefix}{{team={team}}}", "team", *parts])

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
        team: str | None = None,
        team_limits: LimitArgs | None = None,
        reserve_nano: int = 0,
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
            self.holder_key(key_id, team, "rpm", w.minute),
            self.holder_key(key_id, team, "tpm", w.minute),
            self.holder_key(key_id, team, "tpd", w.day),
            self.holder_key(key_id, team, "spend", w.day),
            self.holder_key(key_id, team, "spend", w.month),
            self.holder_key(key_id, team, "charge", charge_id),
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
            reserve_nano,
            _MONTH_TTL_S,
        ]
        if team is not None:
            keys += [
                self.team_key(team, "rpm", w.minute),
                self.team_key(team, "tpm", w.minute),
                self.team_key(team, "tpd", w.day),
                self.team_key(team, "spend", w.day),
                self.team_key(team, "spend", w.month),
            ]
            t = team_limits or LimitArgs(0, 0, 0, 0, 0)
            args += [t.requests, t.tokens_minute, t.tokens_day, t.spend_day_nano]
            args += [t.spend_month_nano]
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

    async def settle(self, reservation: Reservation, delta_nano: int) -> None:
        """Add `delta_nano` to the spend the reservation went to, once per its token."""
        if not delta_nano:
            return
        key_id, team, day, month = reservation[:4]
        keys = [
            self.holder_key(key_id, team, "settled", reservation.token),
            self.holder_key(key_id, team, "spend", day),
            self.holder_key(key_id, team, "spend", month),
        ]
        if team is not None:
            keys += [self.team_key(team, "spend", day), self.team_key(team, "spend", month)]
        args = [delta_nano, SETTLE_TTL_S, _DAY_TTL_S, _MONTH_TTL_S]
        await self._guarded(lambda: self._settle(keys=keys, args=args))

    async def peek(self, key_id: str, team: str | None, w: Windows) -> tuple[Counters, Counters]:
        windows = [("rpm", w.minute), ("tpm", w.minute), ("tpd", w.day)]
        windows += [("spend", w.day), ("spend", w.month)]
        keys = [self.holder_key(key_id, team, *parts) for parts in windows]

        async def read() -> tuple[Counters, Counters]:
            found = [int(v or 0) for v in await self.client.mget(keys)]
            team_found = [0] * 5
            if team is not None:
                names = [self.team_key(team, *parts) for parts in windows]
                team_found = [int(v or 0) for v in await self.client.mget(names)]
            return Counters(*found), Counters(*team_found)

        return await self._guarded(read)

    async def record(
        self,
        key_id: str,
        model: str,
        counts: UsageCounts,
        now: float,
        *,
        record_id: RecordId | None = None,
        team: str | None = None,
        user: str = "",
        spend_nano: int | None = None,
    ) -> None:
        """Add one batch's counts to the key's usage (and its end user's) and spend.
        `record_id`: the same for every resend of one batch (made here if None); one
        written already adds nothing."""
        w = windows_at(now)
        writer, seq = record_id or (os.urandom(16).hex(), 1)
        spend_team = team if team is not None else key_id  # (unused names without a team)
        keys = [
            self.holder_key(key_id, team, "usage", w.day),
            self.holder_key(key_id, team, "spend", w.day),
            self.holder_key(key_id, team, "spend", w.month),
            self.holder_key(key_id, team, "writes", w.day),
            self.holder_key(key_id, team, "users", w.day),
            self.team_key(spend_team, "spend", w.day) if team else self.key(key_id, "-"),
            self.team_key(spend_team, "spend", w.month) if team else self.key(key_id, "-"),
        ]
        field = f"{writer}{_SEP}{model}" + (f"{_SEP}{user}" if user else "")
        nonzero = counts.nonzero()
        args: list[str | int] = [
            self.retention_days * 86400,
            _DAY_TTL_S,
            _MONTH_TTL_S,
            field,
            seq,
            counts.cost_nano_usd if spend_nano is None else spend_nano,
            "1" if team is not None else "0",
            user,
            len(nonzero),
        ]
        for name, value in nonzero.items():
            args += [f"{model}{_SEP}{name}", value]
        if user:
            args += [
                item for name in USER_FIELDS if nonzero.get(name) for item in (name, nonzero[name])
            ]
        args.append(MAX_USERS_PER_DAY)
        member = key_id if team is None else f"{key_id}{_SEP}{team}"

        async def write() -> None:
            await self._record(keys=keys, args=args)
            await self.client.sadd(self.index_key, member)  # another slot on a cluster

        await self._guarded(write)

    async def usage(
        self, key_ids: list[str] | None, since: str, until: str, *, users: bool = False
    ) -> list[UsageRow]:
        days = days_between(since, until, self.retention_days)
        wanted = None if key_ids is None else set(key_ids)

        async def read() -> list[UsageRow]:
            members = await self.client.smembers(self.index_key)
            holders: set[tuple[str, str | None]] = set()
            for member in members:
                key_id, _, team_name = _text(member).partition(_SEP)
                if wanted is None or key_id in wanted:
                    holders.add((key_id, team_name or None))
            if wanted is not None:  # (a key with no usage yet is not in the index)
                holders |= {(key_id, None) for key_id in wanted}
            pairs = [(holder, day) for holder in sorted(holders, key=str) for day in days]
            if not pairs:
                return []
            pipe = self.client.pipeline(transaction=False)
            kind = "users" if users else "usage"
            for (key_id, holder_team), day in pairs:
                pipe.hgetall(self.holder_key(key_id, holder_team, kind, day))
            hashes = await pipe.execute()
            rows: list[UsageRow] = []
            for ((key_id, holder_team), day), fields in zip(pairs, hashes, strict=True):
                by_name: dict[str, dict[str, int]] = {}
                for raw_field, raw_value in fields.items():
                    name, _, count = _text(raw_field).rpartition(_SEP)
                    if count in USAGE_FIELDS:  # (a field a newer version added: not ours)
                        by_name.setdefault(name, {})[count] = int(raw_value)
                for name in sorted(by_name):
                    counts = UsageCounts(**by_name[name])
                    if users:
                        rows.append(UsageRow(key_id, "", day, counts, holder_team, name))
                    else:
                        rows.append(UsageRow(key_id, name, day, counts, holder_team))
            return rows

        return await self._guarded(read)

    async def close(self) -> None:
        with contextlib.suppress(*_OUTAGE):
            await self.client.aclose()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
