"""Replay long agent sessions through a live proxy and check every forwarded request.

A session is a scripted transcript: at each turn the client sends the history so far (as
an agent resends its whole history) and then appends the scripted next assistant message,
whatever the model answered, like replaying a recorded run. The upstream records what it
received; `check` holds each forwarded request to what the proxy promises:

- valid: the system prompt first, every tool result after its call and every call answered;
- the task (first user message) and the latest real ask present verbatim;
- within the budget whenever the status says compacted / extended / reused, and
  `x-compaction-tokens-after` equal to the request's real count; unchanged when skipped;
- never paying twice in a row for a summary of the same span (a turn that reused the turn
  before's summary and paid only to extend it, `x-compaction-cache: partial`, pays for
  messages after that span, whether or not its summary was then used).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from proxy.compaction.prompt import SYSTEM_PROMPT
from proxy.tokens import TokenCounter

Message = dict[str, Any]
COMPACTED = ("compacted", "extended", "reused")

COMPLAINT = (
    "Tool call error: your reply could not be parsed. Please reply with exactly one tool "
    "call, in the format described in the system prompt."
)

_WORDS = (
    *("ledger", "importer", "amount", "locale", "decimal", "separator", "parser", "row"),
    *("reconcile", "batch", "query", "index", "cache", "session", "fixture", "config"),
    *("schema", "record", "entry", "journal", "total", "rounding", "report"),
)


@dataclass(frozen=True)
class Session:
    """`turns[i]` is the history sent at turn i; `asks[i]` the latest real ask in it."""

    name: str
    tools: list[dict[str, Any]]
    turns: list[list[Message]]
    asks: list[Message]

    @property
    def system(self) -> Message:
        return self.turns[0][0]

    @property
    def task(self) -> Message:
        return self.turns[0][1]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _tool(name: str, arg: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')}.",
            "parameters": {"type": "object", "properties": {arg: {"type": "string"}}},
        },
    }


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> Message:
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


class _Script:
    """Builds the turns: `send()` records the history as the client would send it now."""

    def __init__(self, system: str, task: str) -> None:
        self.history: list[Message] = [
            {"role": "system", "content": system},
            {"role": "user", "content": task},
        ]
        self.ask: Message = self.history[1]
        self.turns: list[list[Message]] = []
        self.asks: list[Message] = []

    def add(self, message: Message, *, real_ask: bool = False) -> None:
        self.history.append(message)
        if real_ask:
            self.ask = message

    def send(self) -> None:
        self.turns.append(list(self.history))
        self.asks.append(self.ask)


def coding_agent(steps: int = 160, *, seed: int = 11) -> Session:
    """One task, `steps` tool calls, an injected format complaint a third of the way in, and
    now and then a very large tool output (a whole log or file)."""
    rng = random.Random(seed)
    script = _Script(
        "You are a coding agent. Reply with exactly one tool call per turn.",
        "Issue #4312: amounts like '1.234,56' are dropped by ledger/importers/csv_import.py "
        "and tests/test_csv_import.py::test_eu_amounts fails. " + _text(rng, 250),
    )
    tools = [_tool("run", "cmd"), _tool("read_file", "path"), _tool("edit_file", "patch")]
    for step in range(steps):
        script.send()
        if step == steps // 3:
            script.add({"role": "assistant", "content": "I will look at the parser next."})
            script.add({"role": "user", "content": COMPLAINT})
            script.send()
        name = rng.choice(["run", "read_file", "edit_file"])
        script.add(_call(f"call_{step}", name, {"arg": f"step {step}"}))
        big = step % 17 == 16
        words = rng.randint(2500, 3500) if big else int(rng.triangular(40, 900, 200))
        script.add({"role": "tool", "tool_call_id": f"call_{step}", "content": _text(rng, words)})
    script.send()
    return Session("coding agent", tools, script.turns, script.asks)


def customer_service(user_turns: int = 32, *, seed: int = 5) -> Session:
    """Many short user turns, 12 tools, one or two calls per turn, some empty results."""
    rng = random.Random(seed)
    names = [
        "get_user", "get_reservation", "search_flights", "book_flight", "cancel_reservation",
        "update_baggage", "update_passengers", "send_certificate", "transfer_to_agent",
        "calculate", "list_airports", "get_flight_status",
    ]  # fmt: skip
    script = _Script(
        "You are an airline customer-service agent. Follow the policy; use the tools.",
        "Hi, I need to change my reservation ZX81QP to a later flight.",
    )
    calls = 0
    for turn in range(user_turns):
        for _ in range(rng.choice([0, 1, 1, 2])):
            script.send()
            name = rng.choice(names)
            script.add(_call(f"cs_{calls}", name, {"id": f"R{calls}"}))
            content = "" if rng.random() < 0.2 else _text(rng, rng.randint(20, 160))
            script.add({"role": "tool", "tool_call_id": f"cs_{calls}", "content": content})
            calls += 1
        script.send()
        script.add({"role": "assistant", "content": _text(rng, rng.randint(15, 60))})
        ask = {"role": "user", "content": f"({turn}) " + _text(rng, rng.randint(5, 30))}
        script.add(ask, real_ask=True)
    script.send()
    return Session("customer service", [_tool(n, "id") for n in names], script.turns, script.asks)


@dataclass
class ReplayUpstream:
    """Plays model and summarizer. Summaries are 150..`summary_words` words, a function of
    their input, so a rerun is identical."""

    summary_words: int = 400
    forwarded: list[dict[str, Any]] = field(default_factory=list)
    summaries: int = 0

    async def chat(self, request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        messages = body["messages"]
        if messages[0].get("content") == SYSTEM_PROMPT:
            self.summaries += 1
            digest = hashlib.blake2b(json.dumps(messages).encode(), digest_size=8).digest()
            rng = random.Random(digest)
            text = "Summary: " + _text(rng, rng.randint(150, self.summary_words))
            reply = {"role": "assistant", "content": text}
            usage = {"prompt_tokens": 100, "completion_tokens": 10}
            return JSONResponse({"choices": [{"message": reply}], "usage": usage})
        self.forwarded.append(body)
        reply = {"role": "assistant", "content": "ok"}
        return JSONResponse(
            {
                "id": "chatcmpl-replay",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [{"index": 0, "message": reply, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )


@dataclass(frozen=True)
class Turn:
    status: str
    tokens_after: int
    summarized: int
    paid: bool  # a summarizer call was made for this turn
    cache: str = ""  # x-compaction-cache: hit, partial, miss ("" when no summary was sought)


def turn_of(headers: Any) -> Turn:
    return Turn(
        headers["x-compaction-status"],
        int(headers["x-compaction-tokens-after"]),
        int(headers["x-compaction-messages-summarized"]),
        int(headers["x-compaction-summary-input-tokens"]) > 0,
        headers.get("x-compaction-cache", ""),
    )


def check(
    session: Session,
    turns: list[Turn],
    forwarded: list[dict[str, Any]],
    counter: TokenCounter,
    budget: int,
) -> list[str]:
    """Every broken promise, one line each (empty: all kept)."""
    problems: list[str] = []
    assert len(forwarded) == len(turns) == len(session.turns)
    for i, (turn, body) in enumerate(zip(turns, forwarded, strict=True)):
        sent: list[Message] = body["messages"]
        where = f"{session.name} turn {i} ({turn.status})"
        if sent[0] != session.system:
            problems.append(f"{where}: the system prompt is not first")
        called: set[str] = set()
        for message in sent:
            called.update(c["id"] for c in message.get("tool_calls") or [])
            if message.get("role") == "tool" and message.get("tool_call_id") not in called:
                problems.append(f"{where}: tool result {message.get('tool_call_id')} orphaned")
        answered = {m.get("tool_call_id") for m in sent if m.get("role") == "tool"}
        if called - answered:
            problems.append(f"{where}: calls without results {sorted(called - answered)}")
        if session.task not in sent:
            problems.append(f"{where}: the task is not forwarded verbatim")
        if session.asks[i] not in sent:
            problems.append(f"{where}: the latest real ask is not forwarded verbatim")
        tokens = counter.count_request(body)
        if turn.status != "passthrough" and tokens != turn.tokens_after:
            problems.append(f"{where}: tokens-after {turn.tokens_after}, really {tokens}")
        if turn.status in COMPACTED and tokens > budget:
            problems.append(f"{where}: {tokens} tokens > budget {budget}")
        if turn.status in ("passthrough", "skipped") and sent != session.turns[i]:
            problems.append(f"{where}: forwarded changed without a summary")
        if turn.status not in (*COMPACTED, "passthrough", "over_budget", "skipped"):
            problems.append(f"{where}: unexpected status")
        # (A skipped turn reports 0 summarized whatever span it paid for: only its cache
        # says whether it started from the turn before's summary.)
        if (
            i
            and turn.paid
            and turns[i - 1].paid
            and turn.summarized == turns[i - 1].summarized
            and turn.cache != "partial"
        ):
            problems.append(f"{where}: paid again for the span of the turn before")
    return problems


def random_session(seed: int, *, steps: int, ask_every: float, big_every: int) -> Session:
    """A random mix: asks, parallel tool calls (results in any order, some empty), text
    replies, injected complaints, occasional very large outputs."""
    rng = random.Random(seed)
    script = _Script("You are an agent.", "Task: " + _text(rng, rng.randint(5, 200)))
    calls = 0
    for step in range(steps):
        script.send()
        roll = rng.random()
        if roll < ask_every:
            script.add({"role": "assistant", "content": _text(rng, rng.randint(3, 40))})
            ask = {"role": "user", "content": f"[{step}] " + _text(rng, rng.randint(3, 60))}
            script.add(ask, real_ask=True)
        elif roll < ask_every + 0.05:
            script.add({"role": "assistant", "content": "hmm"})
            script.add({"role": "user", "content": COMPLAINT})
        else:
            ids = [f"r{calls + k}" for k in range(rng.randint(1, 3))]
            calls += len(ids)
            message = _call(ids[0], "run", {"n": step})
            message["tool_calls"] += [
                {"id": i, "type": "function", "function": {"name": "run", "arguments": "{}"}}
                for i in ids[1:]
            ]
            script.add(message)
            rng.shuffle(ids)
            for call_id in ids:
                big = big_every and rng.randrange(big_every) == 0
                words = rng.randint(1500, 2500) if big else rng.choice([0, 10, 60, 300])
                script.add({"role": "tool", "tool_call_id": call_id, "content": _text(rng, words)})
    script.send()
    return Session(f"random {seed}", [_tool("run", "n")], script.turns, script.asks)
