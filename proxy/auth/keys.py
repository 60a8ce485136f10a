"""Configured keys as a lookup table of sha256 digests.

The ring holds digests only: a presented key is hashed once and looked up, so neither the
lookup nor the final comparison (`hmac.compare_digest`) takes time that depends on how much
of a stored key a guess got right, and a dump of the process's config holds no key material.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import cached_property
from typing import Literal

from proxy.compaction.strategies import load_strategy
from proxy.headers import as_text
from proxy.settings import ConfigError, KeySettings


@dataclass(frozen=True)
class Limits:
    """A key's quotas; None = unlimited."""

    requests_per_minute: int | None = None
    prompt_tokens_per_minute: int | None = None
    prompt_tokens_per_day: int | None = None
    spend_usd_per_day: float | None = None
    spend_usd_per_month: float | None = None

    @cached_property
    def any(self) -> bool:
        return any(
            value is not None
            for value in (
                self.requests_per_minute,
                self.prompt_tokens_per_minute,
                self.prompt_tokens_per_day,
                self.spend_usd_per_day,
                self.spend_usd_per_month,
            )
        )


@dataclass(frozen=True)
class ProxyKey:
    """One key's identity and policy (no key material: `digest` is sha256 of the key)."""

    id: str
    digest: bytes = field(repr=False)
    upstream_api_key: str | None = field(default=None, repr=False)
    allowed_models: tuple[str, ...] = ("*",)
    budget_tokens: int | None = None
    mode: Literal["auto", "off", "force"] | None = None
    strategy: str | None = None
    prepare: bool = True  # summaries made ahead of need (compaction.prepare_at)
    limits: Limits = Limits()

    _allowed: dict[str, bool] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def allows(self, model: str) -> bool:
        """Memoised per model name (the request path asks on every request)."""
        found = self._allowed.get(model)
        if found is None:
            found = any(fnmatchcase(model, pattern) for pattern in self.allowed_models)
            if len(self._allowed) < 1_000:  # names come from clients: bounded
                self._allowed[model] = found
        return found

    def policy(self) -> dict[str, object]:
        """What an admin may see: everything but key material and credentials."""
        return {
            "id": self.id,
            "allowed_models": list(self.allowed_models),
            "upstream_credential": self.upstream_api_key is not None,
            "budget_tokens": self.budget_tokens,
            "mode": self.mode,
            "strategy": self.strategy,
            "prepare": self.prepare,
            "requests_per_minute": self.limits.requests_per_minute,
            "prompt_tokens_per_minute": self.limits.prompt_tokens_per_minute,
            "prompt_tokens_per_day": self.limits.prompt_tokens_per_day,
            "spend_usd_per_day": self.limits.spend_usd_per_day,
            "spend_usd_per_month": self.limits.spend_usd_per_month,
        }


