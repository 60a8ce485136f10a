"""Model name -> encoding: families, spellings, config overrides, and unknown names."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import tiktoken

from proxy.tokens import TokenCounter
from proxy.tokens.models import base_model, builtin_encoding

CounterFactory = Callable[..., TokenCounter]

O200K = [
    "gpt-4o",
    "gpt-4o-mini",
    "gpt-4o-2024-08-06",
    "chatgpt-4o-latest",
    "gpt-4.1",
    "gpt-4.1-mini-2025-04-14",
    "gpt-4.5-preview",
    "gpt-5",
    "gpt-5-mini",
    "gpt-5.1",
    "gpt-5.2-codex",
    "o1",
    "o1-mini",
    "o1-preview-2024-09-12",
    "o3",
    "o3-mini",
    "o4-mini",
    "o4-mini-2025-04-16",
    "ft:gpt-4o-mini:org::id",
    "ft:gpt-4o-mini-2024-07-18:my-org:custom-suffix:9aBcD",
    "openai/gpt-4o",
    "openrouter/openai/gpt-4.1",
    "GPT-4o",
    "codex-mini-latest",
]
CL100K = [
    "gpt-4",
    "gpt-4-0613",
    "gpt-4-32k",
    "gpt-4-turbo",
    "gpt-4-turbo-2024-04-09",
    "gpt-4-1106-preview",
    "gpt-3.5-turbo",
    "gpt-3.5-turbo-0125",
    "gpt-3.5-turbo-16k",
    "gpt-35-turbo",
    "azure/gpt-35-turbo",
    "ft:gpt-3.5-turbo-0613:org::abc",
    "ft:gpt-4-0613:org::abc",
    "text-embedding-3-small",
]
UNKNOWN = [
    "",
    "llama-3.1-70b",
    "claude-sonnet-4",
    "o10",
    "gpt-40",
    "my-deployment",
    "\x00",
    "ø" * 5000,
]


@pytest.mark.parametrize("model", O200K)
def test_o200k_families(counter: TokenCounter, model: str) -> None:
    assert counter.encoding_name(model) == "o200k_base"


@pytest.mark.parametrize("model", CL100K)
def test_cl100k_families(counter: TokenCounter, model: str) -> None:
    assert counter.encoding_name(model) == "cl100k_base"


@pytest.mark.parametrize("model", [m for m in O200K + CL100K if "/" not in m and m == m.lower()])
def test_agrees_with_tiktoken_where_tiktoken_knows_the_model(model: str) -> None:
    try:
        expected = tiktoken.model.encoding_name_for_model(model)
    except KeyError:
        pytest.skip(f"tiktoken does not know {model}")
    assert builtin_encoding(model) == expected


@pytest.mark.parametrize("model", UNKNOWN)
def test_unknown_models_use_the_default_and_still_count(
    make_counter: CounterFactory, model: str
) -> None:
    assert make_counter().encoding_name(model) == "o200k_base"
    cl100k = make_counter({"default_encoding": "cl100k_base"})
    assert cl100k.encoding_name(model) == "cl100k_base"
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}]}
    assert cl100k.count_request(body) == 3 + 1 + 1 + 3


def test_config_overrides_win(make_counter: CounterFactory) -> None:
    counter = make_counter(
        models={"my-deployment": {"encoding": "cl100k_base"}, "gpt-4o": {"encoding": "cl100k_base"}}
    )
    assert counter.encoding_name("my-deployment") == "cl100k_base"
    assert counter.encoding_name("gpt-4o") == "cl100k_base"
    assert counter.encoding_name("openai/gpt-4o") == "cl100k_base"  # matched by its base name
    assert counter.encoding_name("gpt-4o-mini") == "o200k_base"
    # an override without `encoding` changes nothing
    plain = make_counter(models={"gpt-4": {}})
    assert plain.encoding_name("gpt-4") == "cl100k_base"


def test_non_string_model_never_raises(counter: TokenCounter) -> None:
    body = {"model": ["gpt-4"], "messages": [{"role": "user", "content": "hi"}]}
    assert counter.count_request(body) == counter.count_request({"messages": body["messages"]})


@pytest.mark.parametrize(
    ("model", "base"),
    [
        ("openai/gpt-4o", "gpt-4o"),
        ("ft:gpt-4o-mini:org::id", "gpt-4o-mini"),
        ("azure/ft:gpt-4o-2024-08-06:org:x:y", "gpt-4o-2024-08-06"),
        ("  GPT-4o ", "gpt-4o"),
    ],
)
def test_base_model(model: str, base: str) -> None:
    assert base_model(model) == base
