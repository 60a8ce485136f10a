"""Where to cut a history, and which messages the cut must keep verbatim.

Shared by the built-in strategies (a user's strategy may call `cut_history` too). What is
protected, in order:

1. leading system/developer messages: pinned in place, never summarized;
2. the task, the first user message: forwarded verbatim right after the pinned messages
   even when the summary covers it (unless it alone is over `task_max_tokens`: then it is
   summarized like the rest and `Cut.task_summarized` says so);
3. the latest ask: in "carry" mode the latest user message, when the summary covers it, is
   forwarded verbatim right after the summary. The cut never waits for it, so it moves
   forward as the conversation grows. User messages matching one of the `injected`
   patterns (an agent's own "Tool call error: reply with exactly one tool call") are not
   asks: they are summarized like tool output. A summary keeps carrying the ask it carried
   when it was made (`StoredSummary.carried`), so reusing it forwards the same prefix.
   In "pin" mode (the reference-like default of the class) the cut stops at the latest
   user message instead;
4. the tail: the last `max_preserved_messages` user/assistant messages and, with
   `keep_tokens`, as many more recent messages as fit in that many tokens.

The cut never separates an assistant `tool_calls` message from its results, either way.
Everything here is linear in the number of messages.
"""

from __future__ import annotations

import json
import re
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any, Literal

from cachetools import LRUCache

from proxy.compaction.protocol import CountMessage, Cut, Message
from proxy.compaction.render import content_text, message_role
from proxy.jsonspans import key_prefix_digests

PINNED_ROLES = frozenset({"system", "developer"})
COUNTED_ROLES = frozenset({"user", "assistant"})
# Only the start of a user message is matched against the injected patterns.
_MATCH_CHARS = 400
_SEEN_TEXTS = 4096  # injected-pattern answers remembered per rules (~2 MB at most)
_TAIL_BLOCK = 16  # messages counted at once by the token cut's first step

# Messages agents inject themselves when they cannot parse the model's reply.
DEFAULT_INJECTED = (
    r"(?i)^\s*tool call error\b",
    r"(?i)\breply with exactly one tool call\b",
    r"(?i)^\s*your (last |previous )?(reply|response|output|message) (was|is) not "
    r"(correctly |properly )?(formatted|valid|parseable)",
)


@dataclass(frozen=True)
class CutRules:
    max_preserved_messages: int = 2
    latest_user: Literal["pin", "carry", "off"] = "pin"
    task_max_tokens: int | None = None  # None: the task is not protected
    injected: tuple[str, ...] = ()

    # Answers by the text matched: an agent's history asks about the same user messages
    # every turn. Cleared when full (texts are client input).
    _seen: dict[str, bool] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @cached_property
    def _patterns(self) -> list[re.Pattern[str]]:
        return [re.compile(p) for p in self.injected]

    def is_injected(self, message: Message) -> bool:
        if not self.injected:
            return False
        content = message.get("content")
        if isinstance(content, str):  # what content_text would give, without copying it all
            head = content[:_MATCH_CHARS] if content.strip() else ""
        else:
            head = content_text(content)[:_MATCH_CHARS]
        seen = self._seen.get(head)
        if seen is None:
            if len(self._seen) >= _SEEN_TEXTS:
                self._seen.clear()
            seen = self._seen[head] = any(p.search(head) for p in self._patterns)
        return seen


@dataclass(frozen=True)
class CutPlan:
    """`cut_history`'s answer, in absolute indexes of the input list."""

    start: int  # first non-pinned message
    index: int  # first preserved message (== start: nothing to compact)
    task: int | None
    asks: tuple[int, ...]
    stops: tuple[int, ...]
    task_summarized: bool


