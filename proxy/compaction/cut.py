"""Where to cut a history, and which messages the cut must keep verbatim.

Pure: a function of the history's description (proxy/compaction/conversation.py), the
rules and the token counts it is given. What is protected, in order:

1. leading system/developer messages, and context blocks among them (an agent's
   environment or instructions sent as a user item): pinned in place, never summarized (and
   everything up to the last barrier entry, for APIs that have them);
2. the task, the first user message: forwarded verbatim right after the pinned messages
   even when the summary covers it (unless it alone is over `task_max_tokens`: then it is
   summarized like the rest and `Cut.task_summarized` says so);
3. the user's asks: in "carry" mode the latest user message that is a real ask (not one an
   agent injected, not a context block), when the summary covers it, is forwarded verbatim
   right after the summary, and so are older asks the summary covers, newest first, while
   all the carried asks total at most `asks_max_tokens` (what the user said steers the
   work; a summary loses its words). Which asks a summary carries depends only on what it
   covers, so reusing it forwards the same prefix; a summary also keeps carrying the ask it
   carried when it was made (`StoredSummary.carried`). The cut never waits for an ask, so
   it moves forward as the conversation grows. In "pin" mode (the reference-like default of
   the class) the cut stops at the latest user message instead;
4. the tail: the last `max_preserved_messages` user/assistant messages and, with
   `keep_tokens`, as many more recent messages as fit in that many tokens.

The cut never separates a tool call from its results, either way. Everything here is
linear in the number of messages.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from proxy.compaction.conversation import Described
from proxy.report import Message

PINNED_ROLES = frozenset({"system", "developer"})
COUNTED_ROLES = frozenset({"user", "assistant"})
_TAIL_BLOCK = 16  # messages counted at once by the token cut's first step

# The tokens of items[start:end] of the history being cut, one count per item.
CountRange = Callable[[int, int], Sequence[int]]


@dataclass(frozen=True)
class CutRules:
    max_preserved_messages: int = 2
    latest_user: Literal["pin", "carry", "off"] = "pin"
    task_max_tokens: int | None = None  # None: the task is not protected
    # In "carry" mode, older asks are carried too while all carried total at most this.
    asks_max_tokens: int = 0


@dataclass(frozen=True)
class CutPlan:
    """Where `plan_cut` cuts, in absolute positions of the history."""

    start: int  # first non-pinned message
    index: int  # first preserved message (== start: nothing to compact)
    task: int | None
    asks: tuple[int, ...]
    stops: tuple[int, ...]
    task_summarized: bool
    ask_tokens: tuple[int, ...] = ()  # the tokens of each ask (empty: not counted)


@dataclass(frozen=True)
class Cut:
    """Where a history is cut, and which messages survive verbatim around the summary.

    Positions (`task`, `asks`, `stops`) index `rest` = `to_compact + to_preserve`. A summary
    covering `rest[:length]` is forwarded as
    `pinned + [task] + [summary] + [latest ask] + rest[length:]`, where the task and the
    ask appear only when the summary covered them (see `forward`).

    `stops` are the later positions the cut may move forward to when the result is over
    budget (tool pairs intact, at least the minimum tail kept), ascending.
    """

    pinned: list[Message]  # leading system/developer messages, kept in place
    to_compact: list[Message]  # messages[len(pinned):index]
    to_preserve: list[Message]  # messages[index:]
    index: int  # absolute index into the input list of the first preserved message
    task: int | None = None  # the first user message, forwarded verbatim before the summary
    asks: tuple[int, ...] = ()  # user messages that may be carried verbatim after the summary
    stops: tuple[int, ...] = ()
    task_summarized: bool = False  # the first user message exceeded its cap: summarized
    dropped: frozenset[int] = frozenset()  # never shown to a summarizer (reasoning items)
    ask_tokens: tuple[int, ...] = ()  # the tokens of each of `asks` (empty: not counted)
    asks_max_tokens: int = 0  # see CutRules
    # What the summary reads and the store hashes for `rest`, item by item, when an earlier
    # stage changed only the content of some items (masking): their original content.
    source: list[Message] | None = field(default=None, repr=False, compare=False)

    @cached_property
    def rest(self) -> list[Message]:
        return [*self.to_compact, *self.to_preserve]

    @property
    def read(self) -> list[Message]:
        """`rest` as the summary reads it (see `source`)."""
        return self.rest if self.source is None else self.source

    @property
    def length(self) -> int:
        """How many messages of `rest` the cut summarizes."""
        return len(self.to_compact)

    @property
    def latest(self) -> int:
        """The furthest the cut may move forward."""
        return self.stops[-1] if self.stops else self.length

    def readable(self, start: int, end: int) -> list[int]:
        """The positions of rest[start:end] a summarizer reads (not the dropped ones)."""
        return [i for i in range(start, end) if i not in self.dropped]

    def ask_for(self, length: int) -> int | None:
        """The ask a summary of `rest[:length]` carries: the latest real ask, when the
        summary covers it and it is not the task."""
        ask = self.asks[-1] if self.asks else None
        return ask if ask is not None and ask < length and ask != self.task else None

    def carried(
        self, length: int, sticky: int | None = None
    ) -> tuple[list[Message], list[Message]]:
        """The protected messages a summary of `rest[:length]` covers: (before it, after it).

        `sticky`: an ask the same summary carried when it was made (a newer one has come
        since); it stays, so a reused summary forwards the same prefix as before."""
        rest = self.rest
        before = [rest[self.task]] if self.task is not None and self.task < length else []
        carried: set[int | None] = {self.ask_for(length)}
        carried.update(
            carried_asks(self.asks, self.ask_tokens, self.asks_max_tokens, self.task, length)
        )
        if sticky is not None and sticky < length and sticky != self.task:
            carried.add(sticky)
        after = [rest[p] for p in sorted(p for p in carried if p is not None)]
        return before, after

    def forward(
        self, summary: Message, length: int | None = None, sticky: int | None = None
    ) -> list[Message]:
        """The forwarded history for a summary of `rest[:length]` (default: the cut)."""
        length = self.length if length is None else length
        before, after = self.carried(length, sticky)
        return [*self.pinned, *before, summary, *after, *self.rest[length:]]


def cut_messages(
    messages: list[Message],
    described: Described,
    rules: CutRules,
    *,
    keep_tokens: int | None = None,
    count: CountRange | None = None,
    source: list[Message] | None = None,
) -> Cut:
    """`plan_cut` as a `Cut` of `messages` (which `described` describes). `source`: what
    `messages` stand for item by item, for the summary to read (see `Cut.source`)."""
    plan = plan_cut(described, rules, keep_tokens=keep_tokens, count=count)
    start, index = plan.start, plan.index
    pinned = list(messages[:start])
    if index <= start:
        return Cut(pinned, [], list(messages[start:]), start)
    return Cut(
        pinned,
        list(messages[start:index]),
        list(messages[index:]),
        index,
        task=None if plan.task is None else plan.task - start,
        asks=tuple(a - start for a in plan.asks),
        stops=tuple(s - start for s in plan.stops),
        task_summarized=plan.task_summarized,
        ask_tokens=plan.ask_tokens,
        asks_max_tokens=rules.asks_max_tokens,
        dropped=frozenset(
            i - start for i, e in enumerate(described.entries) if i >= start and e.span == "drop"
        )
        if described.dropped
        else frozenset(),
        source=None if source is None else list(source[start:]),
    )


def plan_cut(
    described: Described,
    rules: CutRules,
    *,
    keep_tokens: int | None = None,
    count: CountRange | None = None,
) -> CutPlan:
    """Where to cut (see the module docstring). `count` is needed with `keep_tokens` or a
    `task_max_tokens`; without it a message counts as 1 token."""
    count = count or _one_each
    entries = described.entries
    start = 0
    while start < len(entries) and (entries[start].role in PINNED_ROLES or entries[start].context):
        start += 1
    start = max(start, described.barrier + 1)
    nothing = CutPlan(start, start, None, (), (), False)
    partner = described.partner
    latest = _count_cut(described, start, rules)
    if latest <= start:
        return nothing
    index = latest
    if keep_tokens is not None:
        index = min(index, _token_cut(partner, start, keep_tokens, count))

    # The task is the first user message that is not context; before a barrier it is in
    # place already, and no later message takes its role.
    first = next((u for u in described.users if not entries[u].context), None)
    task, task_summarized = None, False
    if rules.task_max_tokens is not None and first is not None and first >= start:
        if count(first, first + 1)[0] <= rules.task_max_tokens:
            task = first
        else:
            task_summarized = first < index
    asks: tuple[int, ...] = ()
    ask_tokens: tuple[int, ...] = ()
    if rules.latest_user == "carry":
        users = described.users[bisect_left(described.users, start) :]
        asks = tuple(i for i in users if entries[i].ask and not (task_summarized and i == first))
        if rules.asks_max_tokens and len(asks) > 1:
            ask_tokens = tuple(count(a, a + 1)[0] for a in asks)
    stops = _clean_positions(partner, index, latest)
    # A span of nothing but carried messages has nothing to summarize: move on if possible.
    for position in (index, *stops):
        carried = {task, *carried_asks(asks, ask_tokens, rules.asks_max_tokens, task, position)}
        if not all(i in carried for i in range(start, position)):
            later = tuple(s for s in stops if s > position)
            return CutPlan(start, position, task, asks, later, task_summarized, ask_tokens)
    return nothing


def _one_each(start: int, end: int) -> list[int]:
    return [1] * (end - start)


def carried_asks(
    asks: tuple[int, ...],
    tokens: tuple[int, ...],
    limit: int,
    task: int | None,
    length: int,
) -> list[int]:
    """The asks a summary of everything before `length` carries verbatim, ascending: the
    latest ask when it covers it, and older ones it covers, newest first, while all of them
    total at most `limit` tokens (`tokens`: each ask's; empty: only the latest). Asks in the
    tail are verbatim already and not counted."""
    chosen: list[int] = []
    total = 0
    last = len(asks) - 1
    for index in range(last, -1, -1):
        position = asks[index]
        if position >= length or position == task:
            continue
        cost = tokens[index] if tokens else 0
        if index != last and (not tokens or total + cost > limit):
            break
        chosen.append(position)
        total += cost
    chosen.reverse()
    return chosen


def _count_cut(described: Described, start: int, rules: CutRules) -> int:
    """The reference's cut: before the last N user/assistant messages, tool pairs intact."""
    n = rules.max_preserved_messages
    if n <= 0:
        return start
    entries = described.entries
    counted = 0
    cut = start
    for index in range(len(entries) - 1, start - 1, -1):
        if entries[index].role in COUNTED_ROLES:
            counted += 1
            if counted == n:
                cut = index
                break
    if counted < n:
        return start
    if rules.latest_user == "pin" and described.users and described.users[-1] >= start:
        cut = min(cut, described.users[-1])
    return max(start, keep_tool_pairs(described.partner, cut))


def _token_cut(partner: list[int], start: int, keep_tokens: int, count: CountRange) -> int:
    """The earliest clean index whose tail fits in `keep_tokens` (walks the tail only),
    counting blocks of the tail from the end, each twice the last: a few lookups, not one
    a message."""
    used = 0
    end = len(partner)
    index = end
    block = _TAIL_BLOCK
    while index > start:
        first = max(start, index - block)
        counts = count(first, index)
        for tokens in reversed(counts):
            if used + tokens > keep_tokens:
                break
            used += tokens
            index -= 1
        if index > first:  # stopped inside the block
            break
        block *= 2
    # Forward to a clean boundary: fewer tokens, never more.
    low = end
    clean = end
    for position in range(end - 1, index - 1, -1):
        low = min(low, partner[position])
        if low >= position:
            clean = position
    return clean


def clean_lengths(described: Described, start: int) -> frozenset[int]:
    """The lengths k for which a summary of items[start:start + k] leaves every tool pair
    whole (where a stored summary may end and still be used)."""
    return frozenset(p - start for p in _clean_positions(described.partner, start, len(described)))


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


def keep_tool_pairs(partner: list[int], cut: int) -> int:
    """Move `cut` back until no tool result is separated from its call, in either
    direction. Moving back only preserves more, so it never breaks another pair."""
    lo, hi = cut, len(partner)
    while True:
        need = min((partner[j] for j in range(lo, hi)), default=cut)
        if need >= cut:
            return cut
        lo, hi, cut = need, cut, need
