"""Tokens of tool definitions (`tools`, legacy `functions`), the way OpenAI's cookbook counts them.

OpenAI renders definitions into a hidden system text; the cookbook "How to count tokens with
tiktoken" fits that with per-function and per-property constants that reproduce the API's
`prompt_tokens` (7 per function on o200k models, 10 on cl100k; 3 per property list and
property; -3 + 3 per enum item; 12 once at the end). Each function adds the tokens of
`name:description`, each property those of `name:type:description` (a trailing period
dropped). The cookbook stops at one level; nested objects, array items, `anyOf` variants and
`$defs` are counted with the same constants, one level further each time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TextCount = Callable[[str], int]
_MAX_DEPTH = 12


@dataclass(frozen=True)
class ToolOverheads:
    func_init: int
    prop_init: int = 3
    prop_key: int = 3
    enum_init: int = -3
    enum_item: int = 3
    func_end: int = 12


O200K_TOOLS = ToolOverheads(func_init=7)
CL100K_TOOLS = ToolOverheads(func_init=10)


def definitions(body: dict[str, Any]) -> list[Any]:
    """The definition objects that cost tokens: `tools` entries, then legacy `functions`."""
    found: list[Any] = []
    for key in ("tools", "functions"):
        value = body.get(key)
        if isinstance(value, list):
            found.extend(value)
    return found


def tools_tokens(defs: list[Any], text: TextCount, costs: ToolOverheads) -> int:
    if not defs:
        return 0
    total = costs.func_end
    for item in defs:
        total += costs.func_init
        if not isinstance(item, dict):
            continue
        is_function = item.get("type", "function") == "function"
        function = item.get("function")
        if is_function and isinstance(function, dict):
            total += _function_tokens(function, text, costs)
        elif is_function and "name" in item:  # legacy `functions` entry, or the flat style
            total += _function_tokens(item, text, costs)
        else:  # custom or hosted tools: their strings, no known constants
            total += _strings(item, text, 0)
    return total


def _function_tokens(function: dict[str, Any], text: TextCount, costs: ToolOverheads) -> int:
    name = function.get("name")
    total = text(f"{_str(name)}:{_desc(function.get('description'))}")
    parameters = function.get("parameters")
    if isinstance(parameters, dict):
        total += _schema_tokens(parameters, text, costs, 0)
    return total


def _schema_tokens(
    schema: dict[str, Any], text: TextCount, costs: ToolOverheads, depth: int
) -> int:
    """The nested parts of one schema node: its properties, items, variants and definitions."""
    if depth > _MAX_DEPTH:
        return 0
    total = 0
    properties = schema.get("properties")
    if isinstance(properties, dict) and properties:
        total += costs.prop_init
        for key, spec in properties.items():
            total += _property_tokens(str(key), spec, text, costs, depth)
    items = schema.get("items")
    if isinstance(items, dict):
        total += _enum_tokens(items, text, costs) + _schema_tokens(items, text, costs, depth + 1)
    for key in ("anyOf", "oneOf", "allOf"):
        variants = schema.get(key)
        if isinstance(variants, list):
            for variant in variants:
                if isinstance(variant, dict):
                    total += _enum_tokens(variant, text, costs)
                    total += _schema_tokens(variant, text, costs, depth + 1)
    for key in ("$defs", "definitions"):
        defs = schema.get(key)
        if isinstance(defs, dict):
            for name, spec in defs.items():
                total += _property_tokens(str(name), spec, text, costs, depth)
    return total


def _property_tokens(
    name: str, spec: object, text: TextCount, costs: ToolOverheads, depth: int
) -> int:
    if not isinstance(spec, dict):
        return costs.prop_key + text(f"{name}::")
    line = f"{name}:{_type(spec.get('type'))}:{_desc(spec.get('description'))}"
    total = costs.prop_key + text(line) + _enum_tokens(spec, text, costs)
    return total + _schema_tokens(spec, text, costs, depth + 1)


def _enum_tokens(spec: dict[str, Any], text: TextCount, costs: ToolOverheads) -> int:
    enum = spec.get("enum")
    if not isinstance(enum, list):
        return 0
    total = costs.enum_init
    for item in enum:
        total += costs.enum_item + text(item if isinstance(item, str) else _json(item))
    return total


def _type(value: object) -> str:
    if isinstance(value, list):
        return " | ".join(_str(item) for item in value)
    return _str(value)


def _desc(value: object) -> str:
    desc = _str(value)
    return desc[:-1] if desc.endswith(".") else desc


def _str(value: object) -> str:
    return value if isinstance(value, str) else ""


def _json(value: object) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return ""


def _strings(value: object, text: TextCount, depth: int) -> int:
    if isinstance(value, str):
        return text(value)
    if depth > _MAX_DEPTH:
        return 0
    if isinstance(value, dict):
        return sum(_strings(item, text, depth + 1) for key, item in value.items() if key != "type")
    if isinstance(value, list):
        return sum(_strings(item, text, depth + 1) for item in value)
    return 0
