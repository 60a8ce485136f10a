"""The per-message memo and the thread pool: repeated histories cost (almost) nothing."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.tokens import TokenCounter, chat

CounterFactory = Callable[..., TokenCounter]


def agent_history(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    for turn in range(turns):
        call_id = f"call_{turn}"
        messages += [
            {"role": "user", "content": f"step {turn}: fix the bug in module_{turn}.py " * 20},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "read", "arguments": json.dumps({"n": turn})},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": call_id,
                "content": f"def f_{turn}():\n    pass\n" * 80,
            },
            {"role": "assistant", "content": [{"type": "text", "text": f"done {turn} 完成"}]},
        ]
    return messages


def fresh(value: Any) -> Any:
    """A new request's objects: same content, no shared strings or cached hashes."""
    return json.loads(json.dumps(value))


def test_counting_a_history_twice_tokenizes_nothing_the_second_time(counter: TokenCounter) -> None:
    history = agent_history(30)
    body = {"model": "gpt-4o", "messages": history, "tools": [{"function": {"name": "read"}}]}
    first = counter.count_request(fresh(body))
    calls = counter.encode_calls
    assert calls > 0
    assert counter.count_request(fresh(body)) == first
    assert counter.encode_calls == calls


def test_one_new_message_costs_one_message(counter: TokenCounter) -> None:
    history = agent_history(30)
    before = counter.count_messages("gpt-4o", fresh(history))
    calls = counter.encode_calls
    new = {"role": "user", "content": "and now the tests"}
    after = counter.count_messages("gpt-4o", fresh([*history, new]))
    assert counter.encode_calls - calls == 2  # its role and its content
    assert after == before + counter.count_message("gpt-4o", new)


def test_extending_a_counted_request_reuses_its_sum_and_stays_exact(
    make_counter: CounterFactory,
) -> None:
    counter, reference = make_counter(), make_counter()
    history = agent_history(20)
    counter.count_messages("gpt-4o", fresh(history))
    grown = [*history, {"role": "user", "content": "next"}, {"role": "assistant", "content": "ok"}]
    assert counter.count_messages("gpt-4o", fresh(grown)) == reference.count_messages(
        "gpt-4o", fresh(grown)
    )
    # An edited early message must not be served from the earlier list's sum.
    edited = fresh(grown)
    edited[2]["content"] = "a much longer replacement text for this step " * 30
    assert counter.count_messages("gpt-4o", fresh(edited)) == reference.count_messages(
        "gpt-4o", fresh(edited)
    )
    # Nor a shorter list (a prefix of a counted one).
    assert counter.count_messages("gpt-4o", fresh(history[:-3])) == reference.count_messages(
        "gpt-4o", fresh(history[:-3])
    )


def test_key_order_does_not_matter_for_flat_messages(counter: TokenCounter) -> None:
    counter.count_message("gpt-4o", {"role": "user", "content": "same words"})
    calls = counter.encode_calls
    counter.count_message("gpt-4o", {"content": "same words", "role": "user"})
    assert counter.encode_calls == calls


def test_same_content_for_another_encoding_is_counted_again(counter: TokenCounter) -> None:
    message = {"role": "user", "content": "tokenizers differ"}
    counter.count_message("gpt-4o", message)
    calls = counter.encode_calls
    counter.count_message("gpt-4", message)
    assert counter.encode_calls > calls
    calls = counter.encode_calls
    counter.count_message("gpt-4o-2024-08-06", message)  # same profile as gpt-4o: a hit
    assert counter.encode_calls == calls


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (
            {"role": "user", "content": [{"type": "text", "text": "1"}]},
            {"role": "user", "content": [{"type": "text", "text": "2"}]},
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}],
            },
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "f", "arguments": {"x": True}}}],
            },
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}],
            },
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1.0}}}],
            },
        ),
    ],
)
def test_different_content_never_shares_a_count(
    counter: TokenCounter, a: dict[str, Any], b: dict[str, Any]
) -> None:
    counter.count_message("gpt-4o", a)
    calls = counter.encode_calls
    counter.count_message("gpt-4o", b)
    assert counter.encode_calls > calls


