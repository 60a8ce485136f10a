"""`compaction-proxy serve` as users run it (a subprocess: the real CLI's logging and uvicorn
setup), against what a hostile client or a failing upstream sends on raw sockets: a 64 MB
request head, control characters in a path or a header meant to forge log lines, an
upstream that breaks off in the middle of a reply."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.fault_upstream import fault_upstream, http_request, raw_request
from tests.integration.harness import closed_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
START_S = 20.0  # import + tokenizer load on a loaded CI machine
WAIT_S = 10.0
# The start of a record in the text format: `date time,ms LEVEL logger `.
RECORD_START = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \S+ ")
KEY = "pk-hostile-test"
KEYS = json.dumps([{"id": "team", "key_sha256": hashlib.sha256(KEY.encode()).hexdigest()}])


@dataclass
class Served:
    port: int
    pid: int
    log: Path

    def text(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    async def until_logged(self, count: int, what: str) -> list[str]:
        """The log's lines once `what` is in `count` of them (a bounded poll of the file)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            lines = self.text().splitlines()
            if sum(what in line for line in lines) >= count:
                return lines
            assert time.monotonic() < deadline, f"{count} x {what!r} not logged: {lines}"
            await asyncio.sleep(0.02)

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")


@contextlib.asynccontextmanager
async def serve(upstream_url: str, **env: str) -> AsyncIterator[Served]:
    """`python -m proxy.cli serve` (text logs at info), its stderr in a file."""
    port = closed_port()
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "stderr.log"
        with log.open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "proxy.cli", "serve", "--upstream", upstream_url,
                "--port", str(port), "--log-format", "text", "--log-level", "info",
                cwd=REPO, env={**os.environ, **env}, stdout=asyncio.subprocess.DEVNULL,
                stderr=stderr,
            )  # fmt: skip
        try:
            async with httpx.AsyncClient() as client:
                deadline = time.monotonic() + START_S
                while True:  # a bounded poll of the proxy's liveness endpoint
                    assert process.returncode is None, f"serve exited: {log.read_text()}"
                    with contextlib.suppress(httpx.TransportError):
                        reply = await client.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                        if reply.status_code == 200:
                            break
                    assert time.monotonic() < deadline, f"serve not up: {log.read_text()}"
                    await asyncio.sleep(0.05)
            yield Served(port, process.pid, log)
        finally:
            process.terminate()
            try:
                async with asyncio.timeout(WAIT_S):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()


def send_head(port: int, size: int, one_mb_sent: threading.Event) -> tuple[bytes, float]:
    """A request whose one header is `size` bytes long, sent in 64 KB writes (none of it
    held in memory at once); what came back before the proxy hung up, and how long that took."""
    started = time.monotonic()
    reply = b""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S * 2) as sock:
        piece = b"a" * 65536
        try:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: proxy.test\r\nx-big: ")
            for sent in range(0, size, len(piece)):
                sock.sendall(piece)
                if sent >= 1 << 20:
                    one_mb_sent.set()
            sock.sendall(b"\r\n\r\n")
        except OSError:  # the proxy closed the connection: what did it say first?
            pass
        finally:
            one_mb_sent.set()
        with contextlib.suppress(OSError):
            while data := sock.recv(65536):
                reply += data
    return reply, time.monotonic() - started


async def test_a_64_mb_request_head_is_refused_at_once_while_others_are_served() -> None:
    async with serve(f"http://127.0.0.1:{closed_port()}/v1", **{
        "COMPACTION_PROXY_SERVER__WARM_CONNECT_S": "0",
    }) as proxy:  # fmt: skip
        cpu, rss = proxy.cpu_s(), proxy.rss_mb()
        one_mb_sent = threading.Event()
        big = asyncio.create_task(asyncio.to_thread(send_head, proxy.port, 64 << 20, one_mb_sent))
        assert await asyncio.to_thread(one_mb_sent.wait, WAIT_S)
        async with httpx.AsyncClient() as client:
            asked = time.monotonic()
            health = await client.get(f"http://127.0.0.1:{proxy.port}/healthz", timeout=WAIT_S)
            health_s = time.monotonic() - asked
        reply, big_s = await big
        # Unbounded, the head cost ~5 s of the event loop's CPU and ~50 MB of RSS.
        cpu_used, rss_grown = proxy.cpu_s() - cpu, proxy.rss_mb() - rss
        assert big_s < 3.0 and cpu_used < 1.0 and rss_grown < 16, (big_s, cpu_used, rss_grown)
        assert health.status_code == 200 and health_s < 1.0
        # The 431 is read when it comes before the close resets a client still sending.
        assert reply == b"" or reply.startswith(b"HTTP/1.1 431 ")
        lines = await proxy.until_logged(1, "server.max_header_bytes")
    refused = [line for line in lines if "server.max_header_bytes" in line]
    assert refused == [refused[0]] and " INFO proxy.connections request head over " in refused[0]


