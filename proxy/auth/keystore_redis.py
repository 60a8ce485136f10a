"""API-made keys in Redis, beside the quota counters (same prefix, same client library).

Layout, every key in one hash slot (`{=keys}`: `=` never appears in a key id, so no key's
counters share it):
    <prefix>{=keys}:records   hash  key id -> StoredKey JSON
    <prefix>{=keys}:teams     hash  team name -> StoredTeam JSON
    <prefix>{=keys}:version   int   bumped by every change (what replicas poll)
    <prefix>{=keys}:audit     list  admin actions, newest first, the last AUDIT_CAP
A change is one script: compare the record's `rev`, write it, bump the version, append the
audit entry. A load is one script too, so it reads a consistent snapshot.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from proxy.auth.records import (
    AUDIT_CAP,
    Conflict,
    Kind,
    Record,
    Snapshot,
    StoredKey,
    StoredTeam,
    StoreUnavailable,
)
from proxy.store.connect import RedisClient

# KEYS: the table (records or teams), version, audit. ARGV: name, expected rev ("" = absent),
# record JSON ("" = delete), audit JSON, audit cap.
_WRITE_LUA = """
local found = redis.call('HGET', KEYS[1], ARGV[1])
if ARGV[2] == '' then
  if found then return -1 end
else
  if not found then return -1 end
  local rev = cjson.decode(found)['rev']
  if tostring(rev) ~= ARGV[2] then return -1 end
end
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
end
redis.call('LPUSH', KEYS[3], ARGV[4])
redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[5]) - 1)
return redis.call('INCR', KEYS[2])
"""

# KEYS: records, teams, version.
_LOAD_LUA = """
return {redis.call('GET', KEYS[3]) or '0', redis.call('HGETALL', KEYS[1]),
        redis.call('HGETALL', KEYS[2])}
"""

_OUTAGE = (RedisError, OSError, TimeoutError)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _pairs(flat: list[Any]) -> dict[str, str]:
    return {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}


class RedisKeyStore:
    name = "redis"

    def __init__(self, client: RedisClient, key_prefix: str) -> None:
        # A write is a compare-and-set: sent again after its reply was lost, it would fail
        # as a conflict and the admin API would apply the change twice (two new secrets).
        client.set_retry(Retry(NoBackoff(), 0))
        self.client = client
        base = f"{key_prefix}{{=keys}}"
        self.records_key = f"{base}:records"
        self.teams_key = f"{base}:teams"
        self.version_key = f"{base}:version"
        self.audit_key = f"{base}:audit"
        self._write = client.register_script(_WRITE_LUA)
        self._load = client.register_script(_LOAD_LUA)

    async def stamp(self) -> object:
        try:
            return await self.client.get(self.version_key)
        except _OUTAGE as exc:
            raise StoreUnavailable(type(exc).__name__) from exc

    async def load(self) -> Snapshot:
        try:
            version, keys, teams = await self._load(
                keys=[self.records_key, self.teams_key, self.version_key]
            )
        except _OUTAGE as exc:
            raise StoreUnavailable(type(exc).__name__) from exc
        return Snapshot(
            version=int(version),
            keys={k: StoredKey.model_validate_json(v) for k, v in _pairs(keys).items()},
            teams={k: StoredTeam.model_validate_json(v) for k, v in _pairs(teams).items()},
        )

    async def write(
        self,
        kind: Kind,
        name: str,
        expected_rev: int | None,
        record: Record | None,
        audit: dict[str, Any],
    ) -> int:
        table = self.records_key if kind == "key" else self.teams_key
        args: list[str | int] = [
            name,
            "" if expected_rev is None else str(expected_rev),
            "" if record is None else record.model_dump_json(),
            json.dumps(audit, separators=(",", ":")),
            AUDIT_CAP,
        ]
        try:
            version = await self._write(keys=[table, self.version_key, self.audit_key], args=args)
        except _OUTAGE as exc:
            raise StoreUnavailable(type(exc).__name__) from exc
        if int(version) < 0:
            raise Conflict(name)
        return int(version)

    async def audit_log(self, limit: int) -> list[dict[str, Any]]:
        try:
            raw = await self.client.lrange(self.audit_key, 0, max(0, limit - 1))
        except _OUTAGE as exc:
            raise StoreUnavailable(type(exc).__name__) from exc
        entries = []
        for item in raw:
            with contextlib.suppress(ValueError):
                entries.append(json.loads(item))
        return entries

    async def close(self) -> None:
        with contextlib.suppress(*_OUTAGE):
            await self.client.aclose()
