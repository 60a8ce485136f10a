"""Tool definitions beyond the cookbook's flat example: nesting, arrays, variants, others."""

from __future__ import annotations

from typing import Any

import tiktoken

from proxy.tokens import TokenCounter

O200K = tiktoken.get_encoding("o200k_base")
FUNC_INIT, PROP_INIT, PROP_KEY, ENUM_INIT, ENUM_ITEM, FUNC_END = 7, 3, 3, -3, 3, 12


def n(text: str) -> int:
    return len(O200K.encode_ordinary(text))


def tools_of(*definitions: dict[str, Any]) -> dict[str, Any]:
    return {"model": "gpt-4o", "messages": [], "tools": list(definitions)}


def function(parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": "f", "description": "Do it.", "parameters": parameters},
    }


def test_nested_objects_count_each_level(counter: TokenCounter) -> None:
    nested = function(
        {
            "type": "object",
            "properties": {
                "opts": {
                    "type": "object",
                    "description": "Options.",
                    "properties": {"depth": {"type": "integer", "description": "How deep"}},
                }
            },
        }
    )
    expected = FUNC_END + FUNC_INIT + n("f:Do it")
    expected += PROP_INIT + PROP_KEY + n("opts:object:Options")
    expected += PROP_INIT + PROP_KEY + n("depth:integer:How deep")
    assert counter.count_tools("gpt-4o", tools_of(nested)) == expected


def test_array_items_and_variants(counter: TokenCounter) -> None:
    schema = function(
        {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}},
                "when": {"anyOf": [{"type": "string"}, {"enum": [1, None]}]},
            },
        }
    )
    expected = FUNC_END + FUNC_INIT + n("f:Do it") + PROP_INIT
    expected += PROP_KEY + n("tags:array:") + ENUM_INIT + 2 * ENUM_ITEM + n("a") + n("b")
    expected += PROP_KEY + n("when::") + ENUM_INIT + 2 * ENUM_ITEM + n("1") + n("null")
    assert counter.count_tools("gpt-4o", tools_of(schema)) == expected


def test_functions_without_parameters_and_other_tool_types(counter: TokenCounter) -> None:
    bare = {"type": "function", "function": {"name": "ping"}}
    custom = {"type": "custom", "custom": {"name": "sql", "description": "Run SQL"}}
    expected = FUNC_END + (FUNC_INIT + n("ping:")) + (FUNC_INIT + n("sql") + n("Run SQL"))
    assert counter.count_tools("gpt-4o", tools_of(bare, custom)) == expected
    assert counter.count_tools("gpt-4o", {"tools": []}) == 0


def test_cl100k_models_pay_more_per_function(counter: TokenCounter) -> None:
    body = tools_of({"type": "function", "function": {"name": "ping"}})
    cl100k = tiktoken.get_encoding("cl100k_base")
    assert counter.count_tools("gpt-4", body) == FUNC_END + 10 + len(
        cl100k.encode_ordinary("ping:")
    )
