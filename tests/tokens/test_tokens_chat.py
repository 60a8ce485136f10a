"""The chat formula field by field, against tiktoken itself as the reference."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import pytest
import tiktoken

from proxy.tokens import TokenCounter
from proxy.tokens.media import PAGE_TEXT_TOKENS

O200K = tiktoken.get_encoding("o200k_base")


def n(text: str) -> int:
    return len(O200K.encode_ordinary(text))


def cookbook(messages: list[dict[str, str]]) -> int:
    """The cookbook's num_tokens_from_messages, for string-only messages."""
    total = 3
    for message in messages:
        total += 3
        for key, value in message.items():
            total += n(value) + (1 if key == "name" else 0)
    return total


def test_string_messages_follow_the_cookbook(counter: TokenCounter) -> None:
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "name": "alice", "content": "Héllo wörld — 你好\uff0c世界! 👋🏽"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "<|endoftext|> is plain text here"},
    ]
    assert counter.count_messages("gpt-4o", messages) == cookbook(messages)


def test_name_costs_its_tokens_plus_one(counter: TokenCounter) -> None:
    plain = {"role": "user", "content": "hi"}
    named = {**plain, "name": "bob_the_builder"}
    extra = counter.count_message("gpt-4o", named) - counter.count_message("gpt-4o", plain)
    assert extra == n("bob_the_builder") + 1


def test_content_parts_cost_their_texts(counter: TokenCounter) -> None:
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "first part"}, {"type": "text", "text": " second"}],
    }
    assert counter.count_message("gpt-4o", parts) == 3 + n("user") + n("first part") + n(" second")
    single = {"role": "user", "content": [{"type": "text", "text": "same"}]}
    assert counter.count_message("gpt-4o", single) == counter.count_message(
        "gpt-4o", {"role": "user", "content": "same"}
    )


def test_refusal_is_counted(counter: TokenCounter) -> None:
    field = {"role": "assistant", "content": None, "refusal": "I can't help with that."}
    part = {
        "role": "assistant",
        "content": [{"type": "refusal", "refusal": "I can't help with that."}],
    }
    expected = 3 + n("assistant") + n("I can't help with that.")
    assert counter.count_message("gpt-4o", field) == expected
    assert counter.count_message("gpt-4o", part) == expected


def test_tool_calls_and_tool_results(counter: TokenCounter) -> None:
    args = json.dumps({"path": "src/main.py", "limit": 40})
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_abc",
                "type": "function",
                "function": {"name": "read_file", "arguments": args},
            },
            {"id": "call_def", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
        ],
    }
    expected_call = 3 + n("assistant") + (n("read_file") + n(args) + 3) + (n("ls") + n("{}") + 3)
    assert counter.count_message("gpt-4o", call) == expected_call
    result = {"role": "tool", "tool_call_id": "call_abc", "content": "print('hi')"}
    assert counter.count_message("gpt-4o", result) == 3 + n("tool") + n("call_abc") + n(
        "print('hi')"
    )
    # arguments sent as an object are counted as their JSON
    as_object = json.loads(json.dumps(call))
    as_object["tool_calls"][0]["function"]["arguments"] = {"path": "src/main.py", "limit": 40}
    compact = json.dumps({"path": "src/main.py", "limit": 40}, separators=(",", ":"))
    assert counter.count_message("gpt-4o", as_object) == expected_call - n(args) + n(compact)


def test_legacy_function_call_and_function_role(counter: TokenCounter) -> None:
    call = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}
    assert counter.count_message("gpt-4o", call) == 3 + n("assistant") + n("f") + n("{}") + 3
    result = {"role": "function", "name": "f", "content": "42"}
    assert counter.count_message("gpt-4o", result) == 3 + n("function") + n("f") + 1 + n("42")


def test_custom_tool_calls(counter: TokenCounter) -> None:
    call = {
        "role": "assistant",
        "tool_calls": [
            {"id": "c1", "type": "custom", "custom": {"name": "sql", "input": "SELECT 1"}}
        ],
    }
    assert (
        counter.count_message("gpt-4o", call) == 3 + n("assistant") + n("sql") + n("SELECT 1") + 3
    )


def wav(seconds: float, rate: int = 16_000) -> str:
    data = b"\x00\x00" * int(rate * seconds)
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"LIST" + struct.pack("<I", 5) + b"abcde\x00"  # odd-sized chunk, padded
    body += b"data" + struct.pack("<I", len(data)) + data
    return base64.b64encode(b"RIFF" + struct.pack("<I", len(body)) + body).decode()


