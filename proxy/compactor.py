"""The compaction step of the request path: decide, compact, and say what happened.

It owns the policy (budget, per-request control headers, failure policy); the algorithm lives
behind the `Compaction` protocol in proxy/compaction/.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from proxy.report import Outcome
from proxy.settings import Settings

log = logging.getLogger("proxy.compaction")


class PromptCounter(Protocol):
    """What the request path needs from token counting (proxy.tokens.TokenCounter)."""

    @property
    def estimated(self) -> bool: ...

    def count_text(self, model: str, text: str) -> int: ...

    def count_messages(self, model: str, messages: list[Any]) -> int: ...

    def count_tools(self, model: str, body: dict[str, Any]) -> int: ...

    async def acount_request(self, body: dict[str, Any]) -> int: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Control:
    """Per-request overrides from the `x-compaction` / `x-compaction-budget` headers."""

    mode: Literal["auto", "off", "force"] = "auto"
    budget: int | None = None


def model_of(body: dict[str, Any]) -> str:
    model = body.get("model")
    return model if isinstance(model, str) else ""


class Compactor:
    def __init__(self, settings: Settings, counter: PromptCounter) -> None:
        self.settings = settings
        self.counter = counter

    async def run(
        self,
        body: dict[str, Any],
        control: Control,
        *,
        credential: str | None,
        request_id: str,
    ) -> Outcome:
        model = model_of(body)
        tokens = await self.counter.acount_request(body)
        budget = control.budget or self.settings.compaction.budget_for(model)
        outcome = Outcome(tokens_before=tokens, budget=budget, estimated=self.counter.estimated)
        if control.mode == "off" or not self.settings.compaction.enabled:
            outcome.status = "off"
            return outcome
        if tokens <= budget and control.mode != "force":
            return outcome
        return outcome
