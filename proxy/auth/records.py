"""Keys and teams made through the admin API, as stored: hashes and policy, never a secret.

A `StoredKey` is a key's policy (the same fields as `[[auth.keys]]` but the key material)
and its secrets: each a sha256 digest, a short hint for humans (the secret's last four
characters), and an optional expiry, so a rotation lets the old and the new secret work side
by side. A revoked key stays stored (marked `revoked_at`), so its id is never reused by
accident and the proxy never forgets it ever had keys. `rev` counts a record's changes: the
stores write a record only over the revision it was read at (see KeyStore).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from proxy.settings import KEY_ID_PATTERN, LimitSettings, PolicySettings

Kind = Literal["key", "team"]
AUDIT_CAP = 10_000  # audit entries a store keeps (Redis list; the file is trimmed past 2x)


class Conflict(Exception):
    """The record changed since it was read (or exists, or is gone)."""


class StoreUnavailable(Exception):
    """The store could not be read or written."""


# What the secrets the API makes start with: recognisable in a leaked log or a repository.
SECRET_PREFIX = "sk-cp-"


class StoredSecret(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str  # "sec_<hex>": names the secret in the API (revoke this one)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    hint: str = ""  # "...ab3X": the secret's last four characters
    created_at: float
    expires_at: float | None = None

    def live(self, now: float) -> bool:
        return self.expires_at is None or now < self.expires_at

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "hint": self.hint,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
        }


class StoredKey(PolicySettings):
    """A key made through the API (extra fields of a newer version are kept unread)."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(pattern=KEY_ID_PATTERN)
    secrets: list[StoredSecret] = Field(default_factory=list)
    created_at: float = 0.0
    updated_at: float = 0.0
    revoked_at: float | None = None
    rev: int = 0

    def live_secrets(self, now: float) -> list[StoredSecret]:
        if self.revoked_at is not None:
            return []
        return [secret for secret in self.secrets if secret.live(now)]

    def public(self, now: float) -> dict[str, Any]:
        """The record as the API shows it: no digest, no secret."""
        policy = self.model_dump(exclude={"secrets", "rev"})
        return {
            **policy,
            "origin": "api",
            "revoked": self.revoked_at is not None,
            "secrets": [
                {**secret.public(), "live": secret.live(now) and self.revoked_at is None}
                for secret in self.secrets
            ],
        }


class StoredTeam(LimitSettings):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=KEY_ID_PATTERN)
    created_at: float = 0.0
    updated_at: float = 0.0
    rev: int = 0


class Snapshot(BaseModel):
    """Everything a store holds, as one consistent read."""

    version: int = 0
    keys: dict[str, StoredKey] = {}
    teams: dict[str, StoredTeam] = {}


def new_secret(expires_at: float | None = None) -> tuple[str, StoredSecret]:
    """A fresh secret (256 random bits) and what is stored of it."""
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    stored = StoredSecret(
        id=f"sec_{os.urandom(6).hex()}",
        sha256=hashlib.sha256(secret.encode()).hexdigest(),
        hint=f"...{secret[-4:]}",
        created_at=time.time(),
        expires_at=expires_at,
    )
    return secret, stored


Record = StoredKey | StoredTeam  # what a key store holds under a name
