"""report.json, report.md and the plots, written into the output folder."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from proxy.replay.plots import plot_all


def write_report(report: dict[str, Any], out: Path) -> list[Path]:
    """Everything the report has, so far; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "report.json", out / "report.md"]
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    plots = plot_all(report, out)
    (out / "report.md").write_text(markdown(report, plots), encoding="utf-8")
    return written + plots


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _usd(value: float | None) -> str:
    return "-" if value is None else f"${value:.4f}"


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _budget(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def summary_table(rows: Sequence[dict[str, Any]], judged: bool) -> list[str]:
    header = [
        "strategy",
        "budget",
        "cost vs none",
        "cost",
        "cached",
        "summarizer calls (in/out tokens)",
        "over budget (honest)",
        "invalid",
        "prefix kept",
        "recall mean / worst",
        "task / ask verbatim",
    ]
    if judged:
        header.append("probes full / compacted")
    body = []
    for r in rows:
        cells = [
            r["strategy"],
            _budget(r["budget"]),
            _ratio(r["cost_ratio"]),
            _usd(r["total_usd"]),
            _pct(r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else None),
            f"{r['summarizer_calls']} ({r['summarizer_input_tokens']:,}/"
            f"{r['summarizer_output_tokens']:,})",
            f"{r['over_budget_turns']} ({r['over_budget_honest']})",
            str(r["invalid_requests"]),
            _pct(r["prefix_stability"]),
            f"{_pct(r['recall_mean'])} / {_pct(r['recall_worst'])}",
            f"{_pct(r['task_verbatim'])} / {_pct(r['ask_verbatim'])}",
        ]
        if judged:
            cells.append(f"{_score(r['probe_full'])} / {_score(r['probe_compacted'])}")
        body.append(cells)
    return _table(header, body)


def markdown(report: dict[str, Any], plots: Sequence[Path] = ()) -> str:
    judged = report.get("judge") is not None
    lines = ["# Replay report", ""]
    if not report.get("complete"):
        lines += [
            "**Incomplete**: the replay was interrupted; the runs below are those that finished.",
            "",
        ]
    summarizer = report.get("summarizer") or {}
    model = summarizer.get("model") or "(each request's model)"
    lines.append(f"Created {report.get('created')}; summarizer {model} at {summarizer.get('url')}.")
    if judged:
        judge = report["judge"]
        lines.append(f"Judge {judge['model']}, answers by {judge['answer_model']}.")
    lines += ["", "## Sessions", ""]
    lines += _table(
        ["session", "model", "turns", "messages", "forwarded tokens at the end (none)"],
        [
            [s["name"], s["model"], str(s["turns"]), str(s["messages"]), _final(report, s)]
            for s in report["sessions"]
        ],
    )
    lines += ["", "## All sessions, per strategy and budget", ""]
    lines += summary_table(report["summary"], judged)
    lines += [
        "",
        "cost vs none: prompt + summarizer dollars over the baseline's, with "
        "simulated prompt caching; cached: share of forwarded prompt tokens billed as "
        "cached; over budget (honest): forwarded over the budget (of which the status "
        "said so); prefix kept: turns whose forwarded request extends the previous one; "
        "recall: needed-later identifiers still present after a compaction.",
        "",
    ]
    lines += ["## Per session", ""]
    header = [
        "session",
        "strategy",
        "budget",
        "status",
        "forwarded min / median / max",
        "statuses",
        "cost vs none",
        "recall mean / worst",
        "often lost",
    ]
    body = []
    for r in report["runs"]:
        tokens = r.get("forwarded_tokens") or {}
        statuses = ", ".join(f"{k} {v}" for k, v in sorted((r.get("statuses") or {}).items()))
        recall = r.get("recall") or {}
        body.append(
            [
                r["session"],
                r["strategy"],
                _budget(r["budget"]),
                r["status"] if r["status"] == "ok" else f"{r['status']}: {r['error']}",
                " / ".join(f"{int(tokens.get(k, 0)):,}" for k in ("min", "median", "max")),
                statuses,
                _ratio((r.get("cost") or {}).get("ratio_to_none")),
                f"{_pct(recall.get('mean'))} / {_pct(recall.get('worst'))}",
                ", ".join(f"`{i}`" for i in (recall.get("lost") or [])[:4]) or "-",
            ]
        )
    lines += _table(header, body)
    if judged:
        lines += ["", "## Probes by kind (mean score 0-5: full history / compacted)", ""]
        kinds = ("recall", "artifact", "continuation", "decision")
        rows = []
        for r in report["runs"]:
            probes = r.get("probes")
            if not probes:
                continue
            rows.append(
                [
                    r["session"],
                    r["strategy"],
                    _budget(r["budget"]),
                    *(
                        f"{_score(probes['by_kind'][k]['full'])} / "
                        f"{_score(probes['by_kind'][k]['compacted'])}"
                        for k in kinds
                    ),
                ]
            )
        lines += _table(["session", "strategy", "budget", *kinds], rows)
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def _final(report: dict[str, Any], session: dict[str, Any]) -> str:
    for run in report["runs"]:
        if run["session"] == session["name"] and run["strategy"] == "none":
            series = (run.get("forwarded_tokens") or {}).get("series") or []
            return f"{series[-1]:,}" if series else "-"
    return "-"
