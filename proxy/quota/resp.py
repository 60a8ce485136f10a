"""One dedicated, pipelined connection to a single Redis node for the quota check.

The charge is the one Redis call on the request path, and redis-py's asyncio client spends
more CPU on it (pool checkout, command packing, stream reader, retry wrapper: ~60-80 us per
call) than Redis spends running the script. This line is the minimum instead: commands are
prepacked bytes; a command issued while the line is idle is written at once (no loop
iteration waited for), and every command issued while others are in flight is held and goes
out in one write as soon as a reply comes back; replies are read off one buffer in order and
handed to their callers. Many concurrent requests thus share one round trip, and each still
gets its own script run (Redis runs them one after the other, each atomically), so limits
stay exact.

Plain TCP or a unix socket, with AUTH and SELECT from the client's URL; anything else
(TLS, a credential provider) keeps redis-py (`ChargeLine.supports`). A reply slower than
`timeout_s` or a dropped connection fails every command in flight and the next command
reconnects (the ledger resends a charge once after a dropped connection, safe because a
charge is idempotent; a timeout or a second failure is an outage).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import threading
from collections.abc import Awaitable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError


def pack(*parts: str | int | bytes) -> bytes:
    """One RESP command (an array of bulk strings)."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        if isinstance(part, str):
            data = part.encode()
        else:
            data = part if isinstance(part, bytes) else b"%d" % part
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class _Incomplete(Exception):
    """The buffer ends inside a reply: wait for more bytes."""


def _line(buf: bytes, pos: int) -> tuple[bytes, int]:
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise _Incomplete
    return buf[pos:end], end + 2


def parse(buf: bytes, pos: int = 0) -> tuple[Any, int]:
    """One RESP2 reply at `pos`: (value, position after it). Errors come back as
    ResponseError values (NoScriptError for NOSCRIPT), not raised. Raises _Incomplete."""
    head, pos = _line(buf, pos)
    kind, rest = head[:1], head[1:]
    if kind == b"$":  # first: the charge script's result is one bulk string
        size = int(rest)
        if size < 0:
            return None, pos
        if len(buf) < pos + size + 2:
            raise _Incomplete
        return buf[pos : pos + size], pos + size + 2
    if kind == b":":
        return int(rest), pos
    if kind == b"*":
        count = int(rest)
        if count < 0:
            return None, pos
        items = []
        for _ in range(count):
            item, pos = parse(buf, pos)
            items.append(item)
        return items, pos
    if kind == b"+":
        return rest, pos
    if kind == b"-":
        text = rest.decode(errors="replace")
        return (NoScriptError if text.startswith("NOSCRIPT") else ResponseError)(text), pos
    raise RedisConnectionError(f"unexpected reply from Redis: {head[:20]!r}")


class _Protocol(asyncio.Protocol):
    def __init__(self, line: ChargeLine) -> None:
        self.line = line
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.line._transport is self.transport:
            self.line._received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.line._transport is self.transport:  # not one already replaced
            self.line._lost(exc or RedisConnectionError("Redis closed the connection"))


