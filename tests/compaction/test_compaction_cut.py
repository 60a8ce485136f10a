"""The proxy's cut rules (carry mode, task, token-aware tail) over random agent histories."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st
from test_compaction_better import agent_histories

from proxy.compaction.chat_format import DEFAULT_INJECTED, ChatFormat
from proxy.compaction.conversation import describe
from proxy.compaction.cut import Cut, CutRules, cut_messages
from proxy.compaction.protocol import Message

FORMAT = ChatFormat(DEFAULT_INJECTED)


def estimate_message(message: Message) -> int:
    return len(json.dumps(message)) // 4 + 4


def counting(
    history: list[Message], count: Callable[[Message], int] = estimate_message
) -> Callable[[int, int], list[int]]:
    return lambda start, end: [count(m) for m in history[start:end]]


def cut_of(history: list[Message], rules: CutRules, keep: int | None = None) -> Cut:
    return cut_messages(
        history, describe(FORMAT, history), rules, keep_tokens=keep, count=counting(history)
    )


def pairs_intact(head: list[Message], tail: list[Message]) -> bool:
    head_calls = {c["id"] for m in head for c in m.get("tool_calls") or []}
    tail_calls = {c["id"] for m in tail for c in m.get("tool_calls") or []}
    return all(m["tool_call_id"] in tail_calls for m in tail if m["role"] == "tool") and all(
        m["tool_call_id"] in head_calls for m in head if m["role"] == "tool"
    )


@settings(max_examples=300, deadline=None)
@given(
    history=agent_histories(),
    n=st.integers(1, 4),
    keep=st.one_of(st.none(), st.integers(0, 400)),
    task_cap=st.one_of(st.none(), st.integers(1, 50)),
)
def test_carry_mode_cut_invariants(
    history: list[Message], n: int, keep: int | None, task_cap: int | None
) -> None:
    before = copy.deepcopy(history)
    rules = CutRules(n, "carry", task_cap)
    cut = cut_of(history, rules, keep)
    assert history == before
    rest = cut.rest
    assert cut.pinned + rest == history
    if not cut.to_compact:
        return
    for length in (cut.length, *cut.stops):  # every place the cut may move to
        head, tail = rest[:length], rest[length:]
        assert pairs_intact(head, tail)
        assert sum(m["role"] in ("user", "assistant") for m in tail) >= n
    assert list(cut.stops) == sorted(set(cut.stops)) and all(s > cut.length for s in cut.stops)
    if keep is not None and cut.length > 0:
        # The tail is no more than `keep` tokens, unless the minimum tail alone is more.
        tail_tokens = sum(estimate_message(m) for m in rest[cut.length :])
        assert tail_tokens <= keep or not cut.stops
    users = [i for i, m in enumerate(rest) if m["role"] == "user"]
    if users and cut.task is not None:
        assert cut.task == users[0]
    # A summary never stands for nothing but the messages forwarded verbatim next to it.
    before_summary, after_summary = cut.carried(cut.length)
    assert len(before_summary) + len(after_summary) < cut.length
    over_cap_task = cut.task_summarized and users and users[-1] == users[0]
    if users and users[-1] < cut.length and users[-1] != cut.task and not over_cap_task:
        assert after_summary == [rest[users[-1]]]  # the latest ask, verbatim


ODD_PAIRS: list[Message] = [
    {"role": "system", "content": "s"},
    {"role": "tool", "tool_call_id": "late", "content": "result before its call"},
    {"role": "assistant", "tool_calls": [{"id": "a", "type": "function"}, {"id": "b"}]},
    {"role": "tool", "tool_call_id": "b", "content": "b"},
    {"role": "tool", "content": "no id: the nearest earlier call"},
    {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
    {"role": "function", "name": "f", "content": "f"},
    {"role": "assistant", "tool_calls": [{"id": "late"}, {"id": "c"}]},
    {"role": "tool", "tool_call_id": "a", "content": "a, long after"},
    {"role": "tool", "tool_call_id": "b", "content": "b again"},
    {"role": "user", "content": "u"},
    {"role": "tool", "tool_call_id": "c", "content": "c"},
]


@settings(max_examples=100, deadline=None)
@given(history=agent_histories(), extra=st.integers(0, len(ODD_PAIRS)))
def test_describing_a_growing_history_equals_describing_it_whole(
    history: list[Message], extra: int
) -> None:
    """Turn by turn (1 to 8 new messages each) the previous turn's description is extended
    with the new messages only: each equals a cold pass, and extending never changes the
    description it started from (another body of the session may still read it)."""
    history = history + ODD_PAIRS[:extra]
    kept = None
    length = 0
    while length < len(history):
        length = min(len(history), length + 1 + length % 8)
        turn = copy.deepcopy(history[:length])  # new objects each turn, as parsed
        before = None if kept is None else copy.deepcopy(kept)
        extended = describe(FORMAT, turn, kept)
        assert extended == describe(FORMAT, copy.deepcopy(turn))
        assert kept == before
        kept = extended


def test_odd_pairs_stay_together() -> None:
    described = describe(FORMAT, ODD_PAIRS)
    partner = described.partner
    assert partner[7] == 1  # a call whose result came first is bound to it
    assert partner[4] == 2  # no id: the nearest earlier call
    assert partner[6] == 5  # legacy function result: its function_call
    assert partner[8] == 2 and partner[9] == 2  # the nearest earlier call of that id
    assert partner[11] == 7


class _Counts:
    """Counts of a range of the history, recording how often it is asked."""

    def __init__(self, history: list[Message]) -> None:
        self.history = history
        self.calls = 0

    def __call__(self, start: int, end: int) -> list[int]:
        self.calls += 1
        return [estimate_message(m) for m in self.history[start:end]]


@settings(max_examples=200, deadline=None)
@given(history=agent_histories(), keep=st.integers(0, 2000), n=st.integers(1, 4))
def test_the_token_cut_counted_in_blocks_cuts_where_one_by_one_does(
    history: list[Message], keep: int, n: int
) -> None:
    rules = CutRules(n, "carry", 40)
    counts = _Counts(history)
    described = describe(FORMAT, history)
    by_blocks = cut_messages(history, described, rules, keep_tokens=keep, count=counts)

    def one_at_a_time(start: int, end: int) -> list[int]:
        return [estimate_message(m) for m in history[start:end]]

    one = cut_messages(history, described, rules, keep_tokens=keep, count=one_at_a_time)
    assert (by_blocks.index, by_blocks.stops, by_blocks.task, by_blocks.asks) == (
        one.index,
        one.stops,
        one.task,
        one.asks,
    )
    # a handful of calls for the tail: the first block, doubled each time (and the task)
    assert counts.calls <= 2 + max(1, len(history)).bit_length()