def cut_messages(
    messages: list[Message],
    rules: CutRules,
    *,
    keep_tokens: int | None = None,
    count: CountMessage | None = None,
    render: Callable[[list[Message]], Message] | None = None,
) -> Cut:
    """`cut_history` as a `Cut`; `render(span)` builds the summarizer's message on demand."""
    plan = cut_history(messages, rules, keep_tokens=keep_tokens, count=count)
    start, index = plan.start, plan.index
    pinned = list(messages[:start])
    if index <= start:
        return Cut(pinned, [], list(messages[start:]), start)
    to_compact = list(messages[start:index])
    return Cut(
        pinned,
        to_compact,
        list(messages[index:]),
        index,
        task=None if plan.task is None else plan.task - start,
        asks=tuple(a - start for a in plan.asks),
        stops=tuple(s - start for s in plan.stops),
        task_summarized=plan.task_summarized,
        render=None if render is None else partial(render, to_compact),
    )


def estimate_message(message: Message) -> int:
    """~4 characters per token of the message's JSON, when no counter is given."""
    return len(json.dumps(message, ensure_ascii=False, default=str)) // 4 + 4


def cut_history(
    messages: Sequence[Message],
    rules: CutRules,
    *,
    keep_tokens: int | None = None,
    count: CountMessage | None = None,
) -> CutPlan:
    count = count or estimate_message
    start = 0
    while start < len(messages) and message_role(messages[start]) in PINNED_ROLES:
        start += 1
    nothing = CutPlan(start, start, None, (), (), False)
    state = pairing_state(messages)
    partner = state.partner
    latest = _count_cut(messages, start, rules, partner)
    if latest <= start:
        return nothing
    index = latest
    if keep_tokens is not None:
        index = min(index, _token_cut(messages, start, keep_tokens, count, partner))

    users = state.users[bisect_left(state.users, start) :]
    task, task_summarized, first = None, False, None
    if rules.task_max_tokens is not None:
        first = users[0] if users else None
        if first is not None:
            if count(messages[first]) <= rules.task_max_tokens:
                task = first
            else:
                task_summarized = first < index
    asks: tuple[int, ...] = ()
    if rules.latest_user == "carry":
        asks = tuple(
            i
            for i in users
            if not rules.is_injected(messages[i]) and not (task_summarized and i == first)
        )
    stops = _clean_positions(partner, index, latest)
    # A span of nothing but carried messages has nothing to summarize: move on if possible.
    for position in (index, *stops):
        if not _only_protected(start, position, task, asks):
            later = tuple(s for s in stops if s > position)
            return CutPlan(start, position, task, asks, later, task_summarized)
    return nothing


def _only_protected(start: int, end: int, task: int | None, asks: tuple[int, ...]) -> bool:
    """Would a summary of messages[start:end] replace nothing but carried messages?

    Stops at the first message that is not carried, so it costs O(1) in practice."""
    carried = {task, asks[-1] if asks and asks[-1] < end else None}
    return all(i in carried for i in range(start, end))


def _is_user(message: Message) -> bool:
    return isinstance(message, dict) and message.get("role") == "user"


def _count_cut(messages: Sequence[Message], start: int, rules: CutRules, partner: list[int]) -> int:
    """The reference's cut: before the last N user/assistant messages, tool pairs intact."""
    n = rules.max_preserved_messages
    if n <= 0:
        return start
    counted = 0
    cut = start
    for index in range(len(messages) - 1, start - 1, -1):
        if message_role(messages[index]) in COUNTED_ROLES:
            counted += 1
            if counted == n:
                cut = index
                break
    if counted < n:
        return start
    if rules.latest_user == "pin":
        for index in range(len(messages) - 1, start - 1, -1):
            if _is_user(messages[index]):
                cut = min(cut, index)
                break
    return max(start, keep_tool_pairs(messages, cut, partner))


