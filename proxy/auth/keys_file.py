"""Keys that rotate without a restart: `auth.keys_file`, re-read on change or on SIGHUP.

The request path only reads `KeySource.ring`. At most every `reload_interval_s` it also asks
`maybe_reload()`, which starts a background check (stat, and a re-read only if the file
changed) and returns at once: the request goes on with the ring it has. A file that fails to
parse or validate keeps the previous ring, with a warning, so a typo never locks everyone out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from proxy.auth.keys import KeyRing, build_ring
from proxy.settings import AuthSettings, ConfigError, KeySettings, format_validation_error

log = logging.getLogger("proxy.auth")

_ENTRIES = TypeAdapter(list[KeySettings])


def read_keys_file(path: Path) -> list[KeySettings]:
    """`keys = [...]` / `[[keys]]` in TOML, or a JSON list or `{"keys": [...]}`."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"auth.keys_file {path}: {exc.strerror or exc}") from None
    data: Any
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"auth.keys_file {path} does not parse: {exc}") from None
    if isinstance(data, dict):
        data = data.get("keys", [])
    try:
        return _ENTRIES.validate_python(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, f"(in {path})")) from None


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class KeySource:
    """The current ring: `auth.keys` plus the keys file. `clock` is injectable for tests."""

    def __init__(
        self,
        settings: AuthSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self.path = Path(settings.keys_file) if settings.keys_file else None
        self._signature = None if self.path is None else _signature(self.path)
        self._next_check = clock() + settings.reload_interval_s
        self._task: asyncio.Task[None] | None = None
        self.generation = 1  # bumped on every successful reload
        self.ring = self._load()  # at start, errors are fatal (ConfigError)
        # Keys are in use (from config or a keys file): every /v1 request must carry one.
        self.configured: bool = bool(settings.keys) or self.path is not None

    def _load(self) -> KeyRing:
        entries = [(f"auth.keys[{i}]", k) for i, k in enumerate(self._settings.keys)]
        if self.path is not None:
            entries += [
                (f"auth.keys_file[{i}]", k) for i, k in enumerate(read_keys_file(self.path))
            ]
        return build_ring(entries)

    def maybe_reload(self) -> None:
        """Called on the request path: starts a background check when one is due."""
        if self.path is None or self._clock() < self._next_check:
            return
        self.request_reload(force=False)

    def request_reload(self, *, force: bool = True) -> None:
        """Check the file now (SIGHUP: `force` re-reads even if it looks unchanged)."""
        if self.path is None or (self._task is not None and not self._task.done()):
            return
        self._next_check = self._clock() + self._settings.reload_interval_s
        self._task = asyncio.get_running_loop().create_task(self._reload(force))

    async def _reload(self, force: bool) -> None:
        assert self.path is not None
        signature = await asyncio.to_thread(_signature, self.path)
        if not force and signature == self._signature:
            return
        try:
            ring = await asyncio.to_thread(self._load)
        except ConfigError as exc:
            log.warning("keys file not reloaded, keeping the previous keys: %s", exc)
            self._signature = signature  # don't warn again until it changes
            return
        self._signature = signature
        self.ring = ring
        self.generation += 1
        log.info("keys reloaded from %s: %d key(s)", self.path, len(ring))

    async def wait_reloaded(self) -> None:
        """Wait for a reload in progress (tests, shutdown)."""
        if self._task is not None:
            await asyncio.shield(self._task)


def reload_on_sighup(source: KeySource) -> None:
    """`kill -HUP <pid>` re-reads the keys file (main thread with a running loop only)."""
    if source.path is None:
        return
    try:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, source.request_reload)
    except (NotImplementedError, RuntimeError, ValueError, AttributeError):
        log.info("SIGHUP reload unavailable here; the keys file is still re-read on change")
