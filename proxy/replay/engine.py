"""Replay one turn through the server's compaction path.

Every call the replay tool (and the audit trail) makes into the compaction core is in this
file, so the tool measures exactly what the server does: the request is parsed as the chat
route parses it (`parse_chat`, with the same turn memo), then handed to the same `Compactor`
the app builds (counting, the cut, the summary store with reuse, extension and single
flight, the budget guarantee), with a memory store of its own per replayed run. Only the
upstream call for the agent's turn is left out: the next recorded request already holds
what the agent did.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx

from proxy.compaction.protocol import Message, Spend, Usage
from proxy.compactor import Compactor, Control
from proxy.headers import summarizer_request_headers
from proxy.jsonspans import Parsed
from proxy.metrics import Metrics
from proxy.report import Outcome
from proxy.settings import Settings
from proxy.store import create_store
from proxy.tokens import TokenCounter
from proxy.turnmemo import TurnMemo
from proxy.validation import parse_chat

# The baseline `none`: a budget no request reaches, so every turn is only counted.
UNLIMITED = 2**62


@dataclass(frozen=True)
class Turn:
    """What the compaction step did to one recorded request."""

    body: dict[str, Any]  # the request as recorded (its `messages` are the client's)
    status: str
    reason: str | None
    cache: str | None
    tokens_before: int
    tokens_after: int
    messages: list[Message]  # as forwarded (the recorded ones when nothing changed)
    changed: bool
    usage: Usage  # every summarizer call this turn paid for, failed ones included
    calls: int  # summarizer HTTP requests this turn made (retries included)
    seconds: float

    @property
    def original(self) -> list[Message]:
        messages: list[Message] = self.body["messages"]
        return messages


class Calls:
    """Summarizer HTTP requests made so far (a request hook of the client adds them)."""

    def __init__(self) -> None:
        self.made = 0

    async def hook(self, request: httpx.Request) -> None:
        self.made += 1


class Engine:
    """One replayed run: a strategy and budget (in `settings`), with a store of its own."""

    def __init__(
        self,
        settings: Settings,
        counter: TokenCounter,
        client: httpx.AsyncClient,
        calls: Calls,
        *,
        budget: int | None,
        summarizer_key: str | None = None,
    ) -> None:
        """`client` carries the summarizer calls (`calls` is its request hook's count);
        `budget` None: the baseline, nothing compacted. Raises ConfigError when
        `compaction.strategy` is not one the server would load (the same loader)."""
        self.settings = settings
        self.counter = counter
        store = create_store(settings.cache)
        self.compactor = Compactor(settings, counter, client, store, Metrics(store))
        self.turns = TurnMemo(settings.cache.turn_memo_bytes)
        self.control = Control(budget=UNLIMITED if budget is None else budget)
        self.summarizer_key = summarizer_key
        self.calls = calls

    async def turn(self, raw: bytes, *, scope: str, request_id: str) -> Turn:
        """Raises ProxyError when the request is one the server would refuse (400)."""
        started = time.perf_counter()
        calls = self.calls.made
        body, spans = await parse_chat(raw, self.settings.server.max_messages, self.turns, scope)
        original = body["messages"]
        spend = Spend()
        outcome: Outcome = await self.compactor.run(
            body,
            self.control,
            client_headers=summarizer_request_headers(
                (), request_id=request_id, api_key=self.summarizer_key
            ),
            scope=scope,
            parsed=Parsed(raw, spans),
            spend=spend,
        )
        before = outcome.tokens_before or 0
        forwarded = outcome.messages if outcome.messages is not None else original
        return Turn(
            body=body,
            status=outcome.status,
            reason=outcome.reason,
            cache=outcome.cache,
            tokens_before=before,
            tokens_after=outcome.tokens_after if outcome.tokens_after is not None else before,
            messages=forwarded,
            changed=outcome.messages is not None,
            usage=spend.usage,
            calls=self.calls.made - calls,
            seconds=time.perf_counter() - started,
        )


