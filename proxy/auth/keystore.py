"""Where keys made through the admin API live: Redis (shared by every replica) or a file.

Each change is one atomic write that also bumps the store's version and appends the admin
action to its audit trail: a replica polls a cheap stamp (Redis: the version; the file: its
stat) about twice a second and reloads everything when it moved, so a key created, rotated
or revoked on one replica is honoured by every other within a second.

Writes are compare-and-set on the record's `rev`: two admins changing one key at once do not
undo each other (the second gets `Conflict`, and the admin API reads again and retries).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from proxy.auth.records import (
    AUDIT_CAP,
    Conflict,
    Kind,
    Record,
    Snapshot,
    StoreUnavailable,
)
from proxy.settings import ConfigError, Settings


class KeyStore(Protocol):
    name: str  # "redis" | "file"

    async def stamp(self) -> object:
        """Something that changes whenever the store does (cheap: polled)."""
        ...

    async def load(self) -> Snapshot: ...

    async def write(
        self,
        kind: Kind,
        name: str,
        expected_rev: int | None,
        record: Record | None,
        audit: dict[str, Any],
    ) -> int:
        """Put `record` (None: delete) under `name` if the stored one is at `expected_rev`
        (None: there is none), and append `audit`; the store's new version. Raises Conflict."""
        ...

    async def audit_log(self, limit: int) -> list[dict[str, Any]]:
        """The newest `limit` audit entries, newest first."""
        ...

    async def close(self) -> None: ...


def create_key_store(settings: Settings) -> KeyStore | None:
    """The store of API-made keys when `auth.api_keys` is on: Redis when the quota backend
    is, else the file `auth.api_keys_file` (ConfigError without one)."""
    auth = settings.auth
    if not auth.api_keys:
        return None
    from proxy.startup import quota_backend

    if quota_backend(settings) == "redis":
        from proxy.auth.keystore_redis import RedisKeyStore
        from proxy.store import redis_required

        with redis_required("auth.api_keys"):
            from proxy.store.connect import connect
        quota = settings.quota
        url = quota.redis_url if quota.redis_url is not None else settings.cache.redis_url
        client = connect(url, socket_timeout_s=max(quota.socket_timeout_s, 2.0))
        return RedisKeyStore(client, quota.key_prefix)
    if auth.api_keys_file is None:
        raise ConfigError(
            "auth.api_keys needs somewhere to keep the keys: a Redis quota backend "
            '(quota.backend = "redis") or auth.api_keys_file = "<path of a JSON file>"'
        )
    return FileKeyStore(Path(auth.api_keys_file))


class FileKeyStore:
    """One JSON file (mode 0600) rewritten whole on each change (written aside, then renamed
    over), under an exclusive lock of `<file>.lock` so processes sharing it (workers) take
    turns; the audit trail is `<file>.audit.jsonl`, one JSON object per line."""

    name = "file"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.audit_path = path.with_name(path.name + ".audit.jsonl")
        self._lock_path = path.with_name(path.name + ".lock")

    async def stamp(self) -> object:
        return await asyncio.to_thread(self._stat)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailable(f"{self.path}: {exc.strerror or exc}") from None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    async def load(self) -> Snapshot:
        return await asyncio.to_thread(self._read)

    def _read(self) -> Snapshot:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return Snapshot()
        except OSError as exc:
            raise StoreUnavailable(f"{self.path}: {exc.strerror or exc}") from None
        try:
            return Snapshot.model_validate_json(text)
        except ValueError as exc:
            raise StoreUnavailable(f"{self.path} does not parse: {exc}") from None

    async def write(
        self,
        kind: Kind,
        name: str,
        expected_rev: int | None,
        record: Record | None,
        audit: dict[str, Any],
    ) -> int:
        return await asyncio.to_thread(self._write, kind, name, expected_rev, record, audit)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # (closing releases the lock)

    def _write(
        self,
        kind: Kind,
        name: str,
        expected_rev: int | None,
        record: Record | None,
        audit: dict[str, Any],
    ) -> int:
        with self._locked():
            snapshot = self._read()
            table: dict[str, Any] = snapshot.keys if kind == "key" else snapshot.teams
            found = table.get(name)
            if (found is None) != (expected_rev is None) or (
                found is not None and found.rev != expected_rev
            ):
                raise Conflict(name)
            if record is None:
                table.pop(name, None)
            else:
                table[name] = record
            snapshot.version += 1
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(snapshot.model_dump_json(indent=1))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
            self._append_audit(audit)
            return snapshot.version

    def _append_audit(self, audit: dict[str, Any]) -> None:
        fd = os.open(self.audit_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as out:
            out.write(json.dumps(audit, separators=(",", ":")) + "\n")
        lines = self._audit_lines()
        if len(lines) > 2 * AUDIT_CAP:  # trimmed now and then, not on every write
            tmp = self.audit_path.with_name(self.audit_path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in lines[-AUDIT_CAP:]), encoding="utf-8")
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.audit_path)

    def _audit_lines(self) -> list[str]:
        try:
            return self.audit_path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []

    async def audit_log(self, limit: int) -> list[dict[str, Any]]:
        def read() -> list[dict[str, Any]]:
            entries = []
            for line in reversed(self._audit_lines()[-limit:]):
                with contextlib.suppress(ValueError):
                    entries.append(json.loads(line))
            return entries

        return await asyncio.to_thread(read)

    async def close(self) -> None:
        return None