def _token_cut(
    messages: Sequence[Message],
    start: int,
    keep_tokens: int,
    count: CountMessage,
    partner: list[int],
) -> int:
    """The earliest clean index whose tail fits in `keep_tokens` (walks the tail only).

    A `count` with an `each` method (a list of counts for a list of messages) is asked for
    blocks of the tail, from the end, each twice the last: a few lookups, not one a message.
    """
    used = 0
    index = len(messages)
    each = getattr(count, "each", None)
    block = _TAIL_BLOCK
    while index > start:
        first = max(start, index - block) if each is not None else index - 1
        counts = each(messages[first:index]) if each is not None else [count(messages[first])]
        for tokens in reversed(counts):
            if used + tokens > keep_tokens:
                break
            used += tokens
            index -= 1
        if index > first:  # stopped inside the block
            break
        block *= 2
    # Forward to a clean boundary: fewer tokens, never more.
    low = len(messages)
    clean = len(messages)
    for position in range(len(messages) - 1, index - 1, -1):
        low = min(low, partner[position])
        if low >= position:
            clean = position
    return clean


def _clean_positions(partner: list[int], first: int, last: int) -> tuple[int, ...]:
    """Positions p in (first, last] where no tool pair crosses, ascending."""
    found: list[int] = []
    low = len(partner)
    for position in range(len(partner) - 1, first, -1):
        low = min(low, partner[position])
        if position <= last and low >= position:
            found.append(position)
    found.reverse()
    return tuple(found)


def keep_tool_pairs(messages: Sequence[Message], cut: int, partner: list[int] | None = None) -> int:
    """Move `cut` back until no tool result is separated from its call, in either direction.

    Pairs are matched by id; a result without an id belongs to the nearest earlier message
    with calls. Moving back only preserves more, so it never breaks another pair.
    """
    partner = partners(messages) if partner is None else partner
    lo, hi = cut, len(messages)
    while True:
        need = min((partner[j] for j in range(lo, hi)), default=cut)
        if need >= cut:
            return cut
        lo, hi, cut = need, cut, need


def partners(messages: Sequence[Message]) -> list[int]:
    """For each message, the lowest index that must stay on its side of any cut.

    A cut at c keeps every pair intact exactly when min(partner[c:]) >= c. One pass with
    no call per ordinary message: it runs on every over-budget turn of a long history.
    Inside `message_keys`, a history that extends a recent one only pairs its new messages:
    appending messages never changes an earlier one's partner. The state comes from the
    holder's `pairing` (the body's spans, which a body extending it inherits) when it is for
    a prefix of these very messages, else from the memo by the messages' byte keys.
    """
    return list(pairing_state(messages).partner)


def pairing_state(messages: Sequence[Message]) -> _Pairing:
    """What `partners` reads (not to be changed): the holder's, the memo's or a cold pass."""
    holder = _HOLDER.get()
    if holder is None or messages is not getattr(holder, "messages", None):
        return _state_of(messages)
    kept = holder.pairing
    if isinstance(kept, _Pairing) and len(kept.partner) <= len(messages):
        state = kept if len(kept.partner) == len(messages) else _pairing(messages, _copy(kept))
    else:
        state = _state_of(messages)
    holder.pairing = state  # read only from here on: extended from copies
    return state


def _state_of(messages: Sequence[Message]) -> _Pairing:
    """The pairing state of `messages` (not to be changed): the memo's by byte keys, when
    known, else a cold pass."""
    keys_for = _KEYS.get()
    keys = keys_for(messages) if keys_for is not None else None
    if keys is None or len(keys) != len(messages) or not messages or None in keys:
        return _pairing(messages, _Pairing([], {}, {}, None, []))
    return _MEMO.state(messages, keys)


def _copy(state: _Pairing) -> _Pairing:
    return _Pairing(
        list(state.partner),
        dict(state.calls_at),
        dict(state.results_at),
        state.last_call,
        list(state.users),
    )


@dataclass
class _Pairing:
    """What pairing messages[:len(partner)] left: enough to pair the messages after them,
    and where their user messages are (the same pass reads each role once, so a turn finds
    the users of its new messages only)."""

    partner: list[int]
    calls_at: dict[str, int]  # call id -> its message
    results_at: dict[str, int]  # result id -> its first message
    last_call: int | None
    users: list[int]  # positions of the user messages, ascending


