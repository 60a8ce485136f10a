"""The hook between a request made for the upstream and its first byte written.

A keyed request's quota charge goes to its ledger (Redis: one round trip) as soon as the
forwarded tokens are known, and the upstream request is made meanwhile; only its write waits
for the verdict. `Clearance` is that verdict as the upstream layer sees it, so the wire
knows nothing of quotas.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol


class Clearance(Protocol):
    """What must clear before a request's first byte goes upstream (a quota charge, already
    on its way to its ledger). Asked as late as the wire allows (`proxy.wire`: with a
    connection in hand, right before the write; httpx's own transport: before it is
    handed the request), so making the request overlaps the wait; if it raises, nothing
    was sent.

    `cleared` answers in the caller's frame when it can: None once the request may go (a
    verdict known at once), else an awaitable of the verdict; either may raise why it may
    not. The caller does `waiting = clearance.cleared()` and awaits `waiting` unless None,
    so a verdict decided at once costs no coroutine on the request's stack."""

    # When it cleared (time.perf_counter()): 0.0 not asked yet, -1.0 asked (or abandoned)
    # and not cleared. The request's upstream time starts here.
    cleared_at: float

    def cleared(self) -> Awaitable[None] | None:
        """None (may go) or the wait for the verdict; raises why it may not. Decides only
        the first time; later calls return None (or raise nothing) at once."""
        ...

    def abandon(self) -> None:
        """The request was given up (cancelled) before `cleared` was called."""
        ...
