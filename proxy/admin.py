"""/admin/*: usage and key policy for operators, behind the admin token (`admin.token_env`).

No admin token configured: every admin route answers 401 and says how to configure one.
"""

from __future__ import annotations

import datetime as dt
import hmac
import os

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from proxy.auth.keys import presented_key
from proxy.errors import ProxyError, bad_request
from proxy.headers import client_headers_of
from proxy.quota.ledger import NANO
from proxy.quota.windows import day_of
from proxy.state import ProxyState


def _check_admin(request: Request) -> ProxyState:
    state: ProxyState = request.app.state.proxy
    env = state.settings.admin.token_env
    token = os.environ.get(env) if env else None
    if not token:
        raise ProxyError(
            401,
            "The admin API is off: set admin.token_env to the name of an environment variable "
            "holding the admin token.",
            code="invalid_api_key",
        )
    presented = presented_key(client_headers_of(request.scope))
    if presented is None or not hmac.compare_digest(
        presented.encode("utf-8", errors="surrogatepass"), token.encode("utf-8")
    ):
        raise ProxyError(
            401, "Missing or wrong admin token (Authorization: Bearer <token>).",
            code="invalid_api_key",
        )  # fmt: skip
    return state


def _day(request: Request, name: str, default: str) -> str:
    value = request.query_params.get(name) or default
    try:
        return dt.date.fromisoformat(value[:10]).isoformat()
    except ValueError:
        raise bad_request(
            f"Invalid {name}={value!r}: expected a date like 2026-12-01.", param=name
        ) from None


async def admin_usage(request: Request) -> Response:
    """Usage rows per key, model and day; filters: key, model, since, until (UTC days)."""
    try:
        state = _check_admin(request)
        today = day_of(state.meter.clock())
        since = _day(request, "since", today[:8] + "01")
        until = _day(request, "until", today)
        key = request.query_params.get("key") or None
        model = request.query_params.get("model") or None
        rows = await state.meter.ledger.usage(None if key is None else [key], since, until)
    except ProxyError as exc:
        return exc.response()
    except Exception as exc:  # the ledger is down
        return ProxyError(
            503, f"Usage is unavailable: {type(exc).__name__}", type="server_error",
            code="usage_unavailable",
        ).response()  # fmt: skip
    rows = [row for row in rows if model is None or row.model == model]
    total_cost = sum(row.counts.cost_nano_usd for row in rows) / NANO
    return JSONResponse(
        {
            "object": "list",
            "since": since,
            "until": until,
            "data": [row.as_json() for row in rows],
            "total_cost_usd": total_cost,
        }
    )


async def admin_keys(request: Request) -> Response:
    """Key ids and their policy; never key material or credentials."""
    try:
        state = _check_admin(request)
    except ProxyError as exc:
        return exc.response()
    keys = state.gate.source.ring.keys()
    return JSONResponse({"object": "list", "data": [key.policy() for key in keys]})
