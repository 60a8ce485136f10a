"""Properties over generated input: additivity of the formula, and no input ever raises."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.settings import Settings
from proxy.tokens import TokenCounter

COUNTER = TokenCounter(Settings())  # one for all examples: hypothesis runs each test many times
COUNTER.load()
O200K = tiktoken.get_encoding("o200k_base")


@pytest.fixture(scope="module", autouse=True)
def _close_counter() -> Iterator[None]:
    yield
    COUNTER.close()


texts = st.one_of(
    st.text(max_size=200),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=50),  # any code point but surrogates
    st.just(""),
    st.builds(  # long (the text memo path), cheap to generate
        lambda unit, times: unit * times,
        st.text(alphabet="ab 漢字\n", min_size=1, max_size=12),
        st.integers(min_value=200, max_value=600),
    ),
    st.sampled_from(["<|endoftext|>", "\ud800", "\x00", "👩‍👩‍👧‍👦", "a" * 70_000]),
)
parts = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, texts),
    st.builds(lambda t: {"type": "refusal", "refusal": t}, texts),
    st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, texts),
)
tool_calls = st.lists(
    st.fixed_dictionaries(
        {
            "id": texts,
            "type": st.just("function"),
            "function": st.fixed_dictionaries({"name": texts, "arguments": texts}),
        }
    ),
    max_size=3,
)
messages = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "developer"]), "content": texts},
        optional={"name": texts},
    ),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(parts, max_size=4)}),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": st.none(), "tool_calls": tool_calls}
    ),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": texts, "content": texts}),
)
models = st.sampled_from(["gpt-4o", "gpt-4", "gpt-4o-mini", "o3-mini", "unknown-model"])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | texts,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "role",
                    "content",
                    "name",
                    "type",
                    "text",
                    "image_url",
                    "url",
                    "detail",
                    "tool_calls",
                    "function",
                    "arguments",
                    "function_call",
                    "input_audio",
                    "data",
                    "format",
                    "file",
                    "file_data",
                    "refusal",
                    "parameters",
                    "properties",
                    "enum",
                    "items",
                    "description",
                    "anyOf",
                    "$defs",
                    "x",
                ]
            ),
            children,
            max_size=5,
        )
    ),
    max_leaves=25,
)

fast = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@fast
@given(models, st.lists(messages, max_size=6), st.lists(messages, max_size=6))
def test_counts_add_up(model: str, a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    whole = COUNTER.count_messages(model, a + b)
    assert whole == COUNTER.count_messages(model, a) + COUNTER.count_messages(model, b) - 3
    assert whole == 3 + sum(COUNTER.count_message(model, m) for m in a + b)


@fast
@given(texts)
def test_count_text_is_tiktoken(text: str) -> None:
    safe = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    assert COUNTER.count_text("gpt-4o", text) == len(O200K.encode_ordinary(safe))


@fast
@given(models, st.lists(json_values, max_size=5), json_values, json_values)
def test_garbage_never_raises(model: str, msgs: list[Any], tools: Any, functions: Any) -> None:
    body = {"model": model, "messages": msgs, "tools": tools, "functions": functions}
    assert COUNTER.count_request(body) >= 0
    for message in msgs:
        assert isinstance(COUNTER.count_message(model, message), int)
    assert COUNTER.fallbacks == 0


@fast
@given(json_values)
async def test_garbage_bodies_never_raise_async(body: Any) -> None:
    assert await COUNTER.acount_request(body) >= 0
    assert COUNTER.fallbacks == 0
