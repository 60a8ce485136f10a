"""Who may use /admin/*: whoever presents the admin token (`admin.token_env`).

As `Authorization: Bearer <token>` (the API, the CLI) or as the password of HTTP Basic
(a browser on /admin/ui asks for it; any user name). Compared in constant time. Without an
admin token configured, every admin route answers 401 and says how to configure one.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
import re
from dataclasses import dataclass

from starlette.requests import Request

from proxy.errors import ProxyError
from proxy.state import ProxyState

ACTOR_HEADER = "x-admin-actor"
_ACTOR = re.compile(r"[^A-Za-z0-9_.:@+/ -]")


@dataclass(frozen=True)
class Actor:
    """Who made an admin call, for the audit trail: a name the caller gives (the CLI sends
    the local user, `x-admin-actor`; else "admin") and where it came from."""

    name: str
    client: str | None


def admin_token(state: ProxyState) -> str | None:
    env = state.settings.admin.token_env
    return os.environ.get(env) or None if env else None


def _presented(request: Request) -> str | None:
    scheme, _, value = request.headers.get("authorization", "").strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer" and value:
        return value
    if scheme.lower() == "basic" and value:
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2] or None
    return None


def check_admin(request: Request, *, browser: bool = False) -> tuple[ProxyState, Actor]:
    """The app's state and the caller, or a 401 ProxyError. `browser`: the 401 asks for
    Basic credentials, so a browser shows its login prompt."""
    state: ProxyState = request.app.state.proxy
    token = admin_token(state)
    challenge = {"www-authenticate": 'Basic realm="compaction-proxy admin"'} if browser else {}
    if not token:
        raise ProxyError(
            401,
            "The admin API is off: set admin.token_env to the name of an environment variable "
            "holding the admin token.",
            code="invalid_api_key",
        )
    presented = _presented(request)
    if presented is None or not hmac.compare_digest(
        presented.encode("utf-8", errors="surrogatepass"), token.encode("utf-8")
    ):
        raise ProxyError(
            401,
            "Missing or wrong admin token (Authorization: Bearer <token>).",
            code="invalid_api_key",
            headers=challenge,
        )
    name = _ACTOR.sub("", request.headers.get(ACTOR_HEADER, ""))[:64].strip() or "admin"
    client = request.client.host if request.client is not None else None
    return state, Actor(name, client)
