"""Proxy time of a reused turn on a 128k-token history: the Responses API against chat
completions, and what `previous_response_id` requests cost.

    python -m bench.responses_turns            # ~1 min
    python -m bench.responses_turns --samples 21

The conversation is bench/agent_session.py's coding-agent session (as bench/turns.py (b)
uses it), at its first turn past `--tokens` (128k). The same turns are sent as chat
completions (`messages`) and as Responses API requests (`input` items: the system prompt
as a developer message, each tool call a `function_call`, each result its
`function_call_output`; `tools` flattened as the Responses API writes them), and, as a
third shape, with an encrypted `reasoning` item before each call as Codex sends them.
Measured in-process with bench/turns.py's harness (direct ASGI calls, a mock upstream):
"reused" is the turn after one the proxy compacted under the same tenant, so the store
serves its summary (no summarizer call). Samples are interleaved: chat, responses,
responses with reasoning, then a `previous_response_id` request (its `input` only the new
turn's items) on /v1/responses and the same bytes on a passthrough route.

Goal: a reused Responses turn costs at most 1.5x the same chat turn (CPU time, median);
the shape with reasoning items is printed beside it (more items, a bigger body).
And a `previous_response_id` request is relayed as sent (checked byte for byte).
Not a test: prints a table and PASS/FAIL lines, exits 0 either way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from typing import Any

from bench.agent_session import MODEL, TOOLS, Message
from bench.turns import UPSTREAM, Proxy, Result, _fmt, encode, history_tokens, session_to, table

GOAL = 1.5


def items_of(history: list[Message], *, reasoning: bool) -> list[dict[str, Any]]:
    """A chat history as Responses API input items."""
    items: list[dict[str, Any]] = []
    for n, message in enumerate(history):
        role = message["role"]
        if role == "system":
            items.append({"type": "message", "role": "developer", "content": message["content"]})
        elif role == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": message["tool_call_id"],
                    "output": message["content"],
                }
            )
        elif message.get("tool_calls"):
            if reasoning:
                items.append(
                    {
                        "type": "reasoning",
                        "id": f"rs_{n}",
                        "summary": [],
                        "encrypted_content": "gAAAAA" + f"{n:06d}" * 80,
                    }
                )
            if message.get("content"):
                items.append(
                    {"type": "message", "role": "assistant", "content": message["content"]}
                )
            for call in message["tool_calls"]:
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call["id"],
                        "name": call["function"]["name"],
                        "arguments": call["function"]["arguments"],
                    }
                )
        else:
            items.append({"type": "message", "role": role, "content": message["content"]})
    return items


def flat_tools() -> list[dict[str, Any]]:
    return [{"type": "function", **tool["function"]} for tool in TOOLS]


def encode_responses(items: list[dict[str, Any]], **extra: Any) -> bytes:
    """As the OpenAI Python SDK writes a `responses.create` body."""
    body = {"model": MODEL, "input": items, "tools": flat_tools(), "store": False, **extra}
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


async def measure(target: int, budget: int, samples: int) -> None:
    sessions = session_to(target)
    index = next(i for i, h in enumerate(sessions) if history_tokens(h) >= target)
    previous, current = sessions[index - 1], sessions[index]
    shapes = {
        "chat completions": (encode(previous), encode(current), "/v1/chat/completions"),
        "responses": (
            encode_responses(items_of(previous, reasoning=False)),
            encode_responses(items_of(current, reasoning=False)),
            "/v1/responses",
        ),
        "responses + reasoning items": (
            encode_responses(items_of(previous, reasoning=True)),
            encode_responses(items_of(current, reasoning=True)),
            "/v1/responses",
        ),
    }
    new_items = items_of(current, reasoning=True)[len(items_of(previous, reasoning=True)) :]
    stateful = encode_responses(new_items, previous_response_id="resp_previous")
    proxy = Proxy(budget)
    cpu: dict[str, list[float]] = {name: [] for name in [*shapes, "prev_id", "relay"]}
    wall: dict[str, list[float]] = {name: [] for name in cpu}
    statuses: dict[str, set[str]] = {name: set() for name in cpu}
    relayed_as_sent = True

    def note(name: str, result: Result) -> None:
        cpu[name].append(result.cpu_ms)
        wall[name].append(result.ms)
        statuses[name].add(result.status if result.status != "?" else "relayed")

    try:
        for warm in range(2):
            for name, (before, body, path) in shapes.items():
                await proxy.send(before, tenant=f"w{warm}{name}", path=path)
                await proxy.send(body, tenant=f"w{warm}{name}", path=path)
        for sample in range(samples):
            for name, (before, body, path) in shapes.items():
                await proxy.send(before, tenant=f"{sample}{name}", path=path)
                note(name, await proxy.send(body, tenant=f"{sample}{name}", path=path))
            note("prev_id", await proxy.send(stateful, path="/v1/responses"))
            relayed_as_sent = relayed_as_sent and proxy.mock.last == stateful
            note("relay", await proxy.send(stateful, path="/v1/responses/relay"))
    finally:
        await proxy.close()
    tokens = history_tokens(current)
    print(
        f"a {tokens:,}-token history, budget {budget:,}; proxy time of the reused turn, "
        f"median of {samples} interleaved samples (bench/turns.py's harness)"
    )
    base_cpu = statistics.median(cpu["chat completions"])
    base_wall = statistics.median(wall["chat completions"])
    rows = []
    for name, (_, body, _) in shapes.items():
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        rows.append(
            [
                f"{name} ({', '.join(sorted(statuses[name]))})",
                f"{len(body) / 1024:,.0f} KB",
                _fmt(c, ".3f"),
                _fmt(w, ".3f"),
                f"{c / base_cpu:.2f}x",
                f"{w / base_wall:.2f}x",
            ]
        )
    relay_cpu = statistics.median(cpu["relay"])
    for name, label in (("prev_id", "previous_response_id on /v1/responses"),
                        ("relay", "the same bytes on a passthrough route")):  # fmt: skip
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        rows.append(
            [
                f"{label} ({', '.join(sorted(statuses[name]))})",
                f"{len(stateful) / 1024:,.1f} KB",
                _fmt(c, ".3f"),
                _fmt(w, ".3f"),
                f"{c / relay_cpu:.2f}x vs relay",
                "",
            ]
        )
    print(table(["", "body", "CPU ms", "wall ms", "CPU vs chat", "wall vs chat"], rows))
    ratio = statistics.median(cpu["responses"]) / base_cpu
    verdict = "PASS" if ratio <= GOAL else "FAIL"
    print(f"reused responses vs the same chat turn: {ratio:.2f}x (goal <= {GOAL}x): {verdict}")
    ratio = statistics.median(cpu["responses + reasoning items"]) / base_cpu
    print(
        f"informational: with a reasoning item per call (a bigger body, 1.5x the items): "
        f"{ratio:.2f}x"
    )
    print("previous_response_id relayed byte for byte: " + ("PASS" if relayed_as_sent else "FAIL"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128_000)
    parser.add_argument("--budget", type=int, default=32_000)
    parser.add_argument("--samples", type=int, default=11)
    args = parser.parse_args()
    print(f"upstream mock at {UPSTREAM}")
    asyncio.run(measure(args.tokens, args.budget, args.samples))


if __name__ == "__main__":
    main()
