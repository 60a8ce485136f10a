"""The hook between a request made for the upstream and its first byte written.

A keyed request's quota charge goes to its ledger (Redis: one round trip) as soon as the
forwarded tokens are known, and the upstream request is made meanwhile; only its write waits
for the verdict. `Clearance` is that verdict as the upstream layer sees it, so the wire
knows nothing of quotas.
"""

from __future__ import annotations

from typing import Protocol


class Clearance(Protocol):
    """What must clear before a request's first byte goes upstream (a quota charge, already
    on its way to its ledger). Waited for as late as the wire allows (`proxy.wire`: with a
    connection in hand, right before the write; httpx's own transport: before it is
    handed the request), so making the request overlaps the wait; if it raises, nothing
    was sent."""

    async def cleared(self) -> None:
        """Returns once the request may go; raises why it may not. Waits only the first
        time; later calls return (or raise nothing) at once."""
        ...

    def abandon(self) -> None:
        """The request was given up (cancelled) before `cleared` was called."""
        ...
