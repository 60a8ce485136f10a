"""The bodies the proxy writes: the summarizer's request reads as the stdlib would write it."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from proxy import jsonbytes

# Every code point but the surrogates: what a parsed client text can hold besides them.
_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=200)
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 63) - 1) | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=20,
)


def stdlib(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


@given(_VALUES)
def test_a_composed_body_is_written_byte_for_byte_as_the_stdlib_writes_it(value: object) -> None:
    assert jsonbytes.cleaned(value) == stdlib(value)


def test_every_control_and_escape_character_is_written_as_the_stdlib_writes_it() -> None:
    text = "".join(map(chr, range(0x800))) + '\u2028\u2029\ufeff\U0001f600"\\/'
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 5}
    assert jsonbytes.cleaned(body) == stdlib(body)


def test_lone_surrogates_in_a_summarizer_body_become_replacement_characters() -> None:
    written = jsonbytes.cleaned({"content": "a \ud800 b \udfff"})
    assert json.loads(written) == {"content": "a \ufffd b \ufffd"}


def test_what_orjson_refuses_is_still_written() -> None:
    assert jsonbytes.cleaned({"n": 1 << 70}) == b'{"n":1180591620717411303424}'
    assert jsonbytes.cleaned({1: "x"}) == b'{"1":"x"}'


@given(
    st.dictionaries(
        st.text(st.characters(codec="utf-8") | st.sampled_from("\ud800\udfff"), max_size=8),
        st.text(st.characters(codec="utf-8") | st.sampled_from("\ud800\udfff\x00\"\\")),
        max_size=4,
    )
    | st.dictionaries(st.integers(), _TEXT, max_size=2)
    | _VALUES
)
def test_a_forwarded_message_is_written_as_the_forwarded_body_writes_it(value: object) -> None:
    """Summary messages (strings only) go through orjson: the same bytes, surrogates too."""
    assert jsonbytes.forwarded_message(value) == jsonbytes.forwarded(value)