def digest_of(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", errors="surrogatepass")).digest()


class KeyRing:
    """Keys by digest. Empty ring: the proxy runs without keys (behaviour as before keys)."""

    def __init__(self, keys: Iterable[ProxyKey] = ()) -> None:
        self._by_digest: dict[bytes, ProxyKey] = {}
        self._by_id: dict[str, ProxyKey] = {}
        for key in keys:
            if key.id in self._by_id:
                raise ConfigError(f"auth.keys: duplicate key id {key.id!r}")
            if key.digest in self._by_digest:
                raise ConfigError(
                    f"auth.keys: keys {self._by_digest[key.digest].id!r} and {key.id!r} "
                    "are the same key"
                )
            self._by_digest[key.digest] = key
            self._by_id[key.id] = key

    def __bool__(self) -> bool:
        return bool(self._by_digest)

    def __len__(self) -> int:
        return len(self._by_digest)

    def find(self, presented: str) -> ProxyKey | None:
        return self.by_digest(digest_of(presented))

    def by_digest(self, digest: bytes) -> ProxyKey | None:
        key = self._by_digest.get(digest)
        if key is None or not hmac.compare_digest(key.digest, digest):
            return None
        return key

    def keys(self) -> list[ProxyKey]:
        return list(self._by_id.values())


def build_key(entry: KeySettings, where: str, environ: Mapping[str, str]) -> ProxyKey:
    """Resolve env-held material now, so a missing variable fails at start, naming it."""
    if entry.key_sha256 is not None:
        digest = bytes.fromhex(entry.key_sha256)
    else:
        assert entry.key_env is not None  # the model validator guarantees one of the two
        value = environ.get(entry.key_env)
        if not value:
            raise ConfigError(f"{where}.key_env: environment variable {entry.key_env} is not set")
        digest = digest_of(value)
    if entry.strategy is not None:
        try:
            load_strategy(entry.strategy)
        except ValueError as exc:
            raise ConfigError(f"{where}.strategy: {exc}") from None
    upstream_key: str | None = None
    if entry.upstream_api_key_env is not None:
        upstream_key = environ.get(entry.upstream_api_key_env)
        if not upstream_key:
            raise ConfigError(
                f"{where}.upstream_api_key_env: environment variable "
                f"{entry.upstream_api_key_env} is not set"
            )
    return ProxyKey(
        id=entry.id,
        digest=digest,
        upstream_api_key=upstream_key,
        allowed_models=tuple(entry.allowed_models),
        budget_tokens=entry.budget_tokens,
        mode=entry.mode,
        strategy=entry.strategy,
        prepare=entry.prepare,
        limits=Limits(
            requests_per_minute=entry.requests_per_minute,
            prompt_tokens_per_minute=entry.prompt_tokens_per_minute,
            prompt_tokens_per_day=entry.prompt_tokens_per_day,
            spend_usd_per_day=entry.spend_usd_per_day,
            spend_usd_per_month=entry.spend_usd_per_month,
        ),
    )


def build_ring(
    entries: Iterable[tuple[str, KeySettings]], environ: Mapping[str, str] | None = None
) -> KeyRing:
    """`entries`: (where it came from, e.g. "auth.keys[0]", settings). Raises ConfigError."""
    env = os.environ if environ is None else environ
    return KeyRing(build_key(entry, where, env) for where, entry in entries)


# What `str.strip()` removes from ASCII text: stripping wire bytes by it gives the same key.
_ASCII_SPACE = b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"


def presented_digest(raw_headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    """`digest_of(presented_key(as_text(raw_headers)))` (None: no key presented), read from
    the wire bytes: an ASCII key is hashed as it came, without decoding it to text and
    encoding it back (the same bytes); any other goes the text way."""
    for name, value in raw_headers:
        size = len(name)  # ASGI servers send lower-case names: compared before lower-casing
        if size == 13 and (name == b"authorization" or name.lower() == b"authorization"):
            if not value.isascii():
                break
            if value.startswith(b"Bearer "):  # as SDKs send it: the scheme needs no reading
                token = value[7:].strip(_ASCII_SPACE)
            else:
                scheme, _, token = value.strip(_ASCII_SPACE).partition(b" ")
                token = token.strip(_ASCII_SPACE) if scheme.lower() == b"bearer" else b""
            if token:
                return hashlib.sha256(token).digest()
        elif size == 7 and name.lower() == b"api-key":
            if not value.isascii():
                break
            value = value.strip(_ASCII_SPACE)
            if value:
                return hashlib.sha256(value).digest()
    else:
        return None
    presented = presented_key(as_text(raw_headers))
    return None if presented is None else digest_of(presented)


def presented_key(headers: Iterable[tuple[str, str]]) -> str | None:
    """The key a client presents: `Authorization: Bearer <key>` or Azure-style `api-key`."""
    for name, value in headers:
        size = len(name)  # only names of the right length are lower-cased and compared
        if size == 13 and name.lower() == "authorization":
            scheme, _, token = value.strip().partition(" ")
            token = token.strip()
            if token and scheme.lower() == "bearer":
                return token
        elif size == 7 and name.lower() == "api-key":
            value = value.strip()
            if value:
                return value
    return None
