"""A deterministic tool-using agent session, one request body per turn (tests and bench)."""

from __future__ import annotations

import random
from typing import Any

WORDS = [
    "parser",
    "token",
    "module",
    "refactor",
    "error",
    "trace",
    "fixed",
    "tests",
    "pass",
    "config",
    "upstream",
    "cache",
    "budget",
    "summary",
    "stream",
    "header",
    "request",
    "client",
    "server",
    "retry",
    "timeout",
    "pool",
    "socket",
    "json",
    "schema",
]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def agent_turns(
    turns: int, *, seed: int = 7, user_every: int = 6, tool_words: tuple[int, int] = (40, 400)
) -> list[list[dict[str, Any]]]:
    """The full history the client sends at each turn (growing; each a new list)."""
    rng = random.Random(seed)
    history: list[dict[str, Any]] = [
        {
            "role": "system",
            "content": "You are a coding agent. Use tools to inspect and edit code.",
        },
        {"role": "user", "content": "Fix the failing parser tests. " + _text(rng, 30)},
    ]
    sessions: list[list[dict[str, Any]]] = []
    for turn in range(turns):
        call_id = f"call_{turn}"
        history.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "run", "arguments": f'{{"cmd": "step {turn}"}}'},
                    }
                ],
            }
        )
        history.append(
            {
                "role": "tool",
                "tool_call_id": call_id,
                "content": _text(rng, rng.randint(*tool_words)),
            }
        )
        if turn % user_every == user_every - 1:
            history.append({"role": "assistant", "content": "Progress: " + _text(rng, 20)})
            history.append({"role": "user", "content": f"Next step {turn}: " + _text(rng, 15)})
        sessions.append(list(history))
    return sessions


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]
