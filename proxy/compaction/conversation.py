"""The conversation as the compaction core sees it, whatever API it came from.

An API adapter (a `Format`: proxy/compaction/chat_format.py for chat completions,
proxy/compaction/responses_format.py for the Responses API's `input` items) describes
each item of a request's history as an `Entry`: its role, the tool calls it makes and the
one it answers, whether it is a real ask, and how a compacted span treats it. The cut,
masking and the planner read only entries and positions, so a second API (the Responses
API's items: `function_call` / `function_call_output` linked by `call_id`, `reasoning`,
`compaction`, ...) is one adapter, not a second core.

`describe` pairs results with calls once per history and extends an earlier description
of a prefix (a session's previous turn, kept in its SessionCache) with only the new items.

What the Responses API's adapter says, in short: a `message` item
has its `role` (a user message that is an `<environment_context>` block is `context`, never
the task nor an ask); `function_call`, `custom_tool_call`, `local_shell_call` and any other
`*_call` make the call `call_id`, and each `*_call_output` answers it; `reasoning` is
`drop` (kept whole in the tail, never shown to a summarizer); `compaction` items and
`item_reference`s are barriers (nothing before them is compacted again, nothing is split
from what they precede); an unknown type is a barrier too, so it is never dropped. Its
`masked` replaces an output's `output`; a summarizing strategy renders items through
proxy/compaction/render.py, which reads chat messages: an adapter gives it the items'
text the same way (a message's parts, a call's name and arguments).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from proxy.report import Message

# How a compacted span treats an entry: summarized with the rest; dropped (never shown to a
# summarizer: reasoning; and never separated from the entry after it, the output it led to,
# which an API may refuse to see without it); or a barrier, never inside a compacted span
# (the history up to the last barrier stays in place, like the pinned system messages).
SpanRule = Literal["summarize", "drop", "barrier"]


@dataclass(frozen=True, slots=True)
class Entry:
    """One item of a history, as the cut needs it."""

    role: str  # system, developer, user, assistant, tool, function, or the adapter's own
    calls: tuple[str, ...] = ()  # the ids of the tool calls it makes ("": a call without id)
    result_of: str | None = None  # a tool result: the call id it answers ("": none given)
    ask: bool = False  # a user message the model must read verbatim (not an injected one)
    context: bool = False  # a user item carrying environment context: never the task
    span: SpanRule = "summarize"


class Format(Protocol):
    """An API adapter: how the core reads and writes that API's history items."""

    @property
    def key(self) -> str:
        """Names the adapter and whatever shapes its entries (a description made under
        another key is not reused)."""
        ...

    def entry(self, item: Message) -> Entry: ...

    def masked(self, item: Message, stub: str) -> Message:
        """`item`, a tool result, with its output replaced by `stub` (every other field kept)."""
        ...

    def output_chars(self, item: Message) -> int:
        """The size of a tool result's output, in characters."""
        ...

    def call_of(self, item: Message, call_id: str, index: int) -> tuple[str, str]:
        """(tool name, arguments) of the call `item` makes under `call_id` ("" : the
        `index`-th call it makes), for a stub that names it."""
        ...


@dataclass(frozen=True)
class Described:
    """The entries of a history and what pairing them found.

    `partner[i]` is the lowest position that must stay on the same side of any cut as i:
    a tool result's call, or the dropped entry right before i, else i itself. A cut at c
    keeps every pair intact exactly when min(partner[c:]) >= c. Read only: `extended`
    builds a new one from copies.
    """

    key: str
    entries: list[Entry]
    partner: list[int]
    call_of: list[int]  # for a tool result, the position of the call it answers; else -1
    result_index: list[int]  # for a result without id, which of its call's calls (by order)
    users: list[int]  # positions of user entries, ascending
    barrier: int = -1  # position of the last barrier entry (-1: none)
    dropped: int = 0  # how many entries a summarizer never reads
    # What pairing the items after these needs: the latest position making each call id,
    # the latest position making any call and how many results without id followed it,
    # and results naming a call none of these made (a later call of that id binds them).
    open_calls: dict[str, int] = field(default_factory=dict)
    last_call: int = -1
    answered: int = 0
    pending: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.entries)

    def extended(self, entries: Sequence[Entry]) -> Described:
        """This description carried on over `entries`, the items that follow."""
        if not entries:
            return self
        partner, call_of, result_index = (
            list(self.partner),
            list(self.call_of),
            list(self.result_index),
        )
        users, open_calls = list(self.users), dict(self.open_calls)
        pending = dict(self.pending)
        last_call, answered, barrier = self.last_call, self.answered, self.barrier
        dropped = self.dropped
        after_drop = bool(self.entries) and self.entries[-1].span == "drop"
        for index, entry in enumerate(entries, len(self.entries)):
            # An entry right after a dropped one (reasoning) stays on its side of any cut.
            partner.append(index - 1 if after_drop else index)
            after_drop = entry.span == "drop"
            call_of.append(-1)
            result_index.append(0)
            if entry.role == "user":
                users.append(index)
            if entry.span == "barrier":
                barrier = index
            elif entry.span == "drop":
                dropped += 1
            if entry.calls:
                for call_id in entry.calls:
                    if call_id:
                        open_calls[call_id] = index
                        if call_id in pending:  # its result came first: keep them together
                            partner[index] = min(partner[index], pending.pop(call_id))
                last_call, answered = index, 0
            result_of = entry.result_of
            if result_of is None:
                continue
            if result_of:
                # The nearest earlier item making a call of that id (some agents reuse ids:
                # `call_0` every turn), else a later one.
                call = open_calls.get(result_of, -1)
                if call < 0:
                    pending.setdefault(result_of, index)
            else:  # no id: by position, the nearest earlier item making any call
                call = last_call
                result_index[index] = answered
                answered += 1
            if call >= 0:
                partner[index] = min(partner[index], call)
                call_of[index] = call
        return Described(
            self.key,
            [*self.entries, *entries],
            partner,
            call_of,
            result_index,
            users,
            barrier,
            dropped,
            open_calls,
            last_call,
            answered,
            pending,
        )


def describe(format: Format, items: Sequence[Message], known: Described | None = None) -> Described:
    """The description of `items`; `known` (a description of a prefix of these very items,
    say the session's previous turn) is extended with the rest."""
    if known is None or known.key != format.key or len(known) > len(items):
        known = Described(format.key, [], [], [], [], [])
    entry = format.entry
    return known.extended([entry(item) for item in items[len(known) :]])


def broken_pairs(described: Described) -> int:
    """Tool results with no call before them plus calls (with ids) no result answers:
    what a provider rejects. For a strategy's output, compared with its input's."""
    entries = described.entries
    orphans = sum(
        1
        for i, call in enumerate(described.call_of)
        if call < 0 and entries[i].result_of is not None
    )
    answered = {
        (described.call_of[i], entry.result_of)
        for i, entry in enumerate(described.entries)
        if entry.result_of and described.call_of[i] >= 0
    }
    unanswered = sum(
        1
        for i, entry in enumerate(described.entries)
        for call_id in entry.calls
        if call_id and (i, call_id) not in answered
    )
    return orphans + unanswered
