"""The replay's plots, with matplotlib when it is installed (`compaction-proxy[replay]`).

- `tokens.png`: forwarded prompt tokens per turn, one panel per session, one line per
  strategy and budget (the baseline `none` in grey);
- `cost-recall.png`: the cost ratio to `none` against the needed-later recall, one point
  per strategy and budget over all sessions (the baseline sits at 1.0, 1.0).

Without matplotlib no plot is written and report.md says nothing of them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def plot_all(report: dict[str, Any], out: Path) -> list[Path]:
    if not available() or not report.get("runs"):
        return []
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    written = []
    sessions = [s["name"] for s in report["sessions"]]
    # Color by budget, line style and marker by strategy: equal results stay told apart.
    budgets = sorted({r["budget"] for r in report["runs"] if r["budget"] is not None})
    strategies = list(dict.fromkeys(r["strategy"] for r in report["runs"] if r["budget"]))
    colors = {b: f"C{i % 10}" for i, b in enumerate(budgets)}
    styles = {s: ("-", "--", "-.", ":")[i % 4] for i, s in enumerate(strategies)}
    markers = {s: ("o", "s", "^", "D", "v")[i % 5] for i, s in enumerate(strategies)}
    ok = [r for r in report["runs"] if r["status"] == "ok" or r.get("forwarded_tokens")]
    if sessions:
        figure, axes = plt.subplots(
            len(sessions), 1, figsize=(9, 3.2 * len(sessions)), squeeze=False
        )
        for axis, name in zip(axes[:, 0], sessions, strict=True):
            for run in (r for r in ok if r["session"] == name):
                series = run["forwarded_tokens"]["series"]
                baseline = run["strategy"] == "none"
                label = "none" if baseline else f"{run['strategy']} @ {run['budget']:,}"
                axis.plot(
                    range(1, len(series) + 1),
                    series,
                    label=label,
                    color="0.6" if baseline else colors[run["budget"]],
                    linewidth=1.0 if baseline else 1.4,
                    linestyle=":" if baseline else styles[run["strategy"]],
                )
            axis.set_title(name, fontsize=10)
            axis.set_ylabel("forwarded tokens")
            axis.grid(alpha=0.3)
            axis.legend(fontsize=7, loc="upper left")
        axes[-1, 0].set_xlabel("turn (request of the session)")
        figure.tight_layout()
        path = out / "tokens.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)

    rows = [r for r in report.get("summary", []) if r["cost_ratio"] is not None]
    if rows:
        figure, axis = plt.subplots(figsize=(6.5, 4.5))
        for row in rows:
            recall = row["recall_mean"]
            if recall is None:
                continue
            baseline = row["strategy"] == "none"
            label = "none" if baseline else f"{row['strategy']} @ {row['budget']:,}"
            color = "0.5" if baseline else colors[row["budget"]]
            marker = "*" if baseline else markers[row["strategy"]]
            hollow = not baseline and marker != "o"  # a point behind another still shows
            axis.scatter(
                [100 * recall],
                [row["cost_ratio"]],
                s=90 if hollow else 50,
                label=label,
                marker=marker,
                facecolors="none" if hollow else color,
                edgecolors=color,
                linewidths=1.5,
            )
        axis.set_xlabel("needed-later recall, mean over compacted turns (%)")
        axis.set_ylabel("cost vs none (prompt caching simulated)")
        axis.set_title("What compaction saves vs what it loses", fontsize=10)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8, loc="upper left")
        figure.tight_layout()
        path = out / "cost-recall.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written