def test_audio_estimate(counter: TokenCounter) -> None:
    def message(data: str, fmt: str) -> dict[str, Any]:
        part = {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}
        return {"role": "user", "content": [part]}

    role = 3 + n("user")
    assert counter.count_message("gpt-4o", message(wav(2.0), "wav")) == role + 20
    assert counter.count_message("gpt-4o", message(wav(0.55), "wav")) == role + 6
    mp3 = base64.b64encode(b"\xff\xfb" + b"\x00" * 31_998).decode()  # 2 s at 128 kbit/s
    assert counter.count_message("gpt-4o", message(mp3, "mp3")) == role + 20


@pytest.mark.parametrize(
    "data",
    [
        "é" * 64_000,  # not base64 at all (non-ASCII)
        "!" * 64_000,  # not the base64 alphabet
        # a WAV header without a format chunk: sized, not trusted
        base64.b64encode(b"RIFF\xff\xff\xff\xffWAVE").decode() + "A" * 63_976,
    ],
)
def test_odd_audio_data_is_estimated_by_size_without_a_traceback(
    counter: TokenCounter, caplog: pytest.LogCaptureFixture, data: str
) -> None:
    message = {
        "role": "user",
        "content": [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}],
    }
    count = counter.count_message("gpt-4o", message)
    assert counter.fallbacks == 0
    assert [r for r in caplog.records if r.exc_info] == []
    # 64,000 characters ~ 48,000 bytes = 3 s at 128 kbit/s = 30 tokens
    assert count == 3 + n("user") + 30


def test_junk_wav_byte_rate_does_not_make_hours_of_audio(counter: TokenCounter) -> None:
    fmt = struct.pack("<HHIIHH", 1, 1, 1, 1, 1, 8)  # 1 byte per second
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", 48_000) + b"\x00" * 48_000
    data = base64.b64encode(b"RIFF" + struct.pack("<I", len(body)) + body).decode()
    part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    count = counter.count_message("gpt-4o", {"role": "user", "content": [part]})
    assert count < 3 + n("user") + 40  # the size estimate (~3 s), not 48,000 s


def test_file_estimate(counter: TokenCounter) -> None:
    pdf = b"%PDF-1.4\n1 0 obj << /Type /Pages /Count 2 >>\n2 0 obj << /Type /Page >>\n"
    pdf += b"3 0 obj <</Type/Page>>\n%%EOF"
    url = "data:application/pdf;base64," + base64.b64encode(pdf).decode()
    part = {"type": "file", "file": {"filename": "a.pdf", "file_data": url}}
    message = {"role": "user", "content": [part]}
    assert counter.count_message("gpt-4o", message) == 3 + n("user") + n("a.pdf") + 2 * (
        765 + PAGE_TEXT_TOKENS
    )
    by_id = {"role": "user", "content": [{"type": "file", "file": {"file_id": "file-123"}}]}
    assert counter.count_message("gpt-4o", by_id) == 3 + n("user") + 765 + PAGE_TEXT_TOKENS


def test_count_text_is_plain_tiktoken(counter: TokenCounter) -> None:
    text = "def f(x):\n    return x ** 2  # 平方\n" * 500
    assert counter.count_text("gpt-4o", text) == n(text)
    cl100k = tiktoken.get_encoding("cl100k_base")
    assert counter.count_text("gpt-4", text) == len(cl100k.encode_ordinary(text))
    assert counter.count_text("gpt-4o", "") == 0
    assert counter.count_text("gpt-4o", "<|endoftext|>") == n("<|endoftext|>") > 1
    assert counter.count_text("gpt-4o", "\ud800 lone surrogate") > 0


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"messages": None},
        {"messages": "hello"},
        {"messages": [None, 1, "text", ["nested"], {"role": 5}]},
        {"messages": [{"role": "user", "content": {"type": "text", "text": "dict content"}}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}, {"type": "file"}]}]},
        {"messages": [{"role": "assistant", "tool_calls": "oops"}]},
        {"messages": [{"role": "assistant", "tool_calls": [None, {"function": 3}]}]},
        {"messages": [], "tools": [None, "x", {"type": "function", "function": None}]},
        {"messages": [], "tools": [{"function": {"name": "f", "parameters": {"properties": 1}}}]},
        {"messages": [], "functions": "nope", "tools": {}},
    ],
)
def test_odd_bodies_never_raise(counter: TokenCounter, body: dict[str, Any]) -> None:
    assert counter.count_request(body) >= 0
    assert counter.fallbacks == 0


def test_cyclic_and_deep_input_never_raises(counter: TokenCounter) -> None:
    cyclic: dict[str, Any] = {"role": "user", "content": []}
    cyclic["content"].append(cyclic)
    deep: Any = "bottom"
    for _ in range(5000):
        deep = [deep]
    for message in (cyclic, {"role": "user", "content": deep}, {"role": "user", "x": deep}):
        assert counter.count_messages("gpt-4o", [message]) >= 6
    assert counter.count_request([1, 2]) == 0  # type: ignore[arg-type]
    assert counter.fallbacks == 0
