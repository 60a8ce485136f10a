"""The disconnect watcher: work is cancelled when the client leaves, and only then.

`receive` here is a stand-in for the server's: once the body is read it blocks until the
client goes away, then reports `http.disconnect`.
"""

from __future__ import annotations

import asyncio

import pytest
from starlette.types import Message

from proxy.disconnect import DisconnectWatch
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
    watch = DisconnectWatch(client.receive)
    try:
        assert await watch.run(lambda: asyncio.sleep(0, "reply")) == "reply"
    finally:
        watch.close()
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
    watch = DisconnectWatch(client.receive)
    with pytest.raises(ClientDisconnected):
        await watch.run(wait_for_upstream)
    await leaving
    assert aborted.is_set()
    assert watch.gone
    watch.close()
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

    watch = DisconnectWatch(client.receive)
    task = asyncio.create_task(watch.run(work))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    watch.close()
    client.left.set()  # after the fact: nothing left to cancel
    assert not watch.gone


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


async def test_work_that_absorbs_the_cancel_keeps_its_result_and_no_pending_cancel() -> None:
    client = Client()
    watch = DisconnectWatch(client.receive)

    async def work() -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "partial"  # e.g. a relay that ends its stream cleanly instead
        return "never"

    async def leave() -> None:
        await until(lambda: client.receives == 1)
        client.left.set()

    leaving = asyncio.create_task(leave())
    assert await watch.run(work) == "partial"
    await leaving
    assert watch.gone
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    with pytest.raises(ClientDisconnected):  # the next step sees the client is gone
        await watch.run(lambda: asyncio.sleep(0))
    watch.close()
