"""Prefix keys: equal histories share keys, any difference (or another tenant) does not."""

from __future__ import annotations

import json
from typing import Any

from proxy.store.chain import canonical, chain_hashes, namespace_for, scope_for

SCOPE = scope_for("sk-test", "credential")
NS = namespace_for(model="m", prompt_version=1, summary_max_tokens=2000, max_preserved=2)

HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "hello"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
    {"role": "assistant", "content": "one file"},
]


def test_same_history_same_keys_and_prefix_property() -> None:
    keys = chain_hashes(SCOPE, NS, HISTORY)
    assert len(keys) == len(HISTORY)
    assert len(set(keys)) == len(keys)
    again = chain_hashes(SCOPE, NS, json.loads(json.dumps(HISTORY)))
    assert again == keys
    # A longer history (the next turn) extends the chain without changing earlier keys.
    longer = [*HISTORY, {"role": "user", "content": "next"}]
    assert chain_hashes(SCOPE, NS, longer)[: len(HISTORY)] == keys
    assert chain_hashes(SCOPE, NS, []) == []


def test_every_field_changes_the_key() -> None:
    base = {"role": "user", "content": "hi"}
    variants: list[dict[str, Any]] = [
        base,
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "hi "},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": ""}]},
        {"role": "user", "content": "hi", "name": "alice"},
        {"role": "user", "content": "hi", "name": "bob"},
        {"role": "user", "content": "hi", "x_unknown": 1},
        {"role": "user", "content": "hi", "x_unknown": "1"},
        {"role": "user", "content": "hi", "x_unknown": None},
        {"role": "assistant", "content": "hi", "tool_calls": [{"id": "call_1"}]},
        {"role": "assistant", "content": "hi", "tool_calls": [{"id": "call_2"}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "u", "detail": "x"}}],
        },
    ]
    keys = [chain_hashes(SCOPE, NS, [v])[0] for v in variants]
    assert len(set(keys)) == len(variants)
    # Also as the last message of a longer history.
    tails = [chain_hashes(SCOPE, NS, [*HISTORY, v])[-1] for v in variants]
    assert len(set(tails)) == len(variants)


def test_key_order_does_not_matter_anywhere() -> None:
    a = {"role": "tool", "content": [{"type": "text", "text": "x"}], "tool_call_id": "c"}
    b = {"tool_call_id": "c", "content": [{"text": "x", "type": "text"}], "role": "tool"}
    assert canonical(a) == canonical(b)
    assert chain_hashes(SCOPE, NS, [a]) == chain_hashes(SCOPE, NS, [b])


def test_order_and_boundaries_of_messages_matter() -> None:
    m1, m2 = {"role": "user", "content": "a"}, {"role": "user", "content": "b"}
    forward = chain_hashes(SCOPE, NS, [m1, m2])
    backward = chain_hashes(SCOPE, NS, [m2, m1])
    merged = chain_hashes(SCOPE, NS, [{"role": "user", "content": "ab"}])
    assert forward[-1] != backward[-1]
    assert forward[-1] != merged[-1]
    # The root commits to scope and namespace separately, not to their concatenation.
    assert chain_hashes("ab", "c", [m1]) != chain_hashes("a", "bc", [m1])


def test_canonical_form() -> None:
    assert canonical({"b": 1, "a": [1, {"d": "é", "c": None}]}) == (
        '{"a":[1,{"c":null,"d":"é"}],"b":1}'.encode()
    )
    # Lone surrogates (json.loads accepts "\ud800") hash without failing, and distinctly.
    lone = json.loads('{"content": "\\ud800"}')
    other = json.loads('{"content": "\\ud801"}')
    assert canonical(lone) != canonical(other)


def test_scope_isolates_credentials_and_hides_them() -> None:
    a = scope_for("sk-secret-a", "credential")
    b = scope_for("sk-secret-b", "credential")
    assert a is not None and b is not None
    assert a != b
    assert "sk-secret-a" not in a and "secret" not in a
    assert a == scope_for("sk-secret-a", "credential")
    assert chain_hashes(a, NS, HISTORY) != chain_hashes(b, NS, HISTORY)
    assert set(chain_hashes(a, NS, HISTORY)).isdisjoint(chain_hashes(b, NS, HISTORY))
    assert scope_for(None, "credential") is None  # no store for key-less clients by default
    assert scope_for(None, "credential", anonymous="shared") == "anonymous" != a
    assert scope_for("sk-secret-a", "global") == scope_for("sk-secret-b", "global")
    assert scope_for(None, "global") == "global"


def test_namespace_covers_every_part_canonically() -> None:
    base = namespace_for(model="m", prompt_version=1, summary_max_tokens=2000)
    assert base == namespace_for(summary_max_tokens=2000, prompt_version=1, model="m")
    assert base != namespace_for(model="m2", prompt_version=1, summary_max_tokens=2000)
    assert base != namespace_for(model="m", prompt_version=2, summary_max_tokens=2000)
    assert base != namespace_for(model="m", prompt_version=1, summary_max_tokens=2001)
    assert base != namespace_for(model="m", prompt_version=1)
    other = namespace_for(model="m2", prompt_version=1, summary_max_tokens=2000)
    assert chain_hashes(SCOPE, base, HISTORY) != chain_hashes(SCOPE, other, HISTORY)
