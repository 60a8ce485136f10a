"""GET /admin/quota: each limited key's quotas and how much of them is used right now."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from proxy.admin.access import check_admin
from proxy.auth.keys import Limits
from proxy.errors import ProxyError
from proxy.quota.ledger import NANO, Counters, LedgerUnavailable
from proxy.quota.windows import windows_at
from proxy.state import ProxyState


def _used(limits: Limits, counters: Counters) -> list[dict[str, Any]]:
    """One entry per limit set: its name, the limit, what is used (spend in dollars)."""
    used = {
        "requests_per_minute": counters.requests,
        "prompt_tokens_per_minute": counters.tokens_minute,
        "prompt_tokens_per_day": counters.tokens_day,
        "spend_usd_per_day": counters.spend_day_nano / NANO,
        "spend_usd_per_month": counters.spend_month_nano / NANO,
    }
    return [
        {"limit": name, "max": value, "used": used[name]}
        for name, value in limits.as_dict().items()
        if value is not None
    ]


async def quota_state(state: ProxyState) -> list[dict[str, Any]]:
    """Limited keys, with their (and their team's) limits and use in the current windows.
    Raises ProxyError 503 when the ledger is down."""
    w = windows_at(state.quotas.clock())
    rows = []
    for key in sorted(state.gate.source.ring.proxy_keys(), key=lambda k: k.id):
        if not key.limited:
            continue
        try:
            own, team = await state.quotas.ledger.peek(key.id, key.team, w)
        except LedgerUnavailable as exc:
            raise ProxyError(
                503, f"Quota state is unavailable: {exc}", type="server_error",
                code="quota_unavailable",
            ) from None  # fmt: skip
        rows.append(
            {
                "key_id": key.id,
                "team": key.team,
                "limits": _used(key.limits, own),
                "team_limits": _used(key.team_limits, team),
            }
        )
    return rows


async def admin_quota(request: Request) -> Response:
    try:
        state, _ = check_admin(request)
        data = await quota_state(state)
    except ProxyError as exc:
        return exc.response()
    return JSONResponse({"object": "list", "data": data})