def test_memo_is_bounded(make_counter: CounterFactory) -> None:
    counter = make_counter({"memo_max_entries": 10})
    counter.count_messages("gpt-4o", agent_history(20))
    assert len(counter._memo) == 10


def test_big_texts_are_memoized_for_count_text(counter: TokenCounter) -> None:
    text = "a long tool output line\n" * 2000
    first = counter.count_text("gpt-4o", text)
    calls = counter.encode_calls
    assert counter.count_text("gpt-4o", "".join(["a long tool output line\n"] * 2000)) == first
    assert counter.encode_calls == calls
    # and a message carrying that text reuses it
    counter.count_message("gpt-4o", {"role": "tool", "content": text})
    assert counter.encode_calls == calls + 1  # only the role


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Names of the threads that ran the chat formula."""
    seen: set[str] = set()
    real = chat.message_tokens

    def spy(*args: Any) -> int:
        seen.add(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(chat, "message_tokens", spy)
    return seen


async def test_async_count_equals_sync_and_uses_the_pool(
    make_counter: CounterFactory, threads: set[str]
) -> None:
    body = {
        "model": "gpt-4o",
        "messages": agent_history(25),
        "tools": [{"function": {"name": "x"}}],
    }
    pooled = make_counter({"offload_chars": 1000, "threads": 2})
    expected = make_counter().count_request(fresh(body))
    threads.clear()
    assert await pooled.acount_request(fresh(body)) == expected
    assert threads and all(name.startswith("tokens") for name in threads)
    # the second time everything is a memo hit: nothing is computed anywhere
    threads.clear()
    assert await pooled.acount_request(fresh(body)) == expected
    assert not threads


async def test_small_requests_stay_on_the_loop(
    make_counter: CounterFactory, threads: set[str]
) -> None:
    counter = make_counter()  # offload_chars 32768
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    assert await counter.acount_request(body) == 3 + 1 + 1 + 3
    assert threads == {threading.current_thread().name}


async def test_after_close_counting_still_works(make_counter: CounterFactory) -> None:
    counter = make_counter({"offload_chars": 0})
    body = {"model": "gpt-4o", "messages": agent_history(3)}
    expected = counter.count_request(fresh(body))
    counter.close()
    counter.close()
    assert await counter.acount_request(fresh(body)) == expected


def test_a_big_lookup_lets_go_of_the_lock_between_slices() -> None:
    """A worker thread looking up a huge request must not hold the lock the event loop's
    own lookups need for the whole list."""
    from proxy.tokens.memo import Memo

    class CountingLock:
        def __init__(self) -> None:
            self.lock = threading.Lock()
            self.acquired = 0

        def __enter__(self) -> None:
            self.lock.acquire()
            self.acquired += 1

        def __exit__(self, *exc: object) -> None:
            self.lock.release()

    memo = Memo(100)
    lock = CountingLock()
    memo._lock = lock  # type: ignore[assignment]
    memo.put(7, 1)
    found = memo.get_many([7, None, *range(100, 5100)])
    assert found[:2] == [1, None] and len(found) == 5002
    assert lock.acquired >= 1 + 5002 // 1024  # one for put, then many short holds


def test_the_memo_table_is_16_bytes_an_entry_whatever_it_holds() -> None:
    from proxy.tokens.memo import Memo

    memo = Memo(1000)
    assert memo.capacity == 1000
    tables = (memo._keys0, memo._keys1, memo._values0, memo._values1)
    assert sum(t.itemsize * len(t) for t in tables) == 16 * 1000
    for key in range(-5000, 5000, 3):
        memo.put(key * 0x9E3779B97F4A7C15 % (1 << 63), key + 5000)
    assert len(memo) <= memo.capacity
    assert sum(t.itemsize * len(t) for t in tables) == 16 * 1000


def test_keys_sharing_a_slot_never_share_a_count() -> None:
    from proxy.tokens.memo import Memo

    memo = Memo(10)  # 5 sets: 3, 8, 13 and -2 all fall in set 3
    same_set = [3, 8, 13, -2]
    for count, key in enumerate(same_set):
        memo.put(key, count)
    found = memo.get_many(same_set)
    assert found == [None, None, 2, 3]  # the two most recent stay, each with its own count
    assert memo.get(3) is None and memo.get(13) == 2
    memo.put(8, 10)  # 13 was used last: -2 goes
    assert memo.get_many([8, 13, -2]) == [10, 2, None]
    assert memo.get(0) is None  # an empty slot's zero key is no entry
    memo.put(0, 0)
    assert memo.get(0) == 0


def test_a_hit_keeps_an_entry_that_a_newer_one_would_push_out() -> None:
    from proxy.tokens.memo import Memo

    memo = Memo(2)  # one set of two
    memo.put(1, 100)
    memo.put(2, 200)
    assert memo.get(1) == 100  # 1 is now the most recent
    memo.put(3, 300)
    assert memo.get_many([1, 2, 3]) == [100, None, 300]
    assert len(memo) == 2
    memo.clear()
    assert len(memo) == 0 and memo.get(1) is None


def test_a_memo_of_fewer_than_two_entries_is_refused() -> None:
    import pydantic

    from proxy.settings import Settings

    with pytest.raises(pydantic.ValidationError, match="memo_max_entries"):
        Settings.model_validate({"tokenizer": {"memo_max_entries": 1}})


def test_counting_many_messages_at_once_answers_what_one_by_one_does(
    make_counter: CounterFactory,
) -> None:
    history = agent_history(6)
    one_by_one = make_counter()
    expected = [one_by_one.count_message("gpt-4o", m) for m in history]
    counter = make_counter()
    assert counter.count_each("gpt-4o", fresh(history)) == expected  # all counted
    calls = counter.encode_calls
    assert counter.count_each("gpt-4o", fresh(history)) == expected  # all from the memo
    assert counter.encode_calls == calls
    keys = [hash(json.dumps(m)) for m in history]  # the messages' own keys, as spans give
    keys[2] = None  # type: ignore[call-overload]
    assert counter.count_each("gpt-4o", history, keys) == expected
    assert counter.count_each("gpt-4o", history, keys) == expected
    assert [counter.count_message("gpt-4o", m, k) for m, k in zip(history, keys, strict=True)] == (
        expected
    )


_TRICKY = st.sampled_from(
    ["]", "\n", "\r", "/", " ", "  ", "'s", "a", "Z", "9", "漢", "é", "\u0301", "😀", "!", "\t"]
)
_OUTPUT = "def parse(line):\n    return line.split('/')  # 42\n" * 30


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    call_id=st.lists(_TRICKY | st.text(max_size=3), max_size=6).map("".join),
    start=st.lists(_TRICKY, min_size=1, max_size=4).map("".join),
    model=st.sampled_from(["gpt-4o", "gpt-4"]),  # o200k_base, cl100k_base
)
def test_a_tool_result_line_before_a_counted_output_is_counted_exactly(
    counter: TokenCounter, call_id: str, start: str, model: str
) -> None:
    """The summarizer's view of a tool result ("[result of tool call <id>]", a newline, the
    output): its tokens are what the tokenizer says, whatever the id and the output's start."""
    output = start + _OUTPUT
    counter.count_text(model, output)  # as when the tool message was counted
    text = f"[result of tool call {call_id}]\n{output}"
    encoder = counter._profile(model).encoder
    assert encoder is not None
    assert counter.count_text(model, text) == len(encoder.encode_ordinary(text))


def test_a_tool_result_line_does_not_tokenize_its_counted_output_again(
    make_counter: CounterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = make_counter()
    encoder = counter._profile("gpt-4o").encoder
    assert encoder is not None
    encoded: list[str] = []
    real = encoder.encode_ordinary
    monkeypatch.setattr(encoder, "encode_ordinary", lambda t: encoded.append(t) or real(t))
    counter.count_message("gpt-4o", {"role": "tool", "tool_call_id": "c1", "content": _OUTPUT})
    assert _OUTPUT in encoded
    encoded.clear()
    text = f"[result of tool call c1]\n{_OUTPUT}"
    assert counter.count_text("gpt-4o", text) == len(real(text))
    assert encoded == ["[result of tool call c1]\n"]
