"""The keys in force: `auth.keys`, the keys file and the API's key store, as one `KeyRing`.

The request path reads `KeySource.ring` and, when the keys file is due a check, calls
`check()`, which stats the file and, if it changed, applies it before the request is judged
(a small file, parsed at once). A watcher task does the same every `reload_interval_s`
without waiting for traffic, and polls the key store about twice a second, so a key revoked
in either place is refused by every replica within `reload_interval_s` + 1 s, quiet or not.

A keys file that fails to read, parse or validate, or that holds no key, is not applied: the
previous keys stay, with a WARNING and `reload_failures` (a metric). A stored key that cannot
be built on this replica (its upstream credential's variable unset here, an id or a secret
some configured key has) is left out with a WARNING; the rest apply.

Once keys are configured in any of the three places (with the API: once `auth.api_keys` is
on), every /v1 request needs one, and stays needing one however many are revoked: the proxy
never opens up by losing its keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

from proxy.auth.keys import KeyRing, Limits, RingEntry, Secret, policy_key, ring_entries
from proxy.auth.keys_file import KeysFile, file_signature, read_keys_file
from proxy.auth.keystore import KeyStore
from proxy.auth.records import Snapshot, StoreUnavailable
from proxy.settings import AuthSettings, ConfigError, KeySettings, LimitSettings
from proxy.store.protocol import RateLimitedLog

log = logging.getLogger("proxy.auth")

STORE_POLL_S = 0.5  # how often the key store's version is read
START_LOAD_S = 5.0  # how long a start waits for the key store's first answer


class KeySource:
    """The current ring. `clock` (monotonic, for checks) and `wall` (unix time, for
    expiry) are injectable for tests."""

    def __init__(
        self,
        settings: AuthSettings,
        *,
        store: KeyStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._settings = settings
        self.store = store
        self._clock = clock
        self.wall = wall
        self._environ = os.environ if environ is None else environ
        self.path = Path(settings.keys_file) if settings.keys_file else None
        self._signature = None if self.path is None else file_signature(self.path)
        self._interval = settings.reload_interval_s
        self._next_check = clock() + self._interval
        self._file: KeysFile | None = None if self.path is None else read_keys_file(self.path)
        self._snapshot: Snapshot | None = None  # None: the store has not answered yet
        self._stamp: object = None
        self._task: asyncio.Task[None] | None = None  # a SIGHUP or background reload
        self._watcher: asyncio.Task[None] | None = None
        self._skipped: set[str] = set()  # stored keys left out (warned once each)
        self._log = RateLimitedLog(log)
        self.generation = 1  # bumped on every change applied
        self.reload_failures: Counter[str] = Counter()  # by where: "file", "store"
        self.ring = self._build()  # at start, errors are fatal (ConfigError)
        # Keys are in use: every /v1 request must carry one (see the module's docstring).
        self.configured: bool = bool(settings.keys) or self.path is not None or store is not None
        # Whether `check` has anything to do on the request path.
        self.watched = self.path is not None or store is not None

    @property
    def store_ready(self) -> bool:
        """The key store has answered once (or there is none): an unknown key is unknown."""
        return self.store is None or self._snapshot is not None

    @property
    def snapshot(self) -> Snapshot | None:
        return self._snapshot

    # Building the ring.

    def teams(self) -> dict[str, Limits]:
        """Team quotas: the config's, the keys file's, then the store's for other names."""
        teams: dict[str, LimitSettings] = dict(self._settings.teams)
        if self._file is not None:
            teams.update(self._file.teams)
        if self._snapshot is not None:
            for name, team in self._snapshot.teams.items():
                teams.setdefault(name, team)
        return {name: Limits.of(limits) for name, limits in teams.items()}

    def configured_team(self, name: str) -> bool:
        """A team defined in the config or the keys file (not the API's to change)."""
        return name in self._settings.teams or (self._file is not None and name in self._file.teams)

    def _build(self) -> KeyRing:
        teams = self.teams()
        entries: list[tuple[str, KeySettings]] = [
            (f"auth.keys[{i}]", k) for i, k in enumerate(self._settings.keys)
        ]
        if self._file is not None:
            entries += [(f"auth.keys_file[{i}]", k) for i, k in enumerate(self._file.keys)]
        ring = ring_entries(
            entries,
            self._environ,
            teams,
            origin=lambda where: "file" if where.startswith("auth.keys_file") else "config",
        )
        if self._snapshot is not None:
            ring += self._stored_entries(self._snapshot, ring, teams)
        return KeyRing(ring)

    def _stored_entries(
        self, snapshot: Snapshot, configured: list[RingEntry], teams: dict[str, Limits]
    ) -> list[RingEntry]:
        ids = {key.id for key, _ in configured}
        digests = {secret.digest for _, secrets in configured for secret in secrets}
        now = self.wall()
        entries: list[RingEntry] = []
        for record in snapshot.keys.values():
            live = record.live_secrets(now)
            if not live:
                continue
            secrets = [Secret(bytes.fromhex(s.sha256), s.expires_at) for s in live]
            problem: str | None = None
            if record.id in ids:
                problem = "a configured key has this id"
            elif any(secret.digest in digests for secret in secrets):
                problem = "a configured key has one of its secrets"
            else:
                try:
                    key = policy_key(
                        record, record.id, secrets[0].digest, f"api key {record.id!r}",
                        self._environ, teams, "api",
                    )  # fmt: skip
                except ConfigError as exc:
                    problem = str(exc)
            if problem is not None:
                if record.id not in self._skipped:
                    self._skipped.add(record.id)
                    log.warning("api key %r left out on this replica: %s", record.id, problem)
                continue
            digests.update(secret.digest for secret in secrets)
            entries.append((key, secrets))
        return entries

    def _apply(self, why: str) -> bool:
        """Rebuild the ring from what is loaded; False (and the old ring kept) on failure."""
        try:
            ring = self._build()
        except ConfigError as exc:
            self.reload_failures[why] += 1
            log.warning("keys not reloaded (%s), keeping the previous keys: %s", why, exc)
            return False
        self.ring = ring
        self.generation += 1
        return True

    # The keys file.

    def check(self) -> None:
        """On the request path, before the request is judged: start the watcher if it is not
        running, and apply a keys file that changed since the last check, if one is due."""
        if self._watcher is None:
            self._start_watcher()
        if self.path is not None and self._clock() >= self._next_check:
            self._next_check = self._clock() + self._interval
            signature = file_signature(self.path)
            if signature != self._signature:
                self._load_file(signature, self._read_file())

    def _read_file(self) -> KeysFile | ConfigError:
        assert self.path is not None
        try:
            return read_keys_file(self.path)
        except ConfigError as exc:
            return exc

    def _load_file(
        self, signature: tuple[int, int, int] | None, read: KeysFile | ConfigError
    ) -> None:
        self._signature = signature  # (a broken file: not warned about again until it changes)
        if isinstance(read, ConfigError):
            self.reload_failures["file"] += 1
            log.warning("keys file not reloaded, keeping the previous keys: %s", read)
            return
        previous, self._file = self._file, read
        if self._apply("file"):
            log.info("keys reloaded from %s: %d key(s)", self.path, len(self.ring))
        else:
            self._file = previous

    def request_reload(self, *, force: bool = True) -> None:
        """Check the file now, in the background (SIGHUP: `force` re-reads it even if it
        looks unchanged)."""
        if self.path is None or (self._task is not None and not self._task.done()):
            return
        self._next_check = self._clock() + self._interval
        self._task = asyncio.get_running_loop().create_task(self._reload_file(force))

    async def _reload_file(self, force: bool) -> None:
        assert self.path is not None
        signature = await asyncio.to_thread(file_signature, self.path)
        if not force and signature == self._signature:
            return
        read = await asyncio.to_thread(self._read_file)
        if not force and signature == self._signature:  # applied meanwhile by `check`
            return
        self._load_file(signature, read)

    async def wait_reloaded(self) -> None:
        """Wait for a reload in progress (tests, shutdown)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    # The key store.

    async def refresh_store(self) -> None:
        """Load the store now and apply it (after this replica changed it). Raises
        StoreUnavailable."""
        assert self.store is not None
        stamp = await self.store.stamp()
        snapshot = await self.store.load()
        self._take(snapshot, stamp)

    def _take(self, snapshot: Snapshot, stamp: object) -> None:
        if self._snapshot is not None and snapshot.version < self._snapshot.version:
            return  # an older read than one applied already
        previous, self._snapshot = self._snapshot, snapshot
        self._stamp = stamp
        if not self._apply("store"):
            self._snapshot = previous

    async def _poll_store(self) -> None:
        assert self.store is not None
        try:
            stamp = await self.store.stamp()
            if stamp == self._stamp and self._snapshot is not None:
                return
            snapshot = await self.store.load()
        except (StoreUnavailable, ValueError) as exc:
            self.reload_failures["store"] += 1
            self._log.warning(
                "key store (%s) unreadable (%s); keeping the keys loaded before",
                self.store.name, exc,
            )  # fmt: skip
            return
        self._take(snapshot, stamp)

    # The watcher.

    async def start(self) -> None:
        """At start (the app's lifespan): the store's first load, waited for up to
        START_LOAD_S, and the watcher."""
        self._start_watcher()
        if self.store is not None and self._snapshot is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(START_LOAD_S):
                    await self._poll_store()

    def _start_watcher(self) -> None:
        if not self.watched or self._watcher is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._watcher = loop.create_task(self._watch())

    async def _watch(self) -> None:
        tick = min(self._interval, STORE_POLL_S) if self.store is not None else self._interval
        next_poll = 0.0
        while True:
            try:
                if self.store is not None and self._clock() >= next_poll:
                    next_poll = self._clock() + STORE_POLL_S
                    await self._poll_store()
                if self.path is not None and self._clock() >= self._next_check:
                    self._next_check = self._clock() + self._interval
                    await self._reload_file(force=False)
            except Exception:  # the watcher must outlive any one bad check
                log.exception("keys watcher: check failed; trying again")
            await asyncio.sleep(tick)

    async def close(self) -> None:
        for task in (self._watcher, self._task):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._watcher = None
        if self.store is not None:
            await self.store.close()
