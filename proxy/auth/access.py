"""Who is calling, and with which credential the proxy talks upstream on their behalf.

`Gate.admit` runs first on every /v1 request. Its `Caller` is then the only source of the
upstream credential: for the forwarded request (`headers.upstream_request_headers`), for the
summarizer call (`headers.summarizer_request_headers`) and for the summary store's scope.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.auth.keys import KeyRing, ProxyKey, presented_digest
from proxy.auth.policy import authenticate, expired
from proxy.auth.source import KeySource
from proxy.headers import (
    Headers,
    credential_of,
    summarizer_request_headers,
    upstream_request_headers,
)
from proxy.settings import Settings
from proxy.store import scope_for


@dataclass(frozen=True)
class Caller:
    """The authenticated client (`key` is None when the proxy runs without keys)."""

    key: ProxyKey | None
    # Replaces the client's credential upstream; None: forward the client's own (no keys).
    upstream_api_key: str | None
    summarizer_api_key: str | None
    # The summary store's scope when it follows the key (see Gate.scope); made once per key.
    key_scope: str | None = None
    key_id: str | None = None  # `key.id`, read on every request
    team: str | None = None  # `key.team`
    expires_at: float | None = None  # when the secret presented stops working (unix time)

    def upstream_headers(self, client_headers: Headers, request_id: str) -> Headers:
        return upstream_request_headers(
            client_headers,
            request_id=request_id,
            api_key=self.upstream_api_key,
            forward_client_credential=self.key is None,
        )

    def summarizer_headers(self, client_headers: Headers, request_id: str) -> dict[str, str]:
        return summarizer_request_headers(
            client_headers,
            request_id=request_id,
            api_key=self.summarizer_api_key,
            forward_client_credential=self.key is None,
        )


class Gate:
    """Admission for /v1: with keys configured, every request must carry a known one."""

    def __init__(self, settings: Settings, source: KeySource) -> None:
        self.source = source
        self.settings = settings
        upstream = settings.upstream.api_key
        summarizer = settings.compaction.summarizer.api_key
        self._upstream_key = upstream.get_secret_value() if upstream else None
        self._summarizer_key = summarizer.get_secret_value() if summarizer else None
        self._anonymous = Caller(
            None, self._upstream_key, self._summarizer_key or self._upstream_key
        )
        # Callers of the ring in use by key digest (only keys it holds: bounded by it).
        self._ring: KeyRing | None = None
        self._by_digest: dict[bytes, Caller] = {}

    @property
    def enabled(self) -> bool:
        return self.source.configured

    def admit(self, raw_headers: Sequence[tuple[bytes, bytes]]) -> Caller:
        """The caller presenting a key in the client's wire headers, or a 401 ProxyError
        (`invalid_api_key`)."""
        source = self.source
        if not source.configured:
            return self._anonymous
        if source.watched:  # a keys file or the key store: changes apply before judging
            source.check()
        digest = presented_digest(raw_headers)
        if digest is not None and source.ring is self._ring:
            caller = self._by_digest.get(digest)
            if caller is not None:
                if caller.expires_at is not None and source.wall() >= caller.expires_at:
                    assert caller.key is not None
                    raise expired(caller.key)
                return caller
        return self._first(source.ring, digest)

    def _first(self, ring: KeyRing, digest: bytes | None) -> Caller:
        """The caller of a secret not seen with this ring yet (its first request since start
        or since a reload: a reloaded key gets a new caller), or a 401 (no key, an unknown
        or expired one)."""
        if ring is not self._ring:
            self._ring, self._by_digest = ring, {}
        source = self.source
        key, expires = authenticate(ring, digest, now=source.wall(), store_ready=source.store_ready)
        assert digest is not None
        upstream = key.upstream_api_key or self._upstream_key
        scope = scope_for(None, self.settings.cache.scope, key_id=key.id)
        caller = Caller(
            key, upstream, self._summarizer_key or upstream, scope, key.id, key.team, expires
        )
        self._by_digest[digest] = caller
        return caller

    def scope(self, caller: Caller, client_headers: Headers) -> str | None:
        """The summary store tenant: the key id with keys, else the client's credential
        (None: no store)."""
        if caller.key_scope is not None:
            return caller.key_scope
        cache = self.settings.cache
        return scope_for(
            credential_of(client_headers),
            cache.scope,
            key_id=caller.key_id,
            anonymous=cache.anonymous,
        )
