"""Fixtures for the token-counting tests: counters over the shared, verified BPE files."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from proxy.settings import Settings
from proxy.tokens import TokenCounter

CounterFactory = Callable[..., TokenCounter]


def make_settings(tokenizer: dict[str, Any] | None = None, **sections: Any) -> Settings:
    return Settings.model_validate({"tokenizer": tokenizer or {}, **sections})


@pytest.fixture
def make_counter() -> Iterator[CounterFactory]:
    """A loaded counter per call (encodings are built once per process); closed after."""
    made: list[TokenCounter] = []

    def factory(tokenizer: dict[str, Any] | None = None, **sections: Any) -> TokenCounter:
        counter = TokenCounter(make_settings(tokenizer, **sections))
        counter.load()
        made.append(counter)
        return counter

    yield factory
    for counter in made:
        counter.close()


@pytest.fixture
def counter(make_counter: CounterFactory) -> TokenCounter:
    return make_counter()
