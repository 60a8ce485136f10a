"""Replaying sessions in-process: the tool's Replayer with the testing kit's fake upstream."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from proxy.replay.engine import Calls
from proxy.replay.runner import Options, Progress, Replayer, Report
from proxy.replay.session import Session, load
from proxy.settings import Settings
from proxy.testing import FAKE_UPSTREAM, FakeOpenAI
from proxy.tokens import TokenCounter

REPO = Path(__file__).resolve().parents[2]
SESSIONS = REPO / "sessions"
SHIPPED = sorted(str(p) for p in SESSIONS.glob("*.jsonl.xz"))


def shipped(name: str) -> list[Session]:
    return load([str(SESSIONS / f"{name}.jsonl.xz")])


async def replay(
    sessions: Sequence[Session],
    settings: Settings,
    fake: FakeOpenAI,
    *,
    strategies: Sequence[str] = ("simple",),
    budgets: Sequence[int] = (8000,),
    counter: TokenCounter | None = None,
    **options: Any,
) -> dict[str, Any]:
    """report.json's content for `sessions`, the summarizer answered by `fake` (on respx)."""
    own = counter is None
    counter = counter or TokenCounter(settings)
    counter.load()
    calls = Calls()
    report = Report(meta={})
    try:
        with fake.mock():
            async with httpx.AsyncClient(event_hooks={"request": [calls.hook]}) as client:
                replayer = Replayer(
                    settings,
                    Options(list(strategies), list(budgets), FAKE_UPSTREAM, **options),
                    counter, client, calls,
                )  # fmt: skip
                report.meta = replayer.meta()
                await replayer.replay(sessions, report, Progress(1))
                report.complete = True
    finally:
        if own:
            counter.close()
    return report.as_json()


def run_of(report: dict[str, Any], session: str, strategy: str, budget: int | None) -> Any:
    for run in report["runs"]:
        if (run["session"], run["strategy"], run["budget"]) == (session, strategy, budget):
            return run
    raise LookupError((session, strategy, budget))
