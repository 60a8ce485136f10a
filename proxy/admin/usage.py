"""GET /admin/usage: per-key usage rows, filtered and (`group_by`) summed.

    GET /admin/usage?key=&team=&model=&since=&until=&group_by=team,day

Rows are per key, model and UTC day (`group_by` absent), or sums per any of key, team,
model, day and user (`user`: the end user a request named in its `user` field; those rows
have no model). Days are UTC, `since` defaults to the 1st of this month, `until` to today.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from proxy.admin.access import check_admin
from proxy.errors import ProxyError, bad_request
from proxy.quota.ledger import NANO, UsageCounts, UsageRow
from proxy.quota.windows import day_of
from proxy.state import ProxyState

GROUPS = ("key", "team", "model", "day", "user")


def _day(request: Request, name: str, default: str) -> str:
    value = request.query_params.get(name) or default
    try:
        return dt.date.fromisoformat(value[:10]).isoformat()
    except ValueError:
        raise bad_request(
            f"Invalid {name}={value!r}: expected a date like 2026-12-01.", param=name
        ) from None


async def usage_rows(
    state: ProxyState,
    since: str,
    until: str,
    *,
    key: str | None = None,
    team: str | None = None,
    model: str | None = None,
    users: bool = False,
) -> list[UsageRow]:
    """The ledger's rows, filtered. Raises ProxyError 503 when the ledger is down."""
    try:
        rows = await state.meter.ledger.usage(
            None if key is None else [key], since, until, users=users
        )
    except Exception as exc:  # the ledger is down
        raise ProxyError(
            503, f"Usage is unavailable: {type(exc).__name__}", type="server_error",
            code="usage_unavailable",
        ) from None  # fmt: skip
    return [
        row
        for row in rows
        if (model is None or row.model == model) and (team is None or row.team == team)
    ]


def grouped(rows: Iterable[UsageRow], by: tuple[str, ...]) -> list[dict[str, Any]]:
    """Rows summed per distinct value of the `by` fields, sorted by them."""
    sums: dict[tuple[Any, ...], UsageCounts] = {}
    for row in rows:
        values = {"key": row.key, "team": row.team, "model": row.model, "day": row.day}
        values["user"] = row.user
        group = tuple(values[name] for name in by)
        found = sums.get(group)
        sums[group] = row.counts if found is None else found.plus(row.counts)
    out = []
    for group in sorted(sums, key=lambda g: tuple("" if v is None else str(v) for v in g)):
        counts: dict[str, Any] = sums[group]._asdict()
        cost = counts.pop("cost_nano_usd") / NANO
        out.append({**dict(zip(by, group, strict=True)), **counts, "cost_usd": cost})
    return out


async def admin_usage(request: Request) -> Response:
    """Usage rows per key, model and day; filters: key, team, model, since, until (UTC
    days); `group_by`: a comma list of key, team, model, day, user."""
    try:
        state, _ = check_admin(request)
        today = day_of(state.meter.clock())
        since = _day(request, "since", today[:8] + "01")
        until = _day(request, "until", today)
        params = request.query_params
        by = tuple(part for part in params.get("group_by", "").split(",") if part)
        unknown = [name for name in by if name not in GROUPS]
        if unknown:
            raise bad_request(
                f"Invalid group_by {unknown[0]!r}: any of {', '.join(GROUPS)}.", param="group_by"
            )
        users = "user" in by
        if users and "model" in by:
            raise bad_request(
                "group_by cannot hold both user and model: end-user rows are kept per key "
                "and day across models.",
                param="group_by",
            )
        rows = await usage_rows(
            state, since, until, key=params.get("key") or None, team=params.get("team") or None,
            model=params.get("model") or None, users=users,
        )  # fmt: skip
    except ProxyError as exc:
        return exc.response()
    data = grouped(rows, by) if by else [row.as_json() for row in rows]
    total_cost = sum(row.counts.cost_nano_usd for row in rows) / NANO
    return JSONResponse(
        {
            "object": "list",
            "since": since,
            "until": until,
            "data": data,
            "total_cost_usd": total_cost,
        }
    )
