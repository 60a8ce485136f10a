"""Stop waiting on the upstream (or a summarizer) when the client has gone away.

Starlette only notices a disconnect while it streams a response. Before that, while we wait
for the upstream's first byte (which for an LLM can take minutes), nothing would, and the
upstream would keep generating tokens nobody reads.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.types import Receive

from proxy.errors import ClientDisconnected

T = TypeVar("T")


async def cancel_on_disconnect(receive: Receive, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work()`; if the client disconnects first, cancel it and raise ClientDisconnected.

    Call only after the request body has been read: from then on the only message `receive`
    can deliver is `http.disconnect`.
    """
    result: list[T] = []
    error: BaseException | None = None

    async with anyio.create_task_group() as group:

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    group.cancel_scope.cancel()
                    return

        group.start_soon(watch)
        try:
            result.append(await work())
        except Exception as exc:  # re-raised below, unwrapped from the task group
            error = exc
        group.cancel_scope.cancel()

    if error is not None:
        raise error

    if result:  # finished first (or at the same moment): the relay will notice the disconnect
        return result[0]
    raise ClientDisconnected()
