"""The proxy's cut rules (carry mode, task, token-aware tail) over random agent histories."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from test_compaction_better import agent_histories

from proxy.compaction.cut import (
    DEFAULT_INJECTED,
    CutRules,
    PairingMemo,
    cut_messages,
    estimate_message,
    message_keys,
    pairing_state,
    partners,
)
from proxy.compaction.protocol import Message


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
    rules = CutRules(n, "carry", task_cap, DEFAULT_INJECTED)
    cut = cut_messages(history, rules, keep_tokens=keep)
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


def _content_keys(messages: Sequence[Message]) -> list[int | None]:
    """Stand-in for the body parser's byte keys: equal messages, equal key."""
    return [hash(json.dumps(m, sort_keys=True)) for m in messages]


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
def test_pairing_of_a_growing_history_equals_pairing_it_whole(
    history: list[Message], extra: int
) -> None:
    """Turn by turn (1 to 8 new messages each) the remembered pairing is extended, and
    every turn's partners are those of a pass over the whole history."""
    history = history + ODD_PAIRS[:extra]
    memo = PairingMemo()
    length = 0
    while length < len(history):
        length = min(len(history), length + 1 + length % 8)
        turn = copy.deepcopy(history[:length])  # new objects each turn, as parsed
        assert memo.state(turn, _content_keys(turn)).partner == partners(turn)
        with message_keys(_content_keys):  # the same through cut_history's entry point
            assert partners(turn) == memo.state(turn, _content_keys(turn)).partner


def test_pairing_memo_is_bounded_by_messages() -> None:
    memo = PairingMemo(max_messages=100)
    for session in range(50):
        turn: list[Message] = [{"role": "user", "content": f"{session} {i}"} for i in range(30)]
        memo.state(turn, _content_keys(turn))
    assert 1 <= len(memo) <= 100 // 30


class _Holder:
    """What the body's spans offer the cut: the message list and a pairing slot."""

    def __init__(self, messages: list[Message], pairing: object = None) -> None:
        self.messages = messages
        self.pairing = pairing


@settings(max_examples=100, deadline=None)
@given(history=agent_histories(), extra=st.integers(0, len(ODD_PAIRS)))
def test_pairing_kept_on_the_body_equals_pairing_it_whole(
    history: list[Message], extra: int
) -> None:
    """Each turn's body inherits the pairing its previous one kept (as an extended body's
    spans do) and pairs only its new messages: the partners equal a cold pass, and a caller
    changing the list it got changes nothing later turns see."""
    history = history + ODD_PAIRS[:extra]
    kept: object = None
    length = 0
    while length < len(history):
        length = min(len(history), length + 1 + length % 8)
        turn = copy.deepcopy(history[:length])
        holder = _Holder(turn, kept)
        with message_keys(_content_keys, holder):
            got = partners(turn)
            again = partners(turn)  # the body's own, kept
        assert got == partners(copy.deepcopy(turn)) == again
        assert holder.pairing is not None
        users = [i for i, m in enumerate(turn) if m.get("role") == "user"]
        with message_keys(_content_keys, holder):
            assert pairing_state(turn).users == users  # only the new messages' looked at
        got[:] = [-1] * len(got)
        with message_keys(None, holder):
            assert partners(turn) == again
        assert partners(turn) == again  # no holder: the memo, not the body's
        kept = holder.pairing
    other = _Holder(copy.deepcopy(history), kept)
    with message_keys(_content_keys, other):
        assert partners(history) == partners(copy.deepcopy(history))  # another list: not kept
    assert other.pairing is kept


class _Counts:
    """A count that can also count many at once, as the compactor's is."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, message: Message) -> int:
        self.calls += 1
        return estimate_message(message)

    def each(self, messages: Sequence[Message]) -> list[int]:
        self.calls += 1
        return [estimate_message(m) for m in messages]


@settings(max_examples=200, deadline=None)
@given(history=agent_histories(), keep=st.integers(0, 2000), n=st.integers(1, 4))
def test_the_token_cut_counted_in_blocks_cuts_where_one_by_one_does(
    history: list[Message], keep: int, n: int
) -> None:
    rules = CutRules(n, "carry", 40, DEFAULT_INJECTED)
    counts = _Counts()
    by_blocks = cut_messages(history, rules, keep_tokens=keep, count=counts)
    one_by_one = cut_messages(history, rules, keep_tokens=keep, count=estimate_message)
    assert (by_blocks.index, by_blocks.stops, by_blocks.task, by_blocks.asks) == (
        one_by_one.index,
        one_by_one.stops,
        one_by_one.task,
        one_by_one.asks,
    )
    # a handful of calls for the tail: the first block, doubled each time (and the task)
    assert counts.calls <= 2 + max(1, len(history)).bit_length()