def _pairing(messages: Sequence[Message], state: _Pairing) -> _Pairing:
    """`state` (a copy: it is changed) carried on over the messages after it."""
    calls_at, results_at, last_call = state.calls_at, state.results_at, state.last_call
    start = len(state.partner)
    call_ids: dict[int, list[str]] = {}  # only the messages that have calls
    partner, users = state.partner, state.users
    partner += range(start, len(messages))
    for index in range(start, len(messages)):
        message = messages[index]
        if type(message) is not dict:
            if isinstance(message, dict) and message.get("role") == "user":
                users.append(index)
            continue
        role = message.get("role")
        if role == "user":
            users.append(index)
        calls = message.get("tool_calls")
        if calls:
            ids = (
                [
                    c["id"]
                    for c in calls
                    if isinstance(c, dict) and isinstance(c.get("id"), str) and c["id"]
                ]
                if isinstance(calls, list)
                else []
            )
            if ids:
                call_ids[index] = ids
                for call_id in ids:
                    calls_at[call_id] = index
                last_call = index
        if "function_call" in message and isinstance(message["function_call"], dict):
            last_call = index
        if role != "tool" and role != "function":
            continue
        result_id = message.get("tool_call_id") if role == "tool" else None
        if isinstance(result_id, str) and result_id:
            results_at.setdefault(result_id, index)
            if result_id in calls_at:
                partner[index] = calls_at[result_id]
        elif last_call is not None:
            partner[index] = last_call
    # An earlier call's partner is final: a later result of it is never below it.
    for index, ids in call_ids.items():
        found = [results_at[i] for i in ids if i in results_at]
        partner[index] = min([partner[index], *found])
    state.last_call = last_call
    return state


_KEYS: ContextVar[Callable[[Sequence[Message]], Sequence[int | None]] | None] = ContextVar(
    "cut_message_keys", default=None
)
_HOLDER: ContextVar[Any] = ContextVar("cut_pairing_holder", default=None)


@contextmanager
def message_keys(
    keys_for: Callable[[Sequence[Message]], Sequence[int | None]] | None,
    holder: Any = None,
) -> Iterator[None]:
    """Within: `keys_for(messages)` gives each message's byte key (None: not known), so the
    pairing of a history that extends a recent one is reused (`PairingMemo`); `holder` (the
    body's spans: `messages` and a `pairing` attribute) keeps the pairing of its messages."""
    token, held = _KEYS.set(keys_for), _HOLDER.set(holder)
    try:
        yield
    finally:
        _HOLDER.reset(held)
        _KEYS.reset(token)


# Messages whose pairing state is remembered (~50 bytes each with the ids: a few MB).
MEMO_MESSAGES = 65_536
_LOOKBACK = 8  # a turn adds at most this many messages to the history the previous one sent


class PairingMemo:
    """The pairing state of recent histories by a digest of their messages' byte keys; the
    entry a history extends is dropped, so a session holds one. Bounded by messages; safe
    across threads."""

    def __init__(self, max_messages: int = MEMO_MESSAGES) -> None:
        self._cache: LRUCache[bytes, _Pairing] = LRUCache(
            maxsize=max_messages, getsizeof=lambda state: len(state.partner) or 1
        )
        self._lock = threading.Lock()

    def state(self, messages: Sequence[Message], keys: Sequence[int | None]) -> _Pairing:
        """The pairing state of `messages`, shared with the memo: not to be changed."""
        digests = key_prefix_digests(keys, min(_LOOKBACK, len(keys)), b"", b"cp-pairing")
        with self._lock:
            found = next(
                (
                    (drop, state)
                    for drop, d in enumerate(digests)
                    if (state := self._cache.get(d)) is not None
                ),
                None,
            )
        if found is not None and found[0] == 0:
            return found[1]
        state = _Pairing([], {}, {}, None, []) if found is None else _copy(found[1])
        state = _pairing(messages, state)
        if len(messages) <= self._cache.maxsize:
            with self._lock:
                if found is not None:
                    self._cache.pop(digests[found[0]], None)
                self._cache[digests[0]] = state
        return state

    def __len__(self) -> int:
        return len(self._cache)


_MEMO = PairingMemo()