class ChargeLine:
    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 6379,
        path: str | None = None,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
        timeout_s: float = 1.0,
        script: str = "",
    ) -> None:
        self.host, self.port, self.path = host, port, path
        self.username, self.password, self.db = username, password, db
        self.timeout_s = timeout_s
        self.script = script
        self.round_trips = 0  # writes of one or more commands (how much was coalesced)
        self.commands = 0
        self._transport: asyncio.Transport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Future[None] | None = None
        self._pending: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self._out: list[bytes] = []
        self._buffer = b""
        self._watchdog: asyncio.TimerHandle | None = None
        self._thread = 0  # the thread the line opened on (its loop's)

    @staticmethod
    def supports(client: object) -> bool:
        """A single node reached over plain TCP or a unix socket, with a password at most."""
        if not isinstance(client, Redis):
            return False
        pool = client.connection_pool
        kwargs = pool.connection_kwargs
        return pool.connection_class in (Connection, UnixDomainSocketConnection) and not (
            kwargs.get("credential_provider")
        )

    @classmethod
    def of(cls, client: Redis, script: str) -> ChargeLine:
        kwargs = client.connection_pool.connection_kwargs
        timeout = kwargs.get("socket_timeout") or 5.0
        return cls(
            host=kwargs.get("host", "127.0.0.1"),
            port=int(kwargs.get("port", 6379)),
            path=kwargs.get("path"),
            username=kwargs.get("username"),
            password=kwargs.get("password"),
            db=int(kwargs.get("db") or 0),
            timeout_s=float(timeout),
            script=script,
        )

    @property
    def ready(self) -> bool:
        """Open in the running event loop: `call` writes (or queues) its command at once.

        Asked on every charge, so without `asyncio.get_running_loop` (on Python 3.11 a
        getpid() syscall each time, ~1-2 us here): the loop the line opened in is running,
        on this thread, so it is the running one (a thread runs one loop at a time)."""
        loop = self._loop
        return (
            self._transport is not None
            and loop is not None
            and self._thread == threading.get_ident()
            and loop.is_running()
        )

    def call(self, command: bytes) -> Awaitable[Any]:
        """Send one packed command (at once on an idle line, else with the others held until
        the next reply); its reply, to await.

        A Redis error reply is raised (ResponseError, NoScriptError); a lost connection or a
        timeout raise RedisConnectionError / TimeoutError. On an open line this is the
        reply's own future: no coroutine in between."""
        if not self.ready:
            return self._connect_and_send(command)
        return self._send(command)

    def send_now(self, command: bytes) -> asyncio.Future[Any] | None:
        """`call` on a line open in the running loop (the reply's future); None otherwise,
        nothing sent (then `call`, which connects first)."""
        loop = self._loop  # `ready`, inline: asked once per charge
        if (
            self._transport is None
            or loop is None
            or self._thread != threading.get_ident()
            or not loop.is_running()
        ):
            return None
        return self._send(command)

    async def _connect_and_send(self, command: bytes) -> Any:
        if self._transport is not None:  # opened in another event loop (test clients)
            self._drop(RedisConnectionError("event loop changed"))
        await self._connect()
        return await self._send(command)

    def _send(self, command: bytes) -> asyncio.Future[Any]:
        """Written at once when nothing is in flight; else held until a reply comes back, and
        then everything held goes out in one write. The future holds the reply, or raises a
        Redis error reply (or RedisConnectionError when the line has no connection)."""
        loop = self._loop
        assert loop is not None  # set when the line opened
        future: asyncio.Future[Any] = loop.create_future()
        transport = self._transport
        if transport is None:  # lost since it was asked for: nothing to write it to
            future.set_exception(RedisConnectionError("Redis closed the connection"))
            future.exception()  # retrieved: its charge may have been abandoned
            return future
        pending = self._pending
        # Nothing in flight: every command sent has its reply (held ones exist only while
        # one is in flight, and all go out when any reply comes back).
        idle = not pending
        pending.append((future, loop.time()))
        self.commands += 1
        if not idle:
            self._out.append(command)
            return future
        self.round_trips += 1
        transport.write(command)
        if self._watchdog is None:
            self._watchdog = loop.call_later(self.timeout_s, self._check)
        return future

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self._transport is None or not out:
            return
        self.round_trips += 1
        self._transport.write(out[0] if len(out) == 1 else b"".join(out))
        if self._watchdog is None:
            assert self._loop is not None
            self._watchdog = self._loop.call_later(self.timeout_s, self._check)

    def _check(self) -> None:
        """Fail everything in flight when the oldest command waits longer than timeout_s."""
        self._watchdog = None
        if not self._pending:
            return
        loop = asyncio.get_running_loop()
        waited = loop.time() - self._pending[0][1]
        if waited >= self.timeout_s:
            self._drop(TimeoutError(f"no reply from Redis within {self.timeout_s:g} s"))
            return
        self._watchdog = loop.call_later(self.timeout_s - waited, self._check)

    def _received(self, data: bytes) -> None:
        buf = self._buffer + data if self._buffer else data
        pos = 0
        end = len(buf)
        pending = self._pending
        try:
            while pos < end and pending:
                if buf[pos] == 36:  # "$": a bulk string (a charge's reply), read here
                    eol = buf.find(b"\r\n", pos)
                    if eol < 0:
                        break
                    size = int(buf[pos + 1 : eol])
                    if size < 0:
                        reply, pos = None, eol + 2
                    else:
                        stop = eol + 2 + size
                        if stop + 2 > end:
                            break
                        reply, pos = buf[eol + 2 : stop], stop + 2
                else:
                    reply, pos = parse(buf, pos)
                future = pending.popleft()[0]
                if future.done():
                    continue
                if isinstance(reply, ResponseError):
                    future.set_exception(reply)
                    future.exception()  # retrieved: its charge may have been abandoned
                else:
                    future.set_result(reply)
        except _Incomplete:
            pass
        except (ValueError, RedisConnectionError) as exc:  # out of step: start over
            self._drop(RedisConnectionError(f"unreadable reply from Redis ({exc})"))
            return
        self._buffer = buf[pos:]
        if self._out:
            self._flush()

    def _lost(self, exc: BaseException) -> None:
        self._transport = None
        self._fail_pending(exc)

    def _drop(self, exc: BaseException) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            with contextlib.suppress(RuntimeError):  # its event loop is already closed
                transport.abort()
        self._fail_pending(exc)

    def _fail_pending(self, exc: BaseException) -> None:
        self._buffer = b""
        self._out = []
        pending, self._pending = self._pending, collections.deque()
        for future, _ in pending:
            if not future.done():
                future.set_exception(exc)
                future.exception()  # retrieved: its charge may have been abandoned
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watchdog = None

    async def _connect(self) -> None:
        """One connect for every caller waiting on it: socket, AUTH, SELECT, SCRIPT LOAD."""
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_future()
            try:
                await self._open()
                self._connecting.set_result(None)
            except BaseException as exc:
                self._connecting.set_exception(exc)
                self._connecting.exception()  # retrieved: no "never retrieved" warning
                raise
            finally:
                self._connecting = None
            return
        await asyncio.shield(self._connecting)

    async def _open(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        async with asyncio.timeout(self.timeout_s):
            if self.path is not None:
                transport, _ = await loop.create_unix_connection(lambda: _Protocol(self), self.path)
            else:
                transport, _ = await loop.create_connection(
                    lambda: _Protocol(self), self.host, self.port
                )
                sock = transport.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            self._transport = transport
            setup: list[bytes] = []
            if self.password:
                auth = (self.username, self.password) if self.username else (self.password,)
                setup.append(pack("AUTH", *auth))
            if self.db:
                setup.append(pack("SELECT", self.db))
            if self.script:
                setup.append(pack("SCRIPT", "LOAD", self.script))
            try:
                await asyncio.gather(*(self._send(cmd) for cmd in setup))  # raises an error reply
            except BaseException:
                self._drop(RedisConnectionError("Redis refused the connection setup"))
                raise

    def close(self) -> None:
        self._drop(RedisConnectionError("closed"))
