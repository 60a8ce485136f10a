"""Single flight: concurrent requests that need the same summary pay for one summarizer call.

Two layers:

- `SingleFlight` (in-process, any result type): the first caller of a key starts the work as
  a shared task; later callers of that key await the same task. A waiter that is cancelled
  (its client disconnected) just stops waiting; the shared task is cancelled only when its
  last waiter is gone. Entries leave the table as soon as the task is done, so the table
  holds only work in progress and a failure is never cached.
- `SummaryFlight` (what the planner uses): a `SingleFlight` keyed by prefix key, whose shared
  task finds-or-makes a `StoredSummary` and puts it in the store. With a shared store
  (Redis) it also coordinates replicas: the replica that takes the key's lock (SET NX PX
  lock_ttl_s) makes the summary, stores it and releases the lock; the others poll the store
  with backoff until the entry appears, and take over if the lock is released or expires
  without an entry (holder failed or died). With the store down, every replica makes its own.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar, cast

from proxy.store.protocol import StoredSummary
from proxy.store.store import SummaryStore

log = logging.getLogger(__name__)
T = TypeVar("T")


class _Call:
    __slots__ = ("task", "waiters")

    def __init__(self, task: asyncio.Future[Any]) -> None:
        self.task = task
        self.waiters = 0


class SingleFlight:
    """In-process deduplication of concurrent calls by key (see the module docstring)."""

    def __init__(self) -> None:
        self._calls: dict[str, _Call] = {}
        # Every started task until it is done, including cancelled ones still unwinding.
        self._running: set[asyncio.Future[Any]] = set()

    def __len__(self) -> int:
        """Calls a new caller could join."""
        return len(self._calls)

    async def join(self) -> None:
        """Wait until every started call is done, cancelled ones included (shutdown, tests)."""
        while self._running:
            await asyncio.wait(list(self._running))

    def waiting(self) -> int:
        """Callers waiting on any key (observability, tests)."""
        return sum(call.waiters for call in self._calls.values())

    def waiters(self, key: str) -> int:
        call = self._calls.get(key)
        return 0 if call is None else call.waiters

    async def run(self, key: str, make: Callable[[], Awaitable[T]]) -> T:
        """The result of `make()`, started by the first caller of `key` and shared by all."""
        call = self._calls.get(key)
        if call is None or call.task.done():
            call = _Call(asyncio.ensure_future(make()))
            self._calls[key] = call
            self._running.add(call.task)
            call.task.add_done_callback(partial(self._finished, key, call))
        call.waiters += 1
        try:
            # shield: cancelling this waiter must not cancel the shared task.
            return cast(T, await asyncio.shield(call.task))
        finally:
            call.waiters -= 1
            if call.waiters == 0 and not call.task.done():
                # Nobody wants the result any more. Forget it first, so a caller arriving
                # while the cancellation unwinds starts fresh instead of joining a dying task.
                self._forget(key, call)
                call.task.cancel()

    def _forget(self, key: str, call: _Call) -> None:
        if self._calls.get(key) is call:
            del self._calls[key]

    def _finished(self, key: str, call: _Call, task: asyncio.Future[Any]) -> None:
        self._forget(key, call)
        self._running.discard(task)
        if not task.cancelled():
            task.exception()  # mark retrieved: waiters that left must not cause a loop warning


class SummaryFlight:
    """Find-or-make a summary once per key, across tasks and (with a shared store) replicas.

    `make` must return the summary for exactly the prefix `key` names; `run` stores it, so
    the caller does not `put` it again. With a store shared by replicas (`store.shared`),
    the key's lock says which replica makes it. Polling is injectable: `sleep(seconds)` and
    `clock()`.
    """

    def __init__(
        self,
        store: SummaryStore,
        local: SingleFlight | None = None,
        *,
        poll_initial_s: float = 0.05,
        poll_max_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.store = store
        self.local = local if local is not None else SingleFlight()
        self._poll_initial_s = poll_initial_s
        self._poll_max_s = poll_max_s
        self._clock = clock
        self._sleep = sleep
        self.made = 0  # summaries this process made itself
        self.found = 0  # summaries another task/replica made while we were about to

    async def run(self, key: str, make: Callable[[], Awaitable[StoredSummary]]) -> StoredSummary:
        return await self.local.run(key, partial(self._once, key, make))

    async def _once(self, key: str, make: Callable[[], Awaitable[StoredSummary]]) -> StoredSummary:
        store = self.store
        if not store.shared:
            return await self._find_or_make(key, make)
        token = secrets.token_hex(16)
        deadline = self._clock() + store.lock_ttl_s
        delay = self._poll_initial_s
        while True:
            status = await store.acquire_lock(key, token)
            if status == "acquired":
                try:
                    return await self._find_or_make(key, make)
                finally:
                    await store.release_lock(key, token)
            if status == "unavailable":
                return await self._find_or_make(key, make)
            found = await store.get(key)
            if found is not None:
                self.found += 1
                return found
            remaining = deadline - self._clock()
            if remaining <= 0:
                log.warning(
                    "summary store: no summary after waiting %.0fs for another replica; "
                    "making it here",
                    store.lock_ttl_s,
                )
                return await self._find_or_make(key, make)
            await self._sleep(min(delay, remaining))
            delay = min(delay * 2, self._poll_max_s)

    async def _find_or_make(
        self, key: str, make: Callable[[], Awaitable[StoredSummary]]
    ) -> StoredSummary:
        # Re-check: another task or replica may have stored it since the caller's lookup.
        found = await self.store.get(key)
        if found is not None:
            self.found += 1
            return found
        summary = await make()
        self.made += 1
        await self.store.put(key, summary)
        return summary
