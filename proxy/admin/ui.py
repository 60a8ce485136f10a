"""GET /admin/ui: one server-rendered page for operators (the admin token; a browser asks
for it as the password of HTTP Basic, any user name).

Spend, tokens saved by compaction and requests per day, stacked by team, key or model
(`?by=`), over the last `?days=` (default 14) UTC days from the usage ledger (every replica's
keyed requests); spend by key and requests by model over the period; each limited key's
quota state now; recent compactions (see proxy/admin/recent.py); this replica's counters
since it started. Charts are inline SVG drawn here (proxy/admin/charts.py): no script,
nothing loaded from elsewhere (the page's content security policy says so).
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from html import escape
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from proxy.admin.access import check_admin
from proxy.admin.charts import horizontal_bars, meter, stacked_bars
from proxy.admin.quota import quota_state
from proxy.admin.recent import RecentSource
from proxy.admin.usage import usage_rows
from proxy.errors import ProxyError
from proxy.quota.ledger import NANO, UsageRow
from proxy.quota.windows import day_of
from proxy.state import ProxyState

_BY = ("team", "key", "model")
_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; frame-ancestors 'none'"

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 8px}
.sub{color:#666;margin-bottom:16px} .sub a{margin-right:8px}
.cards{display:flex;gap:12px;flex-wrap:wrap} .card{background:#fff;border:1px solid #ddd;
border-radius:6px;padding:10px 14px;min-width:150px} .card b{display:block;font-size:20px}
.charts{display:flex;gap:16px;flex-wrap:wrap} .chart{background:#fff;border:1px solid #ddd;
border-radius:6px} .chart .title{font-weight:600;font-size:13px}
.chart .axis,.chart .legend{font-size:11px;fill:#555} .chart .grid{stroke:#eee}
.chart .empty{font-size:12px;fill:#999}
table{border-collapse:collapse;background:#fff} td,th{border:1px solid #ddd;padding:4px 8px;
text-align:left;font-size:13px} th{background:#f0f0f0} td.n{text-align:right}
.notice{background:#fff3cd;border:1px solid #e0c060;padding:8px;border-radius:6px}
"""


def _usd(value: float) -> str:
    return f"${value:,.4f}" if value < 1 else f"${value:,.2f}"


def _usd_axis(value: float) -> str:
    return f"${value:,.2f}" if value >= 0.1 or value == 0 else f"${value:.4f}".rstrip("0")


def _count(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.1f}M"
    if value >= 1e4:
        return f"{value / 1e3:.0f}k"
    return f"{value:,.0f}"


def _days(until: str, count: int) -> list[str]:
    end = dt.date.fromisoformat(until)
    return [(end - dt.timedelta(days=count - 1 - i)).isoformat() for i in range(count)]


def _by_day(rows: list[UsageRow], days: list[str], by: str, value: Any) -> dict[str, list[float]]:
    index = {day: i for i, day in enumerate(days)}
    series: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(days))
    for row in rows:
        if row.day in index:
            name = {"team": row.team or "", "key": row.key, "model": row.model}[by]
            series[name][index[row.day]] += value(row)
    return dict(series)


def _totals(rows: list[UsageRow], field: str, value: Any) -> list[tuple[str, float]]:
    sums: dict[str, float] = defaultdict(float)
    for row in rows:
        sums[getattr(row, field) or ""] += value(row)
    return list(sums.items())


def _cost(row: UsageRow) -> float:
    return row.counts.cost_nano_usd / NANO


def _quota_table(state_rows: list[dict[str, Any]]) -> str:
    if not state_rows:
        return "<p>No key has quotas.</p>"
    lines = [
        "<table id=quota><tr><th>key</th><th>team</th><th>limit</th><th>used</th>"
        "<th>of</th><th></th></tr>"
    ]
    for row in state_rows:
        limits = [("", item) for item in row["limits"]]
        limits += [("team ", item) for item in row["team_limits"]]
        for whose, item in limits:
            spend = item["limit"].startswith("spend")
            used = _usd(item["used"]) if spend else _count(item["used"])
            most = _usd(item["max"]) if spend else _count(item["max"])
            lines.append(
                f"<tr><td>{escape(row['key_id'])}</td><td>{escape(row['team'] or '')}</td>"
                f"<td>{escape(whose + item['limit'])}</td><td class=n>{used}</td>"
                f"<td class=n>{most}</td><td>{meter(item['used'], item['max'])}</td></tr>"
            )
    lines.append("</table>")
    return "".join(lines)


