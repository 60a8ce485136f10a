"""`compaction-proxy replay`: what compaction would save and lose on recorded sessions."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from proxy.redact import redact_url
from proxy.replay.engine import Calls
from proxy.replay.judge import ChatModel, Judge, ModelEndpoint
from proxy.replay.report import summary_table, write_report
from proxy.replay.runner import BASELINE, Options, Progress, Replayer, Report
from proxy.replay.session import SessionError, load
from proxy.settings import ConfigError, Settings, check_base_url, load_settings

HELP = """\
Replay recorded sessions (JSON Lines, one chat-completions request per line; .jsonl, .jsonl.gz
or .jsonl.xz) turn by turn through the proxy's compaction path, once per strategy and budget
plus the baseline `none`, and write report.json, report.md and plots into --out. The
summarizer is called for real; the agent's model never is. See docs/replay.md.
"""


def register_commands(commands: Any) -> None:
    replay = commands.add_parser(
        "replay",
        help="measure what compaction saves and loses on recorded sessions",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    replay.add_argument(
        "sessions", nargs="+", metavar="SESSION.jsonl", help="session files ('-': standard input)"
    )
    replay.add_argument(
        "--strategy",
        default="simple",
        metavar="S1,S2",
        help="strategies as compaction.strategy names them, comma-separated "
        "('a+b': a list of strategies); default simple",
    )
    replay.add_argument(
        "--budget",
        metavar="N1,N2",
        help="budgets in tokens, comma-separated (default compaction.budget_tokens)",
    )
    replay.add_argument(
        "--summarizer-url",
        metavar="URL",
        help="OpenAI-compatible base URL (default: as the server: "
        "compaction.summarizer.base_url, else upstream.base_url)",
    )
    replay.add_argument(
        "--summarizer-model",
        metavar="M",
        help="default: compaction.summarizer.model, else each request's model",
    )
    replay.add_argument(
        "--summarizer-key-env",
        metavar="VAR",
        help="environment variable holding the summarizer's API key",
    )
    replay.add_argument("--judge-url", metavar="URL", help="judge model's base URL (probes)")
    replay.add_argument("--judge-model", metavar="M", help="judge model")
    replay.add_argument("--judge-key-env", metavar="VAR")
    replay.add_argument("--answer-url", metavar="URL", help="answer model (default: the judge)")
    replay.add_argument("--answer-model", metavar="M")
    replay.add_argument("--answer-key-env", metavar="VAR")
    replay.add_argument(
        "--probes-per-session",
        type=int,
        metavar="N",
        help="probe N compactions per run, spread evenly (default: each one)",
    )
    replay.add_argument(
        "--judge-context-tokens",
        type=int,
        default=8000,
        metavar="N",
        help="the judge's and answer model's window (default 8000)",
    )
    replay.add_argument("--config", metavar="FILE", help="the server's TOML config")
    replay.add_argument(
        "--out",
        default="replay-report",
        metavar="DIR",
        help="output folder (default replay-report)",
    )
    replay.set_defaults(func=replay_command)


# Exit codes: 0 done; 1 done, a session failed midway (reported); 2 bad input; 130 Ctrl-C.


def _fail(message: str) -> int:
    print(f"compaction-proxy replay: error: {message}", file=sys.stderr)
    return 2


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _budgets(text: str | None, settings: Settings) -> list[int]:
    if text is None:
        return [settings.compaction.budget_tokens]
    budgets = []
    for part in _names(text):
        if not part.isdigit() or int(part) <= 0:
            raise ConfigError(f"--budget: {part!r} is not a positive number of tokens")
        budgets.append(int(part))
    if not budgets:
        raise ConfigError("--budget: no budget given")
    return budgets


def _key(variable: str | None, flag: str) -> str | None:
    if variable is None:
        return None
    value = os.environ.get(variable)
    if not value:
        raise ConfigError(f"{flag}: environment variable {variable} is not set")
    return value


def _endpoint(url: str | None, model: str | None, key: str | None, flag: str) -> ModelEndpoint:
    if not url or not model:
        raise ConfigError(f"--{flag}-url and --{flag}-model go together")
    try:
        return ModelEndpoint(check_base_url(url), model, key)
    except ValueError as exc:
        raise ConfigError(f"--{flag}-url: {exc}") from None


def options_of(args: argparse.Namespace, settings: Settings) -> Options:
    strategies = [s for s in _names(args.strategy) if s != BASELINE]
    url = args.summarizer_url or settings.compaction.summarizer.base_url
    url = url or settings.upstream.base_url
    try:
        url = check_base_url(url)
    except ValueError as exc:
        raise ConfigError(f"--summarizer-url: {exc}") from None
    judge = answer = None
    if args.judge_url or args.judge_model:
        judge = _endpoint(
            args.judge_url, args.judge_model, _key(args.judge_key_env, "--judge-key-env"), "judge"
        )
        if args.answer_url or args.answer_model:
            answer = _endpoint(
                args.answer_url or judge.base_url,
                args.answer_model or judge.model,
                _key(args.answer_key_env, "--answer-key-env"),
                "answer",
            )
    if args.probes_per_session is not None and args.probes_per_session < 0:
        raise ConfigError("--probes-per-session: must be 0 or more")
    return Options(
        strategies=list(dict.fromkeys(strategies)),
        budgets=list(dict.fromkeys(_budgets(args.budget, settings))),
        summarizer_url=url,
        summarizer_model=args.summarizer_model or settings.compaction.summarizer.model,
        summarizer_key=_key(args.summarizer_key_env, "--summarizer-key-env"),
        judge=judge,
        answer=answer,
        probes_per_session=args.probes_per_session,
        judge_context_tokens=args.judge_context_tokens,
    )


async def reachable(client: httpx.AsyncClient, url: str) -> str | None:
    """None when something answers HTTP at `url` (any status), else why not."""
    try:
        await client.get(f"{url}/models", timeout=10.0)
    except httpx.HTTPError as exc:
        return f"cannot reach {redact_url(url)} ({type(exc).__name__}: {exc})"
    return None


def replay_command(args: argparse.Namespace) -> int:
    from proxy.tokens import TokenCounter, TokenizerUnavailable

    try:
        settings = load_settings(args.config)
        options = options_of(args, settings)
        sessions = load(args.sessions)
    except (ConfigError, SessionError) as exc:
        return _fail(str(exc))
    counter = TokenCounter(settings)
    try:
        counter.load()
    except TokenizerUnavailable as exc:
        return _fail(str(exc))
    out = Path(args.out)
    report = Report(meta={})
    try:
        code = asyncio.run(_replay(options, settings, counter, sessions, report))
    except KeyboardInterrupt:
        if report.meta:
            _write(report, out, interrupted=True)
        return 130
    except ConfigError as exc:
        return _fail(str(exc))
    finally:
        counter.close()
    if code == 0 and not _write(report, out, interrupted=False):
        return 1  # written, with a session that failed midway
    return code


async def _replay(
    options: Options,
    settings: Settings,
    counter: Any,
    sessions: list[Any],
    report: Report,
) -> int:
    calls = Calls()
    timeout = httpx.Timeout(settings.compaction.summarizer.timeout_s)
    async with (
        httpx.AsyncClient(timeout=timeout, event_hooks={"request": [calls.hook]}) as client,
        httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as judge_client,
    ):
        if options.strategies:
            problem = await reachable(judge_client, options.summarizer_url)
            if problem is not None:
                return _fail(f"--summarizer-url: {problem}")
        judge = None
        if options.judge is not None:
            for endpoint, flag in ((options.judge, "judge"), (options.answer, "answer")):
                if endpoint is not None:
                    problem = await reachable(judge_client, endpoint.base_url)
                    if problem is not None:
                        return _fail(f"--{flag}-url: {problem}")
            answer = options.answer or options.judge
            judge = Judge(
                ChatModel(judge_client, options.judge),
                ChatModel(judge_client, answer),
                lambda text: counter.count_text(options.judge.model, text),  # type: ignore[union-attr]
                options.judge_context_tokens,
            )
        replayer = Replayer(settings, options, counter, client, calls, judge)
        report.meta = replayer.meta()
        total = sum(s.turns for s in sessions) * len(replayer.runs())
        progress = Progress(total)
        try:
            await replayer.replay(sessions, report, progress)
        finally:
            progress.close()
        report.complete = True
    return 0


def _write(report: Report, out: Path, *, interrupted: bool) -> bool:
    """Write the report; False when a run failed."""
    data = report.as_json()
    written = write_report(data, out)
    state = "interrupted; wrote what is done" if interrupted else "wrote"
    print(
        f"compaction-proxy replay: {state}: {', '.join(str(p) for p in written)}", file=sys.stderr
    )
    if data["summary"]:
        print("\n".join(summary_table(data["summary"], data.get("judge") is not None)))
    failed = [r for r in data["runs"] if r["status"] != "ok"]
    for run in failed:
        print(
            f"failed: {run['session']} {run['strategy']} {run['budget'] or ''}: {run['error']}",
            file=sys.stderr,
        )
    return not failed
