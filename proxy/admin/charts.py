"""Small SVG charts drawn on the server: stacked bars over days, horizontal bars, a meter.

No script and nothing fetched: the admin page is plain HTML with these inline, so it works
offline, behind any content security policy, and in any browser. Every text is escaped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from html import escape

PALETTE = (
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac",
)  # fmt: skip
MAX_SERIES = len(PALETTE) - 1  # the rest is summed as "other"

Format = Callable[[float], str]


def top_series(series: dict[str, list[float]], limit: int = MAX_SERIES) -> dict[str, list[float]]:
    """The `limit` largest series by total, the others summed into "other"."""
    ranked = sorted(series, key=lambda name: -sum(series[name]))
    kept = {name: series[name] for name in ranked[:limit]}
    rest = ranked[limit:]
    if rest:
        length = len(next(iter(series.values())))
        kept["other"] = [sum(series[name][i] for name in rest) for i in range(length)]
    return kept


def _ticks(top: float) -> list[float]:
    """Four round steps from 0 to at least `top`."""
    if top <= 0:
        return [0.0, 1.0]
    magnitude = 10 ** math.floor(math.log10(top / 4))
    step = next(
        magnitude * factor for factor in (1, 2, 2.5, 5, 10) if magnitude * factor * 4 >= top
    )
    return [step * i for i in range(5)]


def stacked_bars(
    title: str,
    categories: Sequence[str],
    series: dict[str, list[float]],
    fmt: Format,
    *,
    width: int = 600,
    height: int = 240,
) -> str:
    """Bars per category (days), each stacked by series, with a legend and tooltips."""
    series = top_series(series)
    left, right, top, bottom = 64, 12, 28, 40
    plot_w, plot_h = width - left - right, height - top - bottom
    totals = [sum(values[i] for values in series.values()) for i in range(len(categories))]
    ticks = _ticks(max(totals, default=0.0))
    scale = plot_h / ticks[-1] if ticks[-1] else 0.0
    parts = [
        f'<svg class="chart" role="img" width="{width}" height="{height + 22}" '
        f'viewBox="0 0 {width} {height + 22}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
        f'<text x="{left}" y="16" class="title">{escape(title)}</text>',
    ]
    for tick in ticks:
        y = top + plot_h - tick * scale
        parts.append(
            f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" class="axis" text-anchor="end">'
            f"{escape(fmt(tick))}</text>"
        )
    count = max(1, len(categories))
    slot = plot_w / count
    bar = max(2.0, slot * 0.7)
    for i, category in enumerate(categories):
        x = left + i * slot + (slot - bar) / 2
        y = top + plot_h
        for (name, values), color in zip(series.items(), PALETTE, strict=False):
            value = values[i]
            if value <= 0:
                continue
            h = value * scale
            y -= h
            parts.append(
                f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" height="{h:.1f}" '
                f'fill="{color}"><title>{escape(category)} {escape(name)}: '
                f"{escape(fmt(value))}</title></rect>"
            )
        if count <= 16 or i % max(1, count // 8) == 0:
            parts.append(
                f'<text x="{left + i * slot + slot / 2:.1f}" y="{top + plot_h + 14}" '
                f'class="axis" text-anchor="middle">{escape(category[-5:])}</text>'
            )
    parts.append(_legend(list(series), left, height + 4))
    if not any(totals):
        parts.append(
            f'<text x="{left + plot_w / 2:.1f}" y="{top + plot_h / 2:.1f}" class="empty" '
            'text-anchor="middle">nothing in this period</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _legend(names: list[str], x: float, y: float) -> str:
    parts = []
    for name, color in zip(names, PALETTE, strict=False):
        label = name or "(none)"
        parts.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="10" height="10" fill="{color}"/>'
            f'<text x="{x + 14:.1f}" y="{y + 9:.1f}" class="legend">{escape(label)}</text>'
        )
        x += 24 + 7 * min(len(label), 24)
    return "".join(parts)


def horizontal_bars(
    title: str, items: Sequence[tuple[str, float]], fmt: Format, *, width: int = 340
) -> str:
    """One bar per item (the largest 12), labelled with its value."""
    items = sorted(items, key=lambda item: -item[1])[:12]
    row, top, label_w = 22, 28, 120
    height = top + row * max(1, len(items)) + 8
    most = max((value for _, value in items), default=0.0) or 1.0
    plot_w = width - label_w - 70
    parts = [
        f'<svg class="chart" role="img" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
        f'<text x="4" y="16" class="title">{escape(title)}</text>',
    ]
    for i, ((label, value), color) in enumerate(zip(items, PALETTE * 2, strict=False)):
        y = top + i * row
        w = max(1.0, plot_w * value / most) if value > 0 else 0.0
        parts.append(
            f'<text x="{label_w - 6}" y="{y + 14}" class="axis" text-anchor="end">'
            f"{escape((label or '(none)')[:22])}</text>"
            f'<rect class="bar" x="{label_w}" y="{y + 3}" width="{w:.1f}" height="15" '
            f'fill="{color}"><title>{escape(label)}: {escape(fmt(value))}</title></rect>'
            f'<text x="{label_w + w + 6:.1f}" y="{y + 14}" class="axis">{escape(fmt(value))}</text>'
        )
    if not items:
        parts.append(f'<text x="{label_w}" y="{top + 14}" class="empty">nothing yet</text>')
    parts.append("</svg>")
    return "".join(parts)


def meter(used: float, limit: float, *, width: int = 160) -> str:
    """A bar filled to used/limit (red from 90%)."""
    share = 0.0 if limit <= 0 else min(1.0, max(0.0, used / limit))
    color = "#e15759" if share >= 0.9 else "#f28e2b" if share >= 0.6 else "#59a14f"
    return (
        f'<svg class="meter" width="{width}" height="12" viewBox="0 0 {width} 12" '
        f'xmlns="http://www.w3.org/2000/svg"><rect width="{width}" height="12" fill="#eee"/>'
        f'<rect class="bar" width="{width * share:.1f}" height="12" fill="{color}"/></svg>'
    )
