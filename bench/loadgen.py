"""Closed-loop HTTP/1.1 load generator: raw asyncio + httptools on uvloop, keep-alive.

`concurrency` connections each send one request, wait for the complete response, repeat.
Latency = request write -> last byte of the response (for SSE: after `data: [DONE]`).
Prints one JSON object: requests/s and latency percentiles of the responses that ended in
the measured window (after the warm-up).

Run: python -m bench.loadgen --port 8000 --concurrency 16 --body small --stream

Paired (`--ports A B C --rounds N --slice S`): one connection to each server, and the
servers take turns, one request at a time each for `S` seconds per turn, round after round
(each round's order rotated): every server's c1 latency comes from the same stretches of
time as the others', so whatever else runs on the box weighs on all of them alike. The first
`--settle` seconds of each turn are not counted (the server's caches after the others ran).
Prints each server's p50 per round (bench/harness.py `paired_c1`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import typing

import httptools

PATH = "/v1/chat/completions"
_WORDS_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "more can about said what out up other into some them time only new could these two may first "
    "then do any like my now over such our man me even most made after also did many before must "
    "through back years where much your way well compaction proxy upstream latency request "
    "response stream token budget summary history message assistant function argument value"
)
_WORDS = _WORDS_TEXT.split()


def chat_body(kind: str, stream: bool) -> bytes:
    """`small`: two short messages. `30k`: ~30k tokens (~120 KB) of English-like history."""
    if kind == "small":
        messages = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Say hello."},
        ]
    else:
        rng = random.Random(30_000)
        words = _WORDS
        messages = [{"role": "system", "content": "You are a helpful assistant."}]
        for i in range(25):
            text = " ".join(rng.choice(words) for _ in range(1_200))
            messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
        messages.append({"role": "user", "content": "Say hello."})
    return json.dumps({"model": "gpt-4o-mini", "messages": messages, "stream": stream}).encode()


def build_request(host: str, port: int, body: bytes, extra: list[str] | None = None) -> bytes:
    """`extra`: more header lines (`name: value`), e.g. a peer's routing headers."""
    lines = "".join(f"{line}\r\n" for line in extra or [])
    head = (
        f"POST {PATH} HTTP/1.1\r\nHost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer sk-bench\r\n{lines}content-length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


class ClientProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[int] | None = None
        self.lost = asyncio.get_running_loop().create_future()
        self.nbytes = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection lost"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_exception(exc)

    def on_body(self, body: bytes) -> None:
        self.nbytes += len(body)

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(self.parser.get_status_code())

    async def roundtrip(self, request: bytes) -> int:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.nbytes = 0
        self.transport.write(request)
        return await self.waiter


async def run(args: argparse.Namespace) -> dict[str, object]:
    loop = asyncio.get_running_loop()
    request = build_request(args.host, args.port, chat_body(args.body, args.stream), args.header)
    latencies: list[float] = []
    errors = 0
    total = 0  # every completed request, warm-up included (for CPU time per request)
    start = time.perf_counter() + args.warmup
    end = start + args.duration

    async def worker() -> None:
        nonlocal errors, total
        proto: ClientProtocol | None = None
        while True:
            now = time.perf_counter()
            if now >= end:
                break
            if proto is None or proto.lost.done():
                try:
                    _, proto = await loop.create_connection(ClientProtocol, args.host, args.port)
                except OSError:  # the server died: count it, keep the cell's clock running
                    proto = None
                    errors += now >= start
                    await asyncio.sleep(0.05)
                    continue
            t0 = time.perf_counter()
            try:
                status = await proto.roundtrip(request)
            except (ConnectionError, httptools.HttpParserError):
                status = -1
                proto = None
            t1 = time.perf_counter()
            total += 1
            # Every response that ends inside the window counts, also one begun in the warm-up:
            # counting only requests begun and ended inside it undercounts a server whose
            # latency nears the window (64 streams served together end together, so a 1.5 s
            # latency in a 2 s window counted almost none of them).
            if start <= t1 <= end:
                if status == 200:
                    latencies.append(t1 - t0)
                else:
                    errors += 1
        if proto is not None and proto.transport is not None:
            proto.transport.close()

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    latencies.sort()
    n = len(latencies)

    def pct(p: float) -> float:
        return latencies[min(n - 1, int(p * n))] * 1000 if n else float("nan")

    return {
        "requests": n,
        "errors": errors,
        "total": total,
        "rps": n / args.duration,
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
    }


async def run_paired(args: argparse.Namespace) -> dict[str, object]:
    """c1 on each of `args.ports` in turns; per port, its p50 in every round (ms)."""
    loop = asyncio.get_running_loop()
    request_of = {
        port: build_request(args.host, port, chat_body(args.body, args.stream))
        for port in args.ports
    }
    conns: dict[int, ClientProtocol] = {}
    for port in args.ports:
        _, conns[port] = await loop.create_connection(ClientProtocol, args.host, port)

    async def turn(port: int, settle: float, seconds: float) -> list[float]:
        proto, request = conns[port], request_of[port]
        latencies: list[float] = []
        now = time.perf_counter()
        start, end = now + settle, now + settle + seconds
        while now < end:
            t0 = time.perf_counter()
            status = await proto.roundtrip(request)
            now = time.perf_counter()
            if status != 200:
                raise RuntimeError(f"port {port}: status {status}")
            if now >= start:
                latencies.append(now - t0)
        return latencies

    for port in args.ports:  # warm-up, as a plain run has
        await turn(port, args.warmup, 0.0)
    p50s: dict[int, list[float]] = {port: [] for port in args.ports}
    counts = dict.fromkeys(args.ports, 0)
    for round_ in range(args.rounds):
        shift = round_ % len(args.ports)
        for port in args.ports[shift:] + args.ports[:shift]:
            latencies = sorted(await turn(port, args.settle, args.slice))
            counts[port] += len(latencies)
            p50s[port].append(latencies[len(latencies) // 2] * 1000 if latencies else float("nan"))
    for proto in conns.values():
        if proto.transport is not None:
            proto.transport.close()
    return {str(port): {"p50_ms": p50s[port], "requests": counts[port]} for port in args.ports}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int)
    parser.add_argument("--ports", type=int, nargs="+", help="paired c1 turns (see above)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--slice", type=float, default=0.25)
    parser.add_argument("--settle", type=float, default=0.02)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--body", choices=["small", "30k"], default="small")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument(
        "--header", action="append", default=[], help="`name: value`, added to each request"
    )
    args = parser.parse_args()
    import uvloop

    if args.ports:
        print(json.dumps(uvloop.run(run_paired(args))))
        return
    if args.port is None:
        parser.error("--port or --ports is required")
    print(json.dumps(uvloop.run(run(args))))


if __name__ == "__main__":
    main()
