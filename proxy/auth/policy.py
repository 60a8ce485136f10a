"""Decisions the request path asks about keys; each returns a value or raises ProxyError."""

from __future__ import annotations

import ipaddress

from proxy.auth.keys import KeyRing, ProxyKey
from proxy.errors import ProxyError
from proxy.settings import Settings


def authenticate(
    ring: KeyRing, digest: bytes | None, *, now: float = 0.0, store_ready: bool = True
) -> tuple[ProxyKey, float | None]:
    """(the key whose digest the client presents, when that secret expires), or 401 in
    OpenAI's shape (the SDK's AuthenticationError) for no key (`digest` None), an unknown or
    an expired one. A key the ring does not know while the key store has not answered yet
    gets 503 instead: it may well be valid."""
    if digest is None:
        raise ProxyError(
            401,
            "Missing API key: this proxy needs a proxy key in 'Authorization: Bearer <key>' "
            "(or an 'api-key' header).",
            code="invalid_api_key",
        )
    found = ring.by_digest(digest)
    if found is None:
        if not store_ready:
            raise ProxyError(
                503,
                "The proxy cannot check this key yet: its key store has not answered. "
                "Try again shortly.",
                type="server_error",
                code="keys_unavailable",
                headers={"retry-after": "1"},
            )
        raise ProxyError(
            401,
            "Incorrect API key provided: this proxy does not know the key you sent.",
            code="invalid_api_key",
        )
    expires = found[1]
    if expires is not None and now >= expires:
        raise expired(found[0])
    return found


def expired(key: ProxyKey) -> ProxyError:
    return ProxyError(
        401,
        f"The key you sent for {key.id!r} has expired (it was rotated); use its new secret.",
        code="invalid_api_key",
    )


def check_model(key: ProxyKey, model: str) -> None:
    """403 unless the key may use `model` ("" = no model named: allowed)."""
    if model and not key.allows(model):
        raise ProxyError(
            403,
            f"The key {key.id!r} may not use the model {model!r} "
            f"(allowed: {', '.join(key.allowed_models) or 'none'}).",
            param="model",
            code="model_not_allowed",
        )


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: assume it is reachable


def check_exposure(settings: Settings, keys_configured: bool) -> str | None:
    """Why the proxy must not start, or None: an upstream key served to anyone who can connect."""
    if keys_configured or settings.auth.allow_anonymous or settings.upstream.api_key is None:
        return None
    if _is_loopback(settings.server.host):
        return None
    return (
        f"refusing to serve {settings.server.host}:{settings.server.port} with upstream.api_key "
        "set and no proxy keys: anyone who can connect would spend it. Configure [[auth.keys]] "
        "(or auth.keys_file), bind 127.0.0.1, or set auth.allow_anonymous = true."
    )
