"""The disconnect watcher: work is cancelled when the client leaves, and only then.

`receive` here is a stand-in for the server's: once the body is read it blocks until the
client goes away, then reports `http.disconnect`.
"""

from __future__ import annotations

import asyncio

import pytest
from starlette.types import Message

from proxy.disconnect import DisconnectWatch, cancel_on_disconnect
from proxy.errors import ClientDisconnected
from tests.conftest import until


class Client:
    def __init__(self) -> None:
        self.left = asyncio.Event()
        self.receives = 0

    async def receive(self) -> Message:
        self.receives += 1
        await self.left.wait()
        return {"type": "http.disconnect"}


async def test_work_that_finishes_returns_its_result_and_leaves_no_task() -> None:
    client = Client()
    before = set(asyncio.all_tasks())
    assert await cancel_on_disconnect(client.receive, lambda: asyncio.sleep(0, "reply")) == "reply"
    await until(lambda: all(t.done() for t in asyncio.all_tasks() - before))
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_client_leaving_cancels_the_work_and_raises_client_disconnected() -> None:
    client = Client()
    upstream = asyncio.Event()
    aborted = asyncio.Event()

    async def wait_for_upstream() -> str:
        try:
            await upstream.wait()  # never answers
        finally:
            aborted.set()
        return "never"

    async def leave() -> None:
        await until(lambda: client.receives == 1)
        client.left.set()

    leaving = asyncio.create_task(leave())
    with pytest.raises(ClientDisconnected):
        await cancel_on_disconnect(client.receive, wait_for_upstream)
    await leaving
    assert aborted.is_set()
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_one_watcher_covers_every_step_and_a_gone_client_skips_the_next() -> None:
    client = Client()
    watch = DisconnectWatch(client.receive)
    assert await watch.run(lambda: asyncio.sleep(0, 1)) == 1
    assert await watch.run(lambda: asyncio.sleep(0, 2)) == 2
    assert client.receives == 1
    client.left.set()
    await until(lambda: watch.gone)
    called = []

    async def work() -> None:
        called.append(True)

    with pytest.raises(ClientDisconnected):
        await watch.run(work)
    assert called == []
    watch.close()


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    client = Client()
    started = asyncio.Event()

    async def work() -> None:
        started.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(cancel_on_disconnect(client.receive, work))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    client.left.set()  # after the fact: nothing left to cancel


async def test_closing_the_watcher_before_the_client_leaves_cancels_nothing() -> None:
    client = Client()
    before = set(asyncio.all_tasks())
    watch = DisconnectWatch(client.receive)
    assert await watch.run(lambda: asyncio.sleep(0, "done")) == "done"
    watch.close()
    await until(lambda: all(t.done() for t in asyncio.all_tasks() - before))
    client.left.set()
    assert not watch.gone
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
