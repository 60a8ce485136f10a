"""Decisions the request path asks about keys; each returns a value or raises ProxyError."""

from __future__ import annotations

import ipaddress

from proxy.auth.keys import KeyRing, ProxyKey
from proxy.errors import ProxyError
from proxy.settings import Settings


def authenticate(ring: KeyRing, digest: bytes | None) -> ProxyKey:
    """The key whose digest the client presents (`presented_digest`, None: no key), or 401
    in OpenAI's shape (the SDK's AuthenticationError)."""
    if digest is None:
        raise ProxyError(
            401,
            "Missing API key: this proxy needs a proxy key in 'Authorization: Bearer <key>' "
            "(or an 'api-key' header).",
            code="invalid_api_key",
        )
    key = ring.by_digest(digest)
    if key is None:
        raise ProxyError(
            401,
            "Incorrect API key provided: this proxy does not know the key you sent.",
            code="invalid_api_key",
        )
    return key


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
