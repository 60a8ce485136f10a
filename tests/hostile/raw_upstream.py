"""An upstream on 127.0.0.1 that writes exact bytes from raw sockets, plain or TLS, and the
proxy in front of it (uvicorn on 127.0.0.1, its lifespan run: the app's own transport).

Each accepted connection is handed to the test's script in a thread of its own, with the
first request's head (and body, by Content-Length) already read. The script writes what it
likes and ends the connection as it likes: a clean close, a reset (RST), or, over TLS, a
close without close_notify. What the upstream saw is kept for the test to assert on.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trustme

from proxy.app import create_app
from tests.conftest import make_settings
from tests.fault_upstream import serving

WAIT_S = 10.0


@dataclass
class Conn:
    """One upstream connection as a script sees it."""

    sock: socket.socket
    index: int  # 1, 2, ... in order of accept
    head: bytes = b""  # the current request's head
    body: bytes = b""
    upstream: RawUpstream | None = None
    _rest: bytes = b""

    @property
    def method(self) -> bytes:
        return self.head.split(b" ", 1)[0]

    @property
    def target(self) -> bytes:
        return self.head.split(b" ", 2)[1]

    def header(self, name: bytes) -> bytes | None:
        for line in self.head.split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == name:
                return value.strip()
        return None

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def next_request(self) -> bool:
        """Read the next request on this connection (False: the peer closed it)."""
        data = self._rest
        while b"\r\n\r\n" not in data:
            try:
                piece = self.sock.recv(65536)
            except (OSError, ssl.SSLError):
                return False
            if not piece:
                return False
            data += piece
        head, _, data = data.partition(b"\r\n\r\n")
        self.head = head
        length = int(self.header(b"content-length") or b"0")
        while len(data) < length:
            piece = self.sock.recv(65536)
            if not piece:
                return False
            data += piece
        self.body, self._rest = data[:length], data[length:]
        if self.upstream is not None:
            self.upstream.requests.append((self.index, head, self.body))
        return True

    def wait_closed(self) -> float | None:
        """Block until the peer closes the connection (the time it did), None after WAIT_S or
        when bytes came instead."""
        self.sock.settimeout(WAIT_S)
        try:
            piece = self.sock.recv(65536)
        except (TimeoutError, ssl.SSLError, OSError):
            return time.monotonic()
        return time.monotonic() if not piece else None

    def reset(self) -> None:
        """Abort with a TCP reset (over TLS: no close_notify either)."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def close_without_notify(self) -> None:
        """Close the TCP connection without TLS's close_notify (a plain close for plain)."""
        self.sock.close()

    def close(self) -> None:
        """A clean close: close_notify first over TLS."""
        if isinstance(self.sock, ssl.SSLSocket):
            with contextlib.suppress(OSError, ssl.SSLError):
                self.sock.unwrap().close()
                return
        self.sock.close()


Script = Callable[[Conn], None]


@dataclass
class RawUpstream:
    """Accepts connections and runs `script` on each (see the module docstring)."""

    script: Script
    tls: ssl.SSLContext | None = None
    host: str = "127.0.0.1"
    port: int = 0
    requests: list[tuple[int, bytes, bytes]] = field(default_factory=list)  # (conn, head, body)
    connections: int = 0
    failures: list[BaseException] = field(default_factory=list)
    _listener: socket.socket | None = None
    _threads: list[threading.Thread] = field(default_factory=list)
    _closing: bool = False

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def start(self) -> None:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            thread = threading.Thread(target=self._run, args=(sock, self.connections), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _run(self, sock: socket.socket, index: int) -> None:
        try:
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_side=True)
            conn = Conn(sock, index, upstream=self)
            if conn.next_request():
                self.script(conn)
        except (OSError, ssl.SSLError):
            pass  # the proxy went away; the test asserts on what it saw
        except BaseException as exc:  # a broken script fails its test
            self.failures.append(exc)
        finally:
            with contextlib.suppress(OSError):
                sock.close()

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
        for thread in self._threads[1:]:
            thread.join(WAIT_S)
        assert self.failures == [], self.failures


@contextlib.contextmanager
def raw_upstream(script: Script, tls: ssl.SSLContext | None = None) -> Iterator[RawUpstream]:
    upstream = RawUpstream(script, tls, host="localhost" if tls else "127.0.0.1")
    upstream.start()
    try:
        yield upstream
    finally:
        upstream.stop()


def tls_server_context(authority: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("localhost").configure_cert(context)
    return context


def trust(authority: trustme.CA, directory: Path) -> str:
    """A CA bundle file for SSL_CERT_FILE (what httpx's default context reads)."""
    bundle = directory / "ca.pem"
    authority.cert_pem.write_to_path(str(bundle))
    return str(bundle)


@contextlib.asynccontextmanager
async def proxy_for(raw: RawUpstream, **sections: dict[str, Any]) -> AsyncIterator[Proxy]:
    """The proxy, served on 127.0.0.1, in front of `raw` (short timeouts, a small pool)."""
    merged = {"timeout_s": 5.0, "connect_timeout_s": 5.0, "max_connections": 4}
    merged.update(sections.pop("upstream", {}))
    settings = make_settings(upstream={"base_url": f"{raw.url}/v1", **merged}, **sections)
    app = create_app(settings)
    try:
        async with serving(app) as port:
            yield Proxy(app, port)
    finally:
        await app.state.proxy.upstream.client.aclose()


@dataclass
class Proxy:
    app: Any
    port: int

    def in_use(self) -> int:
        slots = self.app.state.proxy.upstream.pool_slots()
        assert slots is not None
        return int(slots.in_use)
