"""The span parser: the same body as json.loads, and each message's own bytes."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy import jsonbytes, jsonspans
from proxy.chat import reencode
from proxy.jsonparse import TooManyItems
from proxy.jsonspans import loads_chat
from proxy.sessioncache import SessionCache
from proxy.store.chain import chain_hashes
from proxy.validation import parse_chat_spans

texts = st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from('}{],["\\\n'))
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=12,
)
messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool"])},
    optional={"content": values, "tool_calls": st.lists(values, max_size=3), "x": values},
)
FORMATS = [
    {"separators": (",", ":"), "ensure_ascii": False},
    {"separators": (", ", ": ")},
    {"indent": 2},
]


def encoded(body: Any, form: dict[str, Any]) -> bytes:
    return json.dumps(body, **form).encode("utf-8", "surrogatepass")


@given(
    st.lists(messages, min_size=1, max_size=6),
    st.dictionaries(st.sampled_from(["model", "tools", "z", "stream"]), values, max_size=3),
    st.sampled_from(FORMATS),
)
def test_span_parser_equals_json_loads_and_spans_are_the_messages(
    history: list[dict[str, Any]], rest: dict[str, Any], form: dict[str, Any]
) -> None:
    raw = encoded({**rest, "messages": history}, form)
    parsed = loads_chat(raw)
    if parsed is None:  # allowed (the stdlib then parses), but not for ordinary bodies
        assert '"messages"' in json.dumps(rest)
        return
    body, spans = parsed
    assert body == json.loads(raw)
    assert list(body) == list(json.loads(raw))
    assert [json.loads(bytes(spans.view(i))) for i in range(len(history))] == history


@given(
    st.lists(messages, min_size=1, max_size=6),
    st.dictionaries(st.sampled_from(["model", "tools", "z"]), values, max_size=2),
    st.sampled_from(FORMATS),
)
def test_one_call_fast_path_and_element_by_element_path_agree(
    history: list[dict[str, Any]], rest: dict[str, Any], form: dict[str, Any]
) -> None:
    raw = encoded({**rest, "messages": history}, form)
    fast = jsonspans.loads_chat_fast(raw)
    view = memoryview(raw)
    found = jsonspans._FIELD.search(raw)
    slow = None if found is None else jsonspans._by_element(raw, view, found, found.end(), 0, 0)
    if fast is None:  # declined: the element-by-element path decides
        return
    if not fast:
        assert slow is None
        return
    assert slow is not None
    assert fast[0] == slow[0] == json.loads(raw)
    assert (fast[1].starts, fast[1].ends, fast[1].close) == (
        slow[1].starts,
        slow[1].ends,
        slow[1].close,
    )
    assert fast[1].keys() == slow[1].keys()


@pytest.mark.parametrize(
    "content",
    ["ends like a boundary },{", "ends like the end }],", 'quoted \\"},{"', "}, {", "}]}"],
)
def test_strings_that_look_like_element_boundaries(content: str) -> None:
    history = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": [{"text": content}]},
        {"role": "user", "content": "next"},
    ]
    for form in FORMATS:
        raw = encoded({"model": "m", "messages": history, "tools": [{"a": content}]}, form)
        parsed = loads_chat(raw)
        assert parsed is not None
        body, spans = parsed
        assert body == json.loads(raw)
        assert [json.loads(bytes(spans.view(i))) for i in range(3)] == history


def test_what_orjson_refuses_is_read_by_the_stdlib_with_its_span() -> None:
    history = [
        {"role": "user", "content": "a lone \ud800 surrogate"},
        {"role": "user", "content": "fine"},
    ]
    raw = json.dumps({"model": "m", "messages": history, "n": float("nan")}).encode()
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(raw)
    parsed = loads_chat(raw)
    assert parsed is not None
    body, spans = parsed
    assert body["messages"] == history
    assert bytes(spans.view(0)) == b'{"role": "user", "content": "a lone \\ud800 surrogate"}'
    assert repr(body["n"]) == "nan"


def test_integers_beyond_64_bits_outside_messages_stay_exact() -> None:
    raw = b'{"seed": 123456789012345678901234567890, "messages": [{"role": "user"}]}'
    parsed = loads_chat(raw)
    assert parsed is not None and parsed[0]["seed"] == 123456789012345678901234567890


@pytest.mark.parametrize(
    "raw",
    [
        b'{"tools": [{"messages": [{"role": "x"}]}], "messages": [{"role": "user"}]}',
        b'{"messages": [{"role": "user"}], "messages": [{"role": "assistant"}]}',
        b'{"messages": []}',
        b'{"messages": ["hi"]}',
        b'{"messages": [{"role": "user"}, {}]}',
        b'{"messages": [{"role": "user"}] x',
        b'\xef\xbb\xbf{"messages": [{"role": "user"}]}',
    ],
)
def test_unusual_bodies_are_left_to_the_stdlib_parser(raw: bytes) -> None:
    parsed = loads_chat(raw)
    if parsed is not None:  # then it must be exactly what json.loads reads
        assert parsed[0] == json.loads(raw)
    try:
        expected: Any = json.loads(raw)
    except ValueError:
        expected = None
    history = expected.get("messages") if isinstance(expected, dict) else None
    if isinstance(history, list) and history and all(isinstance(m, dict) and m for m in history):
        body, _ = parse_chat_spans(raw)
        assert body == expected


def test_too_many_messages_stops_early() -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": "x"}] * 10}).encode()
    with pytest.raises(TooManyItems):
        loads_chat(raw, max_items=3)


def test_tiny_messages_are_left_to_the_stdlib_when_asked() -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": "x"}] * 2000}).encode()
    assert loads_chat(raw, min_average=256) is None
    assert loads_chat(raw) is not None


def test_forwarded_body_keeps_the_clients_bytes_of_kept_messages() -> None:
    history = [
        {"role": "user", "content": "task \ud800"},
        {"content": "é", "role": "assistant"},
        {"role": "user", "content": "latest"},
    ]
    raw = json.dumps({"model": "m", "messages": history, "seed": 2**70}, indent=1).encode()
    parsed = loads_chat(raw)
    assert parsed is not None
    body, spans = parsed
    summary = {"role": "user", "content": "summary \udfff"}
    out = reencode(body, [summary, body["messages"][1], body["messages"][2]], raw, spans)
    out.decode("utf-8")  # valid UTF-8
    assert bytes(spans.view(1)) in out  # "\u00e9" as the client escaped it
    assert b'"summary \\udfff"' in out
    assert json.loads(out) == {**json.loads(raw), "messages": [summary, *history[1:]]}
    # Without the spans (or with other bytes), the whole body is re-encoded.
    other = reencode(body, [summary], jsonbytes.forwarded(body), spans)
    assert json.loads(other)["messages"] == [summary]


def test_the_session_cache_gives_the_same_keys_and_hashes_only_new_messages() -> None:
    history = [{"role": "user", "content": f"message {i}"} for i in range(20)]
    cache = SessionCache()

    def keys(count: int) -> tuple[list[str], int]:
        raw = json.dumps({"messages": history[:count]}).encode()
        parsed = loads_chat(raw)
        assert parsed is not None
        _, spans = parsed
        hashed: list[int] = []
        digest = spans.digest

        def counted(index: int) -> bytes:
            hashed.append(index)
            return digest(index)

        spans.digest = counted  # type: ignore[method-assign]
        with_cache = chain_hashes("s", "n", spans.messages, spans, cache)
        count_hashed = len(hashed)
        assert with_cache == chain_hashes("s", "n", spans.messages, spans)
        return with_cache, count_hashed

    first, hashed = keys(10)
    assert hashed == 10
    cache = cache.extended()  # the next turn's body extends this one
    second, hashed = keys(12)
    assert hashed == 2 and second[:10] == first
    assert len(cache.chains) == 1  # the extended chain replaced the one it extended
    assert chain_hashes("other", "n", history) != chain_hashes("s", "n", history)


exact_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()  # past 64 bits too
    | st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**19, -(10**19), 10**18])
    | st.floats()  # NaN and infinities too
    | st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from("\ud800\udc00\x00\"\\")),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=12,
)


@given(st.dictionaries(st.sampled_from(["model", "tools", "seed", "z"]), exact_values, max_size=4))
def test_the_body_outside_its_messages_reads_exactly_as_json_loads(rest: dict[str, Any]) -> None:
    """Each value as the stdlib reads it (type-exact: no integer read as a float)."""
    history = [{"role": "user", "content": "a long enough message " * 20}]
    raw = json.dumps({"messages": history, **rest}).encode("utf-8", "surrogatepass")
    expected = json.loads(raw)
    for parse in (loads_chat, jsonspans.loads_chat_fast):
        parsed = parse(raw)
        assert parsed
        assert repr(parsed[0]) == repr(expected)


@given(
    st.lists(messages, min_size=1, max_size=6),
    st.sampled_from(FORMATS),
    st.lists(st.integers(-1, 6), max_size=10),
)
def test_splice_writes_each_clients_message_as_its_bytes_in_any_order(
    history: list[dict[str, Any]], form: dict[str, Any], picks: list[int]
) -> None:
    raw = encoded({"model": "m", "messages": history, "n": 1}, form)
    parsed = loads_chat(raw)
    if parsed is None:
        return
    spans = parsed[1]
    summary = {"role": "user", "content": "summary },{ \ud800"}
    chosen = [spans.messages[p] if 0 <= p < len(history) else summary for p in picks]
    parts = [
        jsonbytes.forwarded(m) if (i := spans.index_of(m)) is None else bytes(spans.view(i))
        for m in chosen
    ]
    tail = raw[spans.close :]
    want = raw[: spans.open] + b"[" + b",".join(parts) + b"]" + tail
    assert spans.splice(raw, chosen, jsonbytes.forwarded_message) == want
    assert json.loads(want)["messages"] == [json.loads(p) for p in parts]
