"""Configured keys as a lookup table of sha256 digests.

The ring holds digests only: a presented key is hashed once and looked up, so neither the
lookup nor the final comparison (`hmac.compare_digest`) takes time that depends on how much
of a stored key a guess got right, and a dump of the process's config holds no key material.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from functools import cached_property
from typing import Literal

from proxy.compaction.strategies import load_strategy
from proxy.headers import as_text
from proxy.settings import ConfigError, KeySettings, LimitSettings, PolicySettings


@dataclass(frozen=True)
class Limits:
    """A key's or a team's quotas; None = unlimited."""

    requests_per_minute: int | None = None
    prompt_tokens_per_minute: int | None = None
    prompt_tokens_per_day: int | None = None
    spend_usd_per_day: float | None = None
    spend_usd_per_month: float | None = None

    @classmethod
    def of(cls, settings: LimitSettings) -> Limits:
        return cls(
            requests_per_minute=settings.requests_per_minute,
            prompt_tokens_per_minute=settings.prompt_tokens_per_minute,
            prompt_tokens_per_day=settings.prompt_tokens_per_day,
            spend_usd_per_day=settings.spend_usd_per_day,
            spend_usd_per_month=settings.spend_usd_per_month,
        )

    @cached_property
    def any(self) -> bool:
        return any(value is not None for value in self.as_dict().values())

    @cached_property
    def spends(self) -> bool:
        """Whether a spend cap is set (requests then reserve their price)."""
        return self.spend_usd_per_day is not None or self.spend_usd_per_month is not None

    @cached_property
    def counts_tokens(self) -> bool:
        return self.prompt_tokens_per_minute is not None or self.prompt_tokens_per_day is not None

    def as_dict(self) -> dict[str, int | float | None]:
        return {
            "requests_per_minute": self.requests_per_minute,
            "prompt_tokens_per_minute": self.prompt_tokens_per_minute,
            "prompt_tokens_per_day": self.prompt_tokens_per_day,
            "spend_usd_per_day": self.spend_usd_per_day,
            "spend_usd_per_month": self.spend_usd_per_month,
        }


KeyOrigin = Literal["config", "file", "api"]


@dataclass(frozen=True)
class ProxyKey:
    """One key's identity and policy (no key material: `digest` is sha256 of one of its
    secrets; a key may have several, see KeyRing)."""

    id: str
    digest: bytes = field(repr=False)
    upstream_api_key: str | None = field(default=None, repr=False)
    allowed_models: tuple[str, ...] = ("*",)
    budget_tokens: int | None = None
    mode: Literal["auto", "off", "force"] | None = None
    strategy: str | None = None
    prepare: bool = True  # summaries made ahead of need (compaction.prepare_at)
    limits: Limits = Limits()
    audit: bool | None = None  # None: as [audit] enabled says
    team: str | None = None
    team_limits: Limits = Limits()  # the team's, shared with its other keys
    origin: KeyOrigin = "config"
    upstream_api_key_env: str | None = None

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

    @property
    def limited(self) -> bool:
        """Whether any quota applies to the key (its own or its team's)."""
        return self.limits.any or self.team_limits.any

    @property
    def spends(self) -> bool:
        """Whether a spend cap applies (its own or its team's): requests reserve a price."""
        return self.limits.spends or self.team_limits.spends

    def policy(self) -> dict[str, object]:
        """What an admin may see: everything but key material and credentials."""
        return {
            "id": self.id,
            "team": self.team,
            "origin": self.origin,
            "allowed_models": list(self.allowed_models),
            "upstream_credential": self.upstream_api_key is not None,
            "budget_tokens": self.budget_tokens,
            "mode": self.mode,
            "strategy": self.strategy,
            "audit": self.audit,
            "prepare": self.prepare,
            **self.limits.as_dict(),
        }


@dataclass(frozen=True)
class Secret:
    """One live credential of a key: its digest, and when it stops working (unix time)."""

    digest: bytes = field(repr=False)
    expires_at: float | None = None


def digest_of(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", errors="surrogatepass")).digest()


RingEntry = tuple[ProxyKey, Sequence[Secret]]


class KeyRing:
    """Keys by digest. Empty ring: the proxy runs without keys (behaviour as before keys).

    A key may hold several secrets (a rotation: old and new work side by side), each with
    an optional expiry; a secret is unique across keys."""

    def __init__(self, entries: Iterable[RingEntry] = ()) -> None:
        self._by_digest: dict[bytes, tuple[ProxyKey, float | None, bytes]] = {}
        self._by_id: dict[str, ProxyKey] = {}
        for key, secrets in entries:
            if key.id in self._by_id:
                raise ConfigError(f"auth.keys: duplicate key id {key.id!r}")
            for secret in secrets:
                found = self._by_digest.get(secret.digest)
                if found is not None:
                    raise ConfigError(
                        f"auth.keys: keys {found[0].id!r} and {key.id!r} are the same key"
                    )
                self._by_digest[secret.digest] = (key, secret.expires_at, secret.digest)
            self._by_id[key.id] = key

    def __bool__(self) -> bool:
        return bool(self._by_digest)

    def __len__(self) -> int:
        return len(self._by_id)

    def find(self, presented: str) -> ProxyKey | None:
        found = self.by_digest(digest_of(presented))
        return None if found is None else found[0]

    def by_digest(self, digest: bytes) -> tuple[ProxyKey, float | None] | None:
        """(the key, when this secret expires) for a presented digest; expiry is the
        caller's to check (it caches what it found)."""
        found = self._by_digest.get(digest)
        if found is None:
            return None
        key, expires, stored = found
        if not hmac.compare_digest(stored, digest):
            return None
        return key, expires

    def get(self, key_id: str) -> ProxyKey | None:
        return self._by_id.get(key_id)

    def proxy_keys(self) -> list[ProxyKey]:
        return list(self._by_id.values())


def build_key(
    entry: KeySettings,
    where: str,
    environ: Mapping[str, str],
    teams: Mapping[str, Limits] | None = None,
    origin: KeyOrigin = "config",
) -> tuple[ProxyKey, Secret]:
    """Resolve env-held material now, so a missing variable fails at start, naming it."""
    if entry.key_sha256 is not None:
        digest = bytes.fromhex(entry.key_sha256)
    else:
        assert entry.key_env is not None  # the model validator guarantees one of the two
        value = environ.get(entry.key_env)
        if not value:
            raise ConfigError(f"{where}.key_env: environment variable {entry.key_env} is not set")
        digest = digest_of(value)
    expires = entry.expires_at
    if expires is not None and expires.tzinfo is None:
        expires = expires.replace(tzinfo=dt.UTC)
    key = policy_key(entry, entry.id, digest, where, environ, teams, origin)
    return key, Secret(digest, None if expires is None else expires.timestamp())


def policy_key(
    policy: PolicySettings,
    key_id: str,
    digest: bytes,
    where: str,
    environ: Mapping[str, str],
    teams: Mapping[str, Limits] | None = None,
    origin: KeyOrigin = "config",
) -> ProxyKey:
    """A key of `policy` (raises ConfigError naming `where` for a strategy that does not
    load or an upstream credential variable that is not set)."""
    if policy.strategy is not None:
        try:
            load_strategy(policy.strategy)
        except ValueError as exc:
            raise ConfigError(f"{where}.strategy: {exc}") from None
    upstream_key: str | None = None
    if policy.upstream_api_key_env is not None:
        upstream_key = environ.get(policy.upstream_api_key_env)
        if not upstream_key:
            raise ConfigError(
                f"{where}.upstream_api_key_env: environment variable "
                f"{policy.upstream_api_key_env} is not set"
            )
    team_limits = Limits()
    if policy.team is not None and teams is not None:
        team_limits = teams.get(policy.team, Limits())
    return ProxyKey(
        id=key_id,
        digest=digest,
        upstream_api_key=upstream_key,
        allowed_models=tuple(policy.allowed_models),
        budget_tokens=policy.budget_tokens,
        mode=policy.mode,
        strategy=policy.strategy,
        limits=Limits.of(policy),
        team=policy.team,
        team_limits=team_limits,
        origin=origin,
        upstream_api_key_env=policy.upstream_api_key_env,
        audit=policy.audit,
        prepare=policy.prepare,
    )


def ring_entries(
    entries: Iterable[tuple[str, KeySettings]],
    environ: Mapping[str, str] | None = None,
    teams: Mapping[str, Limits] | None = None,
    origin: KeyOrigin | Callable[[str], KeyOrigin] = "config",
) -> list[RingEntry]:
    """`entries`: (where it came from, e.g. "auth.keys[0]", settings). Entries sharing an
    id are one key with several secrets when their policies agree (else ConfigError)."""
    env = os.environ if environ is None else environ
    merged: dict[str, tuple[ProxyKey, list[Secret], str]] = {}
    for where, entry in entries:
        kind = origin(where) if callable(origin) else origin
        key, secret = build_key(entry, where, env, teams, kind)
        found = merged.get(key.id)
        if found is None:
            merged[key.id] = (key, [secret], where)
            continue
        first, secrets, first_where = found
        if replace(first, digest=b"") != replace(key, digest=b""):
            raise ConfigError(
                f"auth.keys: duplicate key id {key.id!r} ({first_where} and {where} differ in "
                "policy; entries of one id are its secrets and must agree on the rest)"
            )
        secrets.append(secret)
    return [(key, secrets) for key, secrets, _ in merged.values()]


def build_ring(
    entries: Iterable[tuple[str, KeySettings]],
    environ: Mapping[str, str] | None = None,
    teams: Mapping[str, Limits] | None = None,
) -> KeyRing:
    """The ring of configured entries (see ring_entries). Raises ConfigError."""
    return KeyRing(ring_entries(entries, environ, teams))


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
