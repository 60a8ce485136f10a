"""A live proxy (uvicorn on 127.0.0.1, in the test's event loop) in front of FaultUpstream.

`rig()` builds it with a small pool, short timeouts and credentials on every request;
`Rig.settled()` asserts that nothing is left held; `assert_no_secrets` checks log records.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from proxy.app import create_app
from proxy.transport import PoolSlots
from tests.conftest import make_settings, until
from tests.fault_upstream import (
    FaultUpstream,
    RawReply,
    chunk,
    fault_upstream,
    http_request,
    raw_request,
    serving,
)

SLOTS = 2
TIMES = SLOTS + 1
SECRETS = [b"sk-client-SECRET-one", b"sk-query-SECRET-two", b"SECRET-three-xkey", b"sk-summ-FOUR"]
CREDENTIALS = [
    (b"authorization", b"Bearer " + SECRETS[0]),
    (b"x-api-key", SECRETS[2]),
]
QUERY = b"?api-key=" + SECRETS[1]
CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


@dataclass
class Rig:
    upstream: FaultUpstream
    port: int
    app: Any
    baseline: set[asyncio.Task[Any]]

    def slots(self) -> PoolSlots | None:
        return self.app.state.proxy.upstream.pool_slots()  # type: ignore[no-any-return]

    def stray_tasks(self) -> list[asyncio.Task[Any]]:
        current = asyncio.current_task()
        return [
            task
            for task in asyncio.all_tasks()
            if task not in self.baseline
            and task is not current
            and not task.done()
            and task.get_name() != "fault-upstream"
        ]

    async def settled(self) -> None:
        """Nothing held: all slots free, no reply in progress upstream, no proxy task left."""
        await until(
            lambda: (
                self.upstream.active == 0
                and self.slots() == PoolSlots(in_use=0, free=SLOTS)
                and not self.stray_tasks()
            )
        )
        assert self.slots() == PoolSlots(in_use=0, free=SLOTS)
        assert self.upstream.active == 0
        assert self.stray_tasks() == [], self.stray_tasks()

    async def chat(self, fault: str, *, body: bytes = CHAT, extra: Any = ()) -> RawReply:
        headers = [*CREDENTIALS, (b"content-type", b"application/json"), *extra]
        if fault:
            headers.append((b"x-fault", fault.encode()))
        request = http_request("POST", b"/v1/chat/completions" + QUERY, headers=headers, body=body)
        return await raw_request(self.port, request)

    async def get(self, target: bytes, fault: str = "", *, method: str = "GET") -> RawReply:
        headers = [*CREDENTIALS] + ([(b"x-fault", fault.encode())] if fault else [])
        return await raw_request(self.port, http_request(method, target, headers=headers))

    async def upload(self, fault: str, pieces: list[bytes]) -> RawReply:
        """A chunked POST /v1/files: streamed on to the upstream as it comes."""
        return await raw_request(self.port, upload_request(fault, pieces))


def upload_request(fault: str, pieces: list[bytes], *, end: bool = True) -> bytes:
    """A streamed upload (Transfer-Encoding: chunked) as raw bytes; `end`: with its last
    chunk (without it the body never ends)."""
    headers = [
        *CREDENTIALS,
        (b"content-type", b"application/octet-stream"),
        (b"transfer-encoding", b"chunked"),
    ]
    if fault:
        headers.append((b"x-fault", fault.encode()))
    head = http_request("POST", b"/v1/files" + QUERY, headers=headers)
    return head + b"".join(map(chunk, pieces)) + (b"0\r\n\r\n" if end else b"")


@contextlib.asynccontextmanager
async def rig(
    timeout_s: float = 0.75, summarizer_timeout_s: float = 0.5, **compaction: Any
) -> AsyncIterator[Rig]:
    async with fault_upstream() as upstream:
        settings = make_settings(
            upstream={
                "base_url": upstream.url + "/v1",
                "timeout_s": timeout_s,
                "connect_timeout_s": 5.0,
                "max_connections": SLOTS,
            },
            compaction={
                "summarizer": {
                    "timeout_s": summarizer_timeout_s,
                    "retries": 0,
                    "api_key": SECRETS[3].decode(),
                },
                **compaction,
            },
        )
        app = create_app(settings)
        try:
            async with serving(app) as port:
                try:
                    yield Rig(upstream, port, app, set(asyncio.all_tasks()))
                finally:
                    upstream.release.set()
        finally:
            await app.state.proxy.upstream.client.aclose()


def assert_no_secrets(records: list[logging.LogRecord]) -> None:
    """No credential in any record: message, arguments, traceback."""
    leaks = []
    for record in records:
        text = record.getMessage() + (record.exc_text or "") + repr(record.args)
        if record.exc_info and record.exc_info[1] is not None:
            text += repr(record.exc_info[1])
        leaks += [(record.name, s) for s in SECRETS if s.decode() in text]
    assert leaks == []
