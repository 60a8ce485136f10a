"""The proxy's cut rules (carry mode, task, token-aware tail) over random agent histories."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st
from test_compaction_better import agent_histories

from proxy.compaction.cut import DEFAULT_INJECTED, CutRules, cut_messages, estimate_message
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
