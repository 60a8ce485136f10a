"""Replay sessions once per strategy and budget, plus the baseline `none`, into a report.

Runs go one after another, turn after turn (a summarizer on a laptop answers one call at a
time anyway); each run has a summary store of its own, so nothing one run summarized is
reused by another. What is finished is in `Report.runs` as soon as it is, so an interrupted
replay still reports every run it completed.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import httpx
from pydantic import ValidationError

from proxy.errors import ProxyError
from proxy.redact import redact_url
from proxy.replay.engine import Calls, Engine
from proxy.replay.judge import Judge, ModelEndpoint, summarize
from proxy.replay.measure import CACHE_MIN_TOKENS, LaterUse, RunMeasure
from proxy.replay.session import Session
from proxy.settings import ConfigError, Settings, format_validation_error
from proxy.tokens import TokenCounter
from proxy.usage.pricing import Pricing

BASELINE = "none"
PROBE_STATUSES = ("compacted", "extended", "over_budget")  # a summary made or extended


@dataclass(frozen=True)
class Options:
    strategies: Sequence[str]  # without the baseline
    budgets: Sequence[int]
    summarizer_url: str
    summarizer_model: str | None = None
    summarizer_key: str | None = None
    judge: ModelEndpoint | None = None
    answer: ModelEndpoint | None = None  # default: the judge
    probes_per_session: int | None = None  # None: every compaction
    judge_context_tokens: int = 8000


@dataclass
class Report:
    """What report.json holds (docs/replay.md describes every field)."""

    meta: dict[str, Any]
    sessions: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    complete: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "version": 1,
            "complete": self.complete,
            **self.meta,
            "sessions": self.sessions,
            "runs": self.runs,
            "summary": summary_rows(self.runs),
        }


def run_settings(base: Settings, strategy: str | None, options: Options) -> Settings:
    """The server's settings for one run: the strategy (a `+` joins a list of strategies),
    the summarizer given, a memory store, compaction on, failures forwarded (and counted).
    Raises ConfigError as the server would at start."""
    data = base.model_dump()
    compaction = data["compaction"]
    if strategy is not None:
        compaction["strategy"] = strategy.split("+") if "+" in strategy else strategy
    compaction["enabled"] = True
    compaction["on_error"] = "forward"
    compaction["summarizer"]["base_url"] = options.summarizer_url
    if options.summarizer_model:
        compaction["summarizer"]["model"] = options.summarizer_model
    data["cache"].update(backend="memory", max_bytes=1 << 30, ttl_s=30 * 24 * 3600)
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, "(replay)")) from None


class Progress:
    """One status line on a terminal, redrawn at most ten times a second; nothing otherwise."""

    def __init__(self, total: int, stream: IO[str] | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()
        self.total = max(total, 1)
        self.done = 0
        self._drawn = 0.0

    def step(self, label: str) -> None:
        self.done += 1
        now = time.monotonic()
        if self.enabled and (now - self._drawn > 0.1 or self.done == self.total):
            self._drawn = now
            width = 30
            filled = width * self.done // self.total
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r[{bar}] {self.done}/{self.total} {label:<50.50}")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


class Replayer:
    def __init__(
        self,
        base: Settings,
        options: Options,
        counter: TokenCounter,
        client: httpx.AsyncClient,
        calls: Calls,
        judge: Judge | None = None,
    ) -> None:
        self.options = options
        self.counter = counter
        self.client = client
        self.calls = calls
        self.judge = judge
        self.pricing = Pricing(base.pricing)
        self.settings = {s: run_settings(base, s, options) for s in options.strategies}
        self.baseline = run_settings(base, None, options)
        for strategy, settings in self.settings.items():  # the server's own check, now
            try:
                self.engine(settings, None)
            except ConfigError as exc:
                raise ConfigError(f"--strategy {strategy}: {exc}") from None

    def engine(self, settings: Settings, budget: int | None) -> Engine:
        return Engine(
            settings,
            self.counter,
            self.client,
            self.calls,
            budget=budget,
            summarizer_key=self.options.summarizer_key,
        )

    def runs(self) -> list[tuple[str, int | None]]:
        planned: list[tuple[str, int | None]] = [(BASELINE, None)]
        planned += [(s, b) for s in self.options.strategies for b in self.options.budgets]
        return planned

    def meta(self) -> dict[str, Any]:
        options = self.options
        return {
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "strategies": [BASELINE, *options.strategies],
            "budgets": list(options.budgets),
            "summarizer": {
                "url": redact_url(options.summarizer_url),
                "model": options.summarizer_model,
            },
            "judge": None
            if options.judge is None
            else {
                "url": redact_url(options.judge.base_url),
                "model": options.judge.model,
                "answer_model": (options.answer or options.judge).model,
                "probes_per_session": options.probes_per_session,
            },
            "pricing": {"cache_min_tokens": CACHE_MIN_TOKENS},
        }

    async def replay(self, sessions: Sequence[Session], report: Report, progress: Progress) -> None:
        for session in sessions:
            report.sessions.append(
                {
                    "name": session.name,
                    "file": session.source,
                    "first_line": session.first_line,
                    "turns": session.turns,
                    "model": session.model,
                    "messages": len(session.final),
                }
            )
            later = LaterUse(session)
            done: list[dict[str, Any]] = []
            for strategy, budget in self.runs():
                run = await self.run_one(session, strategy, budget, later, progress)
                done.append(run)
                report.runs.append(run)
                _ratios(done)

    async def run_one(
        self,
        session: Session,
        strategy: str,
        budget: int | None,
        later: LaterUse,
        progress: Progress,
    ) -> dict[str, Any]:
        settings = self.baseline if strategy == BASELINE else self.settings[strategy]
        engine = self.engine(settings, budget)
        measure = RunMeasure(
            session,
            self.counter,
            self.pricing,
            injected=settings.compaction.injected_user_patterns,
            later=later,
            summarizer_model=settings.compaction.summarizer.model,
            budget=budget,
        )
        entry: dict[str, Any] = {
            "session": session.name,
            "strategy": strategy,
            "budget": budget,
            "status": "ok",
            "error": None,
        }
        scope = f"replay:{uuid.uuid4().hex}"
        label = f"{session.name} {strategy} {budget or ''}"
        compactions: dict[int, tuple[list[Any], list[Any]]] = {}
        started = time.perf_counter()
        for index, raw in enumerate(session.lines):
            try:
                turn = await engine.turn(raw, scope=scope, request_id=f"replay-{index}")
                row = measure.add(turn)
            except ProxyError as exc:
                entry.update(status="failed", error=f"turn {index}: {exc.message}")
                break
            except Exception as exc:  # a session that fails midway: reported, others go on
                entry.update(status="failed", error=f"turn {index}: {type(exc).__name__}: {exc}")
                break
            if self.judge is not None and row.changed and row.status in PROBE_STATUSES:
                compactions[index] = (turn.original, turn.messages)
            progress.step(label)
        if entry["status"] != "ok":
            for _ in range(session.turns - len(measure.rows)):
                progress.step(label)  # the turns a failed run skipped
        entry["seconds"] = round(time.perf_counter() - started, 3)
        entry.update(measure.result())
        entry["probes"] = None
        if self.judge is not None and compactions and entry["status"] == "ok":
            entry["probes"] = await self._probes(session, compactions)
        return entry

    async def _probes(
        self, session: Session, compactions: dict[int, tuple[list[Any], list[Any]]]
    ) -> dict[str, Any]:
        assert self.judge is not None
        turns = sample(sorted(compactions), self.options.probes_per_session)
        items: list[dict[str, Any]] = []
        errors = []
        for index in turns:
            original, forwarded = compactions[index]
            try:
                items += await self.judge.probe((session.name, index), original, forwarded)
            except (httpx.HTTPError, ValueError) as exc:
                errors.append(f"turn {index}: {type(exc).__name__}: {exc}")
        result = summarize(items)
        result["errors"] = errors
        return result


def sample(turns: Sequence[int], count: int | None) -> list[int]:
    """`count` turns spread evenly over `turns`, the last one always in (None: all)."""
    if count is None or count >= len(turns):
        return list(turns)
    if count <= 0:
        return []
    step = len(turns) / count
    return sorted({turns[len(turns) - 1 - int(i * step)] for i in range(count)})


def _ratios(runs: list[dict[str, Any]]) -> None:
    """Each run's cost as a ratio to its session's baseline run."""
    base = next((r for r in runs if r["strategy"] == BASELINE and r["status"] == "ok"), None)
    total = None if base is None else base["cost"]["total_usd"]
    for run in runs:
        cost = run["cost"]["total_usd"]
        ok = total and cost is not None and run["status"] == "ok"
        run["cost"]["ratio_to_none"] = cost / total if ok else None


def summary_rows(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per strategy and budget, over every session that replayed completely."""
    ok = [r for r in runs if r["status"] == "ok"]
    sessions = {r["session"] for r in ok if r["strategy"] == BASELINE}
    keys: list[tuple[str, int | None]] = []
    for run in ok:
        key = (run["strategy"], run["budget"])
        if key not in keys:
            keys.append(key)
    rows = []
    for strategy, budget in keys:
        group = [
            r
            for r in ok
            if (r["strategy"], r["budget"]) == (strategy, budget) and r["session"] in sessions
        ]
        base = {r["session"]: r for r in ok if r["strategy"] == BASELINE}
        costs = [r["cost"]["total_usd"] for r in group]
        bases = [base[r["session"]]["cost"]["total_usd"] for r in group]
        priced = all(c is not None for c in costs + bases) and sum(bases)
        recall = [r["recall"] for r in group]
        measured = sum(x["measured_turns"] for x in recall)
        shares = [x["mean"] * x["measured_turns"] for x in recall if x["mean"] is not None]
        worst = [x["worst"] for x in recall if x["worst"] is not None]
        probes = [r["probes"] for r in group if r.get("probes")]
        rows.append(
            {
                "strategy": strategy,
                "budget": budget,
                "sessions": len(group),
                "turns": sum(r["turns"] for r in group),
                "prompt_tokens": sum(r["cost"]["prompt_tokens"] for r in group),
                "cached_tokens": sum(r["cost"]["cached_tokens"] for r in group),
                "total_usd": sum(costs) if priced else None,
                "cost_ratio": sum(costs) / sum(bases) if priced else None,
                "summarizer_calls": sum(r["summarizer"]["calls"] for r in group),
                "summarizer_input_tokens": sum(r["summarizer"]["input_tokens"] for r in group),
                "summarizer_output_tokens": sum(r["summarizer"]["output_tokens"] for r in group),
                "over_budget_turns": sum(r["over_budget"]["turns"] for r in group),
                "over_budget_honest": sum(r["over_budget"]["honest"] for r in group),
                "invalid_requests": sum(r["invalid_requests"]["turns"] for r in group),
                "prefix_stability": _mean_of(r["prefix_stability"] for r in group),
                "recall_mean": (
                    sum(shares) / measured if measured else (1.0 if strategy == BASELINE else None)
                ),
                "recall_worst": min(worst) if worst else (1.0 if strategy == BASELINE else None),
                "task_verbatim": _mean_of(r["task_verbatim"] for r in group),
                "ask_verbatim": _mean_of(r["ask_verbatim"] for r in group),
                "probe_full": _mean_of(p["full"] for p in probes),
                "probe_compacted": _mean_of(p["compacted"] for p in probes),
            }
        )
    return rows


def _mean_of(values: Any) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None
