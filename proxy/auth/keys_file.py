"""`auth.keys_file`: more keys (and teams) in a file an operator's tooling rewrites.

TOML or JSON (by the `.json` suffix), with the fields of `[[auth.keys]]`. Written as in the
config (`[[auth.keys]]`, `[auth.teams.<name>]`) or without the `auth` table (`[[keys]]`,
`[teams.<name>]`); JSON may also be a bare list of keys. Anything else at the top level, or
both spellings at once, is refused with a line saying so, as is a file without any key: an
empty file is far more often a failed deploy than an intent to lock everyone out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError

from proxy.settings import ConfigError, KeySettings, LimitSettings, format_validation_error

log = logging.getLogger("proxy.auth")


class _Tables(BaseModel):
    """What the file holds, validated together so an error names its place (keys.0.id)."""

    keys: list[KeySettings]
    teams: dict[str, LimitSettings]


@dataclass(frozen=True)
class KeysFile:
    keys: list[KeySettings]
    teams: dict[str, LimitSettings]


def read_keys_file(path: Path) -> KeysFile:
    """The file's keys and teams. Raises ConfigError (one line) when it cannot be read,
    does not parse, has the wrong shape, or holds no key."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"auth.keys_file {path}: {exc.strerror or exc}") from None
    data: Any
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"auth.keys_file {path} does not parse: {exc}") from None
    keys, teams = _tables(data, path)
    try:
        tables = _Tables.model_validate({"keys": keys, "teams": teams})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, f"(in {path})")) from None
    entries, team_limits = tables.keys, tables.teams
    if not entries:
        raise ConfigError(
            f"auth.keys_file {path} holds no keys (expected [[keys]] or [[auth.keys]] "
            "tables, or a JSON list of keys): not applied"
        )
    return KeysFile(entries, team_limits)


def _tables(data: Any, path: Path) -> tuple[Any, Any]:
    """(keys, teams) of a parsed file, either spelling."""
    if isinstance(data, list):
        return data, {}
    if not isinstance(data, dict):
        raise ConfigError(f"auth.keys_file {path}: expected a table of keys, not {data!r:.40}")
    unknown = sorted(set(data) - {"keys", "teams", "auth"})
    if unknown:
        raise ConfigError(
            f"auth.keys_file {path}: unknown key {unknown[0]!r} (expected [[keys]] and "
            "[teams.<name>], or [[auth.keys]] and [auth.teams.<name>])"
        )
    auth = data.get("auth", {})
    if not isinstance(auth, dict):
        raise ConfigError(f"auth.keys_file {path}: 'auth' must be a table")
    extra = sorted(set(auth) - {"keys", "teams"})
    if extra:
        raise ConfigError(
            f"auth.keys_file {path}: auth.{extra[0]} belongs in the proxy's config, not in "
            "the keys file (which holds auth.keys and auth.teams only)"
        )
    for name in ("keys", "teams"):
        if name in data and name in auth:
            raise ConfigError(
                f"auth.keys_file {path}: both [[{name}]] and [[auth.{name}]]: use one spelling"
            )
    return data.get("keys", auth.get("keys", [])), data.get("teams", auth.get("teams", {}))


def file_signature(path: Path) -> tuple[int, int, int] | None:
    """What changes when the file is rewritten (mtime, size, inode); None: unreadable."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class Reloadable(Protocol):
    path: Path | None

    def request_reload(self, *, force: bool = True) -> None: ...


def reload_on_sighup(source: Reloadable) -> None:
    """`kill -HUP <pid>` re-reads the keys file (main thread with a running loop only)."""
    if source.path is None:
        return
    try:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, source.request_reload)
    except (NotImplementedError, RuntimeError, ValueError, AttributeError):
        log.info("SIGHUP reload unavailable here; the keys file is still re-read on change")
