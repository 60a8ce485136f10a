"""What the compaction step derives from a session's history, kept for its next turn.

An agent resends its whole history every turn plus a message or two. Three things the
compaction step derives from a history depend only on its messages' bytes, message by
message: each message's token count, the summary store's chain of prefix hashes, and the
conversation's structure (roles, which tool result answers which call). A body that extends
one seen before starts with the same messages, so it starts with the same derived values and
only its new messages need work.

One `SessionCache` per parsed body holds all three, and one thing that is the session's
rather than the body's: the summary being made ahead of need for it (`Ahead`), shared by
every later turn's cache so that the turns between its start and the budget start no other.

The turn memo (proxy/turnmemo.py) keeps the body, and with it this cache; a body parsed as
the extension of a kept one gets `kept.extended()`. The compaction step reads and fills it
through the argument it is given, never through globals. Nothing in it is changed in place
once another body may share it: each value is replaced by a longer one, built from a copy
(`Ahead` aside: its one flag is meant for every turn that shares it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Count profiles (encodings) whose counts a body keeps, and chain roots (store namespaces):
# one per profile or namespace in use; the oldest goes when a third comes.
MAX_PROFILES = 2
MAX_CHAINS = 2


@dataclass(eq=False)
class Ahead:
    """A summary started ahead of need for a session (proxy/compactor.py). `basis`: the
    messages the summary its request was forwarded with stands for (0: none); `live`
    turns False when the preparation came to nothing, so a later turn may start one."""

    basis: int
    live: bool = True


@dataclass(eq=False)
class SessionCache:
    """See the module docstring. Bounded by the body's messages (a few ints and a 32-byte
    link per message, per profile and namespace in use)."""

    # The token count of each message, by the counter's profile (its encoding).
    counts: dict[str, list[int]] = field(default_factory=dict)
    # The store's chain (proxy/store/chain.py) of a run of the body's messages, by (chain
    # root, the run's first message): the links as one bytes object, and the hex keys.
    chains: dict[tuple[bytes, int], tuple[bytes, list[str]]] = field(default_factory=dict)
    # The conversation's structure (proxy.compaction.conversation.Described) of a prefix of
    # the body's messages, for the adapter that described it.
    described: object | None = None
    # The session's latest summary started ahead of need (the same object in every later
    # turn's cache).
    ahead: Ahead | None = None

    def extended(self) -> SessionCache:
        """The cache of a body that starts with this body's messages."""
        return SessionCache(dict(self.counts), dict(self.chains), self.described, self.ahead)

    def keep_counts(self, profile: str, counts: list[int]) -> None:
        if profile not in self.counts and len(self.counts) >= MAX_PROFILES:
            self.counts.pop(next(iter(self.counts)), None)
        self.counts[profile] = counts

    def keep_chain(self, key: tuple[bytes, int], links: bytes, hexed: list[str]) -> None:
        if key not in self.chains and len(self.chains) >= MAX_CHAINS:
            self.chains.pop(next(iter(self.chains)), None)
        self.chains[key] = (links, hexed)
