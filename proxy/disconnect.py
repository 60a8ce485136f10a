"""Stop waiting on the upstream (or a summarizer) when the client has gone away.

Starlette only notices a disconnect while it streams a response. Before that, while we wait
for the upstream's first byte (which for an LLM can take minutes), nothing would, and the
upstream would keep generating tokens nobody reads.

A `DisconnectWatch` is one pending `receive()` per request, started the first time the request
waits on someone else and kept until the request is answered: the wait for the upstream's
headers, the read of a small reply and the relay of a stream all run under the same watcher.
When `receive()` reports the disconnect, the task doing the work is cancelled (plain asyncio:
one task and a done-callback, no task group or cancel scope on the request path).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.types import Receive

from proxy.errors import ClientDisconnected

T = TypeVar("T")


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class DisconnectWatch:
    """Runs pieces of a request's work, each cancelled if the client disconnects meanwhile.

    Use only after the request body has been read: from then on the only message `receive`
    can deliver is `http.disconnect`. Call `close()` once the request needs no more watching
    (the watcher task is cancelled; nothing is awaited).
    """

    __slots__ = ("_cancelled", "_gone", "_receive", "_watcher", "_working")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._watcher: asyncio.Task[None] | None = None
        self._working: asyncio.Task[object] | None = None  # the task inside `run`, if any
        self._cancelled = False  # we cancelled `_working` and have not taken it back yet
        self._gone = False

    @property
    def gone(self) -> bool:
        """The client has been seen to disconnect."""
        return self._gone

    async def run(self, work: Callable[[], Awaitable[T]]) -> T:
        """`await work()`; if the client disconnects first, cancel it and raise ClientDisconnected.

        A disconnect seen at the moment `work()` finishes lets its result through (whoever
        answers next notices the client is gone). A cancellation from outside stays one.
        """
        if self._gone:
            raise ClientDisconnected()
        if self._watcher is None:
            watcher = self._watcher = asyncio.ensure_future(_until_disconnect(self._receive))
            watcher.add_done_callback(self._seen)
        task = asyncio.current_task()
        assert task is not None
        self._working = task
        try:
            return await work()
        except asyncio.CancelledError:
            if self._cancelled:
                self._cancelled = False
                if task.uncancel() == 0:  # ours alone: the client left
                    raise ClientDisconnected() from None
            raise
        finally:
            self._working = None
            if self._cancelled:  # cancelled, but `work` swallowed it: take ours back
                self._cancelled = False
                task.uncancel()

    def _seen(self, watcher: asyncio.Task[None]) -> None:
        if watcher.cancelled() or watcher.exception() is not None:
            return
        self._gone = True
        working = self._working
        if working is not None and not self._cancelled:
            self._cancelled = True
            working.cancel()

    def close(self) -> None:
        """Stop watching (idempotent); a later `run` starts a new watcher."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None and not watcher.done():
            watcher.remove_done_callback(self._seen)
            watcher.cancel()
