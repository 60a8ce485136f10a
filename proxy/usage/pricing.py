"""Dollars from tokens: USD per 1M tokens by model glob.

The shipped table covers common OpenAI models at list prices and is only a default: prices
change, and contracts differ. `[pricing."<glob>"]` entries in the config override or extend
it; the most specific pattern wins (an exact name, else the longest matching glob), so
`gpt-4o-mini*` beats `gpt-4o*` for `gpt-4o-mini-2024-07-18`. A model that matches nothing
costs nothing here (and no `x-compaction-cost-usd` header is sent for it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

from proxy.compaction.protocol import Usage
from proxy.quota.ledger import NANO
from proxy.settings import PriceSettings


@dataclass(frozen=True)
class Price:
    input: float
    cached_input: float
    output: float

    def cost_usd(self, prompt: int, cached: int, completion: int) -> float:
        if cached < 0:  # min(max(cached, 0), prompt), without two builtin calls per reply
            cached = 0
        if cached > prompt:
            cached = prompt
        return (
            (prompt - cached) * self.input + cached * self.cached_input + completion * self.output
        ) / 1_000_000


def _p(input: float, cached: float | None, output: float) -> Price:
    return Price(input, input if cached is None else cached, output)


# USD per 1M tokens: input, cached input, output (list prices; edit via [pricing."glob"]).
DEFAULT_PRICES: dict[str, Price] = {
    "gpt-5*": _p(1.25, 0.125, 10.0),
    "gpt-5-mini*": _p(0.25, 0.025, 2.0),
    "gpt-5-nano*": _p(0.05, 0.005, 0.40),
    "gpt-4.1*": _p(2.0, 0.50, 8.0),
    "gpt-4.1-mini*": _p(0.40, 0.10, 1.60),
    "gpt-4.1-nano*": _p(0.10, 0.025, 0.40),
    "gpt-4o*": _p(2.50, 1.25, 10.0),
    "gpt-4o-mini*": _p(0.15, 0.075, 0.60),
    "gpt-4-turbo*": _p(10.0, None, 30.0),
    "gpt-4": _p(30.0, None, 60.0),
    "gpt-3.5-turbo*": _p(0.50, None, 1.50),
    "o1*": _p(15.0, 7.50, 60.0),
    "o1-mini*": _p(1.10, 0.55, 4.40),
    "o3*": _p(2.0, 0.50, 8.0),
    "o3-mini*": _p(1.10, 0.55, 4.40),
    "o4-mini*": _p(1.10, 0.275, 4.40),
}


def _specificity(pattern: str) -> tuple[bool, int]:
    literal = not any(c in pattern for c in "*?[")
    return (literal, len(pattern.rstrip("*?")))


_UNSEEN = Price(0.0, 0.0, 0.0)  # a model not looked up yet (None: looked up, unpriced)


class Pricing:
    """Model name -> Price, memoised per name (the table is fixed for the app's life)."""

    def __init__(self, overrides: Mapping[str, PriceSettings] | None = None) -> None:
        table = dict(DEFAULT_PRICES)
        for pattern, price in (overrides or {}).items():
            table[pattern] = _p(price.input, price.cached_input, price.output)
        self._table = sorted(table.items(), key=lambda item: _specificity(item[0]), reverse=True)
        self._memo: dict[str, Price | None] = {}

    def price_of(self, model: str) -> Price | None:
        found = self._memo.get(model, _UNSEEN)
        if found is not _UNSEEN:
            return found
        name = model.rsplit("/", 1)[-1]  # "openai/gpt-4o" prices as gpt-4o
        found = next((p for pat, p in self._table if fnmatchcase(name, pat)), None)
        if len(self._memo) < 10_000:
            self._memo[model] = found
        return found

    def table(self) -> dict[str, dict[str, float]]:
        return {
            pat: {"input": p.input, "cached_input": p.cached_input, "output": p.output}
            for pat, p in self._table
        }


def request_cost_nano(
    pricing: Pricing,
    model: str,
    summarizer_model: str | None,
    summary: Usage | None,
    prompt: int,
    completion: int,
    cached: int = 0,
) -> int:
    """Nano-dollars for one request's reply plus its summarizer calls (`summary`, priced at
    the summarizer's model, else the request's)."""
    price = pricing.price_of(model)
    usd = 0.0 if price is None else price.cost_usd(prompt, cached, completion)
    if summary is not None and (summary.input_tokens or summary.output_tokens):
        summarizer = pricing.price_of(summarizer_model or model)
        if summarizer is not None:
            usd += summarizer.cost_usd(summary.input_tokens, 0, summary.output_tokens)
    return round(usd * NANO)
