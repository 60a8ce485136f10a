"""Summaries made ahead of need: background work that nobody waits on.

A turn that needs a new summary would wait for the whole summarizer call before its first
byte. Instead, once a session's request is forwarded with `compaction.prepare_at` of its
budget (proxy/compactor.py decides, after its own decision), the summary the compaction at
the budget will want is made in the background (`SummaryStage.prepare`, proxy/planner.py)
and stored like any other; the turn that crosses the budget finds it.

This module only runs that work, bounded and accounted:

- at most `limit` preparations at once per process; one more is dropped (never queued),
  counted, and the request says so (`x-compaction-prepared: dropped`);
- `start` only creates a task: the request that offered the work goes on at once;
- a failure is counted and logged at most every 30 s per kind, never raised;
- `close` (the app's shutdown) cancels what is running and waits for it to unwind: locks
  released, nothing stored half-made;
- the first request a prepared summary serves marks it used (`claim`): it is stored again
  without the mark, off that request's path, so later requests do not count it again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Literal, Protocol

from proxy.compaction.protocol import SummarizerError
from proxy.planner import Prepared
from proxy.report import NO_USAGE, Usage
from proxy.store import StoredSummary, SummaryStore

log = logging.getLogger("proxy.compaction")

# What a preparation came to: started; done (a summary made and stored); skipped (none was
# needed: see `Prepared`); failed; dropped (the cap); cancelled (shutdown); used (a request
# was forwarded with one for the first time).
Result = Literal["started", "done", "skipped", "failed", "dropped", "cancelled", "used"]
# Marks cleared at once (one store write each); past this, a used summary keeps its mark
# and may be counted as used again.
_CLAIMS = 64
_LOG_EVERY_S = 30.0


class PrepareObserver(Protocol):
    """Told what preparations do (proxy.metrics.Metrics is one)."""

    def prepared(self, result: Result, usage: Usage, running: int) -> None:
        """`usage`: what a made summary cost (done, failed) or had cost (used); `running`:
        preparations running now."""
        ...


class Preparer:
    def __init__(
        self,
        store: SummaryStore,
        limit: int,
        observer: PrepareObserver | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.limit = limit
        self.observer = observer
        self._clock = clock
        self._running: set[asyncio.Task[None]] = set()  # preparations
        self._claims: set[asyncio.Task[None]] = set()
        self._logged: dict[str, float] = {}  # failure kind -> when last logged
        self._closed = False

    @property
    def running(self) -> int:
        return len(self._running)

    def start(self, work: Callable[[], Awaitable[Prepared]]) -> Literal["started", "dropped"]:
        """Run `work()` in the background unless `limit` preparations are running."""
        if self._closed or len(self._running) >= self.limit:
            self._tell("dropped")
            return "dropped"
        task = asyncio.get_running_loop().create_task(self._run(work))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        self._tell("started")
        return "started"

    async def _run(self, work: Callable[[], Awaitable[Prepared]]) -> None:
        try:
            prepared = await work()
        except asyncio.CancelledError:
            self._tell("cancelled", running=-1)
            raise
        except SummarizerError as error:
            self._tell("failed", error.usage, running=-1)
            self._warn(error.reason, "summary preparation failed (%s): %s", error.reason, error)
        except Exception as exc:
            self._tell("failed", running=-1)
            self._warn(type(exc).__name__, "summary preparation failed: %s", exc, exc_info=True)
        else:
            done = prepared.status == "made"
            self._tell("done" if done else "skipped", prepared.usage, running=-1)

    def claim(self, key: str, entry: StoredSummary) -> None:
        """A request was forwarded with `entry` (stored under `key`), made ahead of need:
        counted as used, and stored again unmarked in the background."""
        self._tell("used", entry.usage)
        if self._closed or len(self._claims) >= _CLAIMS:
            return
        task = asyncio.get_running_loop().create_task(
            self.store.put(key, replace(entry, prepared=False))
        )
        self._claims.add(task)
        task.add_done_callback(self._claims.discard)

    async def close(self) -> None:
        """Cancel what is running and wait until it has unwound (shutdown)."""
        self._closed = True
        tasks = [*self._running, *self._claims]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def join(self) -> None:
        """Wait until nothing is running (tests, benchmarks)."""
        while self._running or self._claims:
            await asyncio.gather(*self._running, *self._claims, return_exceptions=True)

    def _tell(self, result: Result, usage: Usage = NO_USAGE, running: int = 0) -> None:
        # A task's own count still includes it while it reports its end: `running` says by how
        # much the figure should differ.
        if self.observer is not None:
            self.observer.prepared(result, usage, len(self._running) + running)

    def _warn(self, kind: str, message: str, *args: object, exc_info: bool = False) -> None:
        """One line per kind of failure at most every 30 s: a summarizer that is down must
        not flood the log with one line per session approaching its budget."""
        now = self._clock()
        last = self._logged.get(kind)
        if last is not None and now - last < _LOG_EVERY_S:
            return
        if len(self._logged) > 256:  # kinds come from exception types and reasons: bounded
            self._logged.clear()
        self._logged[kind] = now
        log.warning(message, *args, exc_info=exc_info)