# Each target holds control characters that would start a forged line (or steer a terminal)
# if written as they are: answered 400 (control characters under /v1/), 404, and 401 (keys
# on; the Unicode line breaks pass the path check).
FORGED = "2026-01-01 00:00:00,000 INFO proxy.access forged"
TARGETS = {
    b"/v1/models%1b[2J%0d": 400,
    b"/nowhere%0a" + FORGED.replace(" ", "%20").encode(): 404,
    b"/v1/models%0a" + FORGED.replace(" ", "%20").encode(): 400,
    b"/v1/models%e2%80%a8%c2%85x": 401,  # U+2028, U+0085 (NEL)
}


async def test_control_characters_in_a_path_or_header_never_make_a_line_of_their_own() -> None:
    async with serve(f"http://127.0.0.1:{closed_port()}/v1", **{
        "COMPACTION_PROXY_SERVER__WARM_CONNECT_S": "0", "COMPACTION_PROXY_AUTH__KEYS": KEYS,
    }) as proxy:  # fmt: skip
        for target, status in TARGETS.items():
            reply = await raw_request(proxy.port, http_request("GET", target))
            assert reply.status == status, (target, reply.body)
        # A request id with a byte that decodes to NEL (obs-text, which HTTP allows).
        headers = [(b"x-request-id", b"req\x85" + FORGED.encode())]
        reply = await raw_request(proxy.port, http_request("GET", b"/v1/models", headers=headers))
        assert reply.status == 401
        lines = await proxy.until_logged(len(TARGETS) + 1, " status=40")  # each refused
    for line in lines:  # each line starts a record, or continues one (indented)
        assert RECORD_START.match(line) or line.startswith("  "), line
    assert not [line for line in lines if FORGED in line.lstrip()[: len(FORGED)]]
    access = [line for line in lines if " INFO proxy.access GET " in line and " status=40" in line]
    assert ' path="/v1/models\\u001b[2J\\r" ' in access[0]
    assert f' path="/nowhere\\n{FORGED}" ' in access[1]
    assert f' path="/v1/models\\n{FORGED}" ' in access[2]
    assert ' path="/v1/models\\u2028\\u0085x" ' in access[3]
    assert f' request_id="req\\u0085{FORGED}" ' in access[4]
    assert " GET /v1/models\\x1b[2J\\r 400 " in access[0]  # the message, escaped too


async def test_an_upstream_breaking_off_mid_stream_is_one_warning_line_no_traceback() -> None:
    async with fault_upstream() as upstream, serve(f"{upstream.url}/v1") as proxy:
        chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                           "stream": True}).encode()  # fmt: skip
        headers = [(b"content-type", b"application/json"), (b"x-fault", b"reset-mid-stream")]
        reply = await raw_request(
            proxy.port, http_request("POST", b"/v1/chat/completions", headers=headers, body=chat)
        )
        assert reply.status == 200 and not reply.complete  # the relay aborted, not ended
        lines = await proxy.until_logged(1, " INFO proxy.access POST /v1/chat/completions 200 ")
    text = "\n".join(lines)
    assert "Traceback" not in text and "Exception in ASGI application" not in text
    assert not [line for line in lines if " ERROR " in line]
    (warning,) = [line for line in lines if " WARNING " in line]
    assert "failed mid-response" in warning
