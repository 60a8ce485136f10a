"""How fast `replay` is against the server's own time on the same turns.

    python -m bench.replay_speed [--repeats 3] [--budget 16000]

The shipped `coding-agent` session (201 turns, ~123k tokens at the end) with an instant fake
summarizer (a canned summary, no counting): (a) served by the app in-process
(`httpx.ASGITransport`, an instant fake upstream), the proxy time being the sum of each
reply's `x-compaction-overhead-ms` (arrival until the request went upstream, summarizer
included); (b) one strategy x budget run of the replay (`Replayer.run_one`: parse, the
compaction step, and every measure: cost, recall, validity, prefix). Interleaved, `--repeats`
rounds; medians, and the median of each round's ratio. Goal: replay at most 2x the server's
proxy time. Not a test: it prints a
table and PASS/FAIL and exits 1 when the goal fails.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

for _name in [n for n in os.environ if n.startswith("COMPACTION_PROXY_")]:
    del os.environ[_name]

import httpx  # noqa: E402
import respx  # noqa: E402

from proxy.app import create_app  # noqa: E402
from proxy.compaction.prompt import SYSTEM_PROMPT  # noqa: E402
from proxy.replay.engine import Calls  # noqa: E402
from proxy.replay.measure import LaterUse  # noqa: E402
from proxy.replay.runner import Options, Progress, Replayer  # noqa: E402
from proxy.replay.session import Session, load  # noqa: E402
from proxy.settings import Settings  # noqa: E402
from proxy.tokens import TokenCounter  # noqa: E402

UPSTREAM = "http://upstream.bench/v1"
SESSION = Path(__file__).resolve().parents[1] / "sessions" / "coding-agent.jsonl.xz"
GOAL = 2.0
SUMMARY = "Summary: " + "the agent fixed the lock order in reserve_stock and ran the tests. " * 30
USAGE = {"prompt_tokens": 3000, "completion_tokens": 400, "total_tokens": 3400}


def answer(request: httpx.Request) -> httpx.Response:
    """Instant: the summarizer gets a canned summary, a forwarded chat a one-word reply."""
    summarizing = SYSTEM_PROMPT.encode() in request.content[:4096]
    text = SUMMARY if summarizing else "ok"
    return httpx.Response(200, json={
        "id": "x", "object": "chat.completion", "created": 0, "model": "gpt-4.1",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": "stop"}],
        "usage": USAGE,
    })  # fmt: skip


def settings(budget: int) -> Settings:
    return Settings.model_validate(
        {"upstream": {"base_url": UPSTREAM}, "compaction": {"budget_tokens": budget}}
    )


async def served(session: Session, budget: int) -> float:
    """Seconds of proxy time the app reports for the session's turns."""
    app = create_app(settings(budget), transport=httpx.AsyncHTTPTransport())
    total_ms = 0.0
    with respx.mock(assert_all_called=False) as router:
        router.post(f"{UPSTREAM}/chat/completions").mock(side_effect=answer)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            for raw in session.lines:
                response = await client.post(
                    "/v1/chat/completions", content=raw,
                    headers={"content-type": "application/json", "authorization": "Bearer k"},
                )  # fmt: skip
                assert response.status_code == 200, response.text
                total_ms += float(response.headers["x-compaction-overhead-ms"])
    await app.state.proxy.upstream.client.aclose()
    return total_ms / 1000


async def replayed(session: Session, budget: int, counter: TokenCounter) -> tuple[float, Any]:
    """Wall seconds of one replayed run, and the run."""
    calls = Calls()
    with respx.mock(assert_all_called=False) as router:
        router.post(f"{UPSTREAM}/chat/completions").mock(side_effect=answer)
        async with httpx.AsyncClient(event_hooks={"request": [calls.hook]}) as client:
            replayer = Replayer(settings(budget), Options(["simple"], [budget], UPSTREAM),
                                counter, client, calls)  # fmt: skip
            later = LaterUse(session)
            started = time.perf_counter()
            run = await replayer.run_one(session, "simple", budget, later, Progress(1))
            return time.perf_counter() - started, run


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=int, default=16000)
    args = parser.parse_args(argv)
    [session] = load([str(SESSION)])
    counter = TokenCounter(settings(args.budget))
    counter.load()
    server_s: list[float] = []
    replay_s: list[float] = []
    run: Any = None
    for _ in range(args.repeats):
        server_s.append(await served(session, args.budget))
        seconds, run = await replayed(session, args.budget, counter)
        replay_s.append(seconds)
    counter.close()
    server, replay = statistics.median(server_s), statistics.median(replay_s)
    # Each round's replay against the server run just before it: the box's load moves both.
    rounds = [r / s for r, s in zip(replay_s, server_s, strict=True)]
    ratio = statistics.median(rounds)
    print(f"session {session.name}: {session.turns} turns, "
          f"{run['forwarded_tokens']['series'][0]:,}..{max(run['forwarded_tokens']['series']):,} "
          f"forwarded tokens, budget {args.budget:,}, statuses {run['statuses']}")  # fmt: skip
    print()
    print("| | median s | per turn ms | runs (s) |")
    print("|---|---|---|---|")
    for label, values, middle in (("server proxy time", server_s, server),
                                  ("replay run", replay_s, replay)):  # fmt: skip
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(f"| {label} | {middle:.2f} | {1000 * middle / session.turns:.1f} | {runs} |")
    print()
    print("replay / server per round: " + ", ".join(f"{r:.2f}" for r in rounds))
    verdict = "PASS" if ratio <= GOAL else "FAIL"
    print(f"{verdict}: replay / server, median of the rounds = {ratio:.2f} (goal <= {GOAL})")
    return 0 if ratio <= GOAL else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
