"""Replaying sessions in-process: the tool's Replayer with the testing kit's fake upstream."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from proxy.replay.engine import Calls
from proxy.replay.judge import ChatModel, Judge
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
    fake: FakeOpenAI | None,
    *,
    strategies: Sequence[str] = ("simple",),
    budgets: Sequence[int] = (8000,),
    summarizer_url: str = FAKE_UPSTREAM,
    **options: Any,
) -> dict[str, Any]:
    """report.json's content for `sessions`, the summarizer answered by `fake` (on respx;
    None: a real one at `summarizer_url`), a judge when `options` name one."""
    counter = TokenCounter(settings)
    counter.load()
    calls = Calls()
    report = Report(meta={})
    chosen = Options(list(strategies), list(budgets), summarizer_url, **options)
    try:
        with fake.mock() if fake is not None else contextlib.nullcontext():
            async with (
                httpx.AsyncClient(event_hooks={"request": [calls.hook]}) as client,
                httpx.AsyncClient(timeout=600) as judge_client,
            ):
                judge = None
                if chosen.judge is not None:
                    endpoint = chosen.judge
                    judge = Judge(ChatModel(judge_client, endpoint),
                                  ChatModel(judge_client, chosen.answer or endpoint),
                                  lambda text: counter.count_text(endpoint.model, text),
                                  chosen.judge_context_tokens)  # fmt: skip
                replayer = Replayer(settings, chosen, counter, client, calls, judge)
                report.meta = replayer.meta()
                await replayer.replay(sessions, report, Progress(1))
                report.complete = True
    finally:
        counter.close()
    return report.as_json()


def run_of(report: dict[str, Any], session: str, strategy: str, budget: int | None) -> Any:
    for run in report["runs"]:
        if (run["session"], run["strategy"], run["budget"]) == (session, strategy, budget):
            return run
    raise LookupError((session, strategy, budget))