def _recent_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p>No compaction on this replica since it started.</p>"
    head = ("time", "request", "key", "model", "status", "tokens before", "after", "saved")
    lines = ["<table id=recent><tr>", *(f"<th>{name}</th>" for name in head), "</tr>"]
    for row in rows:
        before, after = row.get("tokens_before"), row.get("tokens_after")
        saved = before - after if isinstance(before, int) and isinstance(after, int) else None
        cells = [
            row.get("time"), row.get("request_id"), row.get("key_id"), row.get("model"),
            row.get("status"), before, after, saved,
        ]  # fmt: skip
        when = str(cells[0] or "")
        cells[0] = when[5:19].replace("T", " ") if len(when) >= 19 else when
        lines.append("<tr>")
        for i, cell in enumerate(cells):
            text = "" if cell is None else str(cell)
            lines.append(f"<td{' class=n' if i >= 5 else ''}>{escape(text)}</td>")
        lines.append("</tr>")
    lines.append("</table>")
    return "".join(lines)


def _replica_cards(state: ProxyState, request: Request) -> str:
    """This replica's own counters since start (keyed or not), from its metrics."""
    registry = request.app.state.metrics.registry
    read = registry.get_sample_value
    saved = read("compaction_proxy_prompt_tokens_saved_total") or 0.0
    before = read("compaction_proxy_prompt_tokens_total", {"stage": "before"}) or 0.0
    share = f"{100 * saved / before:.1f}%" if before else "-"
    return (
        f'<div class="card">tokens saved (this replica)<b id=replica-saved>{_count(saved)}</b>'
        f"{share} of prompt tokens</div>"
    )


async def admin_ui(request: Request) -> Response:
    try:
        state, _ = check_admin(request, browser=True)
    except ProxyError as exc:
        return exc.response()
    params = request.query_params
    days_raw = params.get("days", "14")
    count = int(days_raw) if days_raw.isdigit() and 1 <= int(days_raw) <= 92 else 14
    by = params.get("by", "team")
    by = by if by in _BY else "team"
    until = day_of(state.meter.clock())
    days = _days(until, count)
    notices: list[str] = []
    rows: list[UsageRow] = []
    try:
        rows = await usage_rows(state, days[0], until)
    except ProxyError as exc:
        notices.append(exc.message)
    try:
        quotas = await quota_state(state)
    except ProxyError as exc:
        quotas = []
        notices.append(exc.message)
    source: RecentSource = request.app.state.recent_compactions
    recent = await source(20)
    if by == "team" and not any(row.team for row in rows):
        by = "key"  # no teams: a single "(none)" series says nothing
    spend = sum(_cost(row) for row in rows)
    requests = sum(row.counts.requests for row in rows)
    saved = sum(row.counts.tokens_saved for row in rows)
    sent = sum(row.counts.prompt_tokens_sent for row in rows)
    links = (
        " ".join(f'<a href="?days={count}&amp;by={name}">by {name}</a>' for name in _BY)
        + " "
        + " ".join(f'<a href="?days={n}&amp;by={by}">{n} days</a>' for n in (7, 14, 30))
    )
    charts = [
        stacked_bars(f"Spend per day, by {by}", days, _by_day(rows, days, by, _cost), _usd_axis),
        stacked_bars(
            f"Prompt tokens saved by compaction per day, by {by}", days,
            _by_day(rows, days, by, lambda row: row.counts.tokens_saved), _count,
        ),
        stacked_bars(
            f"Requests per day, by {by}", days,
            _by_day(rows, days, by, lambda row: row.counts.requests), _count,
        ),
        horizontal_bars(f"Spend by key, {count} days", _totals(rows, "key", _cost), _usd),
        horizontal_bars(
            f"Requests by model, {count} days",
            _totals(rows, "model", lambda row: row.counts.requests), _count,
        ),
    ]  # fmt: skip
    share = f"{100 * saved / sent:.1f}% of prompt tokens" if sent else "no prompt tokens"
    html = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        "<title>compaction-proxy admin</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>compaction-proxy</h1>",
        f'<div class="sub">{escape(days[0])} to {escape(until)} (UTC), every replica\'s '
        f"keyed requests. {links}</div>",
        *(f'<p class="notice">{escape(text)}</p>' for text in notices),
        '<div class="cards">',
        f'<div class="card">spend<b id=spend>{_usd(spend)}</b>{count} days</div>',
        f'<div class="card">requests<b id=requests>{_count(requests)}</b>{count} days</div>',
        f'<div class="card">tokens saved<b id=saved>{_count(saved)}</b>{share}</div>',
        _replica_cards(state, request),
        "</div>",
        '<h2>Usage</h2><div class="charts">',
        *charts,
        "</div>",
        "<h2>Quota state now</h2>",
        _quota_table(quotas),
        "<h2>Recent compactions</h2>",
        _recent_table(recent),
        "<p class=sub>JSON: /admin/usage, /admin/quota, /admin/keys, /admin/teams, "
        "/admin/audit</p>",
        "</body></html>",
    ]
    return HTMLResponse(
        "".join(html),
        headers={
            "content-security-policy": _CSP,
            "cache-control": "no-store",
            "x-content-type-options": "nosniff",
        },
    )
