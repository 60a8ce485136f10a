"""Which upstream transport for httpx? The bare relay (bench/relay.py) run with each candidate.

    python -m bench.transports [--duration 3] [--repeats 1] [--concurrency 1 16 64]
                               [--baseline PATH]

Candidates (all behind the same `httpx.AsyncClient` API):
  httpx           httpx.AsyncClient() as one writes it (httpcore: 100 connections, 20 kept)
  httpx-limits    plain httpx with our settings' limits (1000 connections, 200 kept alive)
  sharded-8       8 small httpcore pools behind one transport, least-loaded first
  httpx-aiohttp   the httpx-aiohttp package's AiohttpTransport (pip install httpx-aiohttp)
  proxy           proxy.transport.create_upstream_client: aiohttp behind the app's own thin
                  transport (what the proxy runs)
  wire            (only with --baseline PATH) the same from another source tree: the small
                  httptools client the proxy had before aiohttp (`proxy.wire`)
  httpx-h2        (only with --h2) httpx over HTTP/2 to an h2c upstream: hypercorn + h2
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx

from bench import harness

LIMITS = httpx.Limits(max_connections=1000, max_keepalive_connections=200, keepalive_expiry=30)
NAMES = ["httpx", "httpx-limits", "sharded-8", "httpx-aiohttp", "proxy"]


class _Counted(httpx.AsyncByteStream):
    def __init__(self, stream: httpx.AsyncByteStream, counts: list[int], shard: int) -> None:
        self._stream, self._counts, self._shard, self._open = stream, counts, shard, True

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        if self._open:
            self._open = False
            self._counts[self._shard] -= 1
            await self._stream.aclose()


class ShardedTransport(httpx.AsyncBaseTransport):
    """Several small httpcore pools; each request goes to the one with fewest in flight."""

    def __init__(self, shards: int, limits: httpx.Limits) -> None:
        def part(n: int | None) -> int | None:
            return None if n is None else math.ceil(n / shards)

        small = httpx.Limits(
            max_connections=part(limits.max_connections),
            max_keepalive_connections=part(limits.max_keepalive_connections),
            keepalive_expiry=limits.keepalive_expiry,
        )
        self._shards = [httpx.AsyncHTTPTransport(limits=small) for _ in range(shards)]
        self._counts = [0] * shards

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        counts = self._counts
        i = counts.index(min(counts))
        counts[i] += 1
        try:
            response = await self._shards[i].handle_async_request(request)
        except BaseException:
            counts[i] -= 1
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_Counted(response.stream, counts, i),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        for shard in self._shards:
            await shard.aclose()


def make_client(name: str) -> httpx.AsyncClient:
    if name == "httpx":
        return httpx.AsyncClient()
    if name == "httpx-limits":
        return httpx.AsyncClient(limits=LIMITS)
    if name.startswith("sharded-"):
        return httpx.AsyncClient(transport=ShardedTransport(int(name.split("-")[1]), LIMITS))
    if name == "httpx-h2":  # prior-knowledge HTTP/2 (h2c): needs `pip install h2`
        return httpx.AsyncClient(http1=False, http2=True, limits=LIMITS)
    if name == "httpx-aiohttp":
        from httpx_aiohttp import AiohttpTransport

        return httpx.AsyncClient(transport=AiohttpTransport(limits=LIMITS))
    if name == "proxy":
        from proxy.settings import UpstreamSettings
        from proxy.transport import create_upstream_client

        return create_upstream_client(UpstreamSettings(base_url="http://127.0.0.1"))
    raise ValueError(f"unknown transport {name!r}; one of {NAMES}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--transports", nargs="+", default=NAMES)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--stream", nargs="+", choices=["no", "yes"], default=["no", "yes"])
    parser.add_argument("--body", choices=["small", "30k"], default="small")
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--server", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument(
        "--baseline", type=Path, default=None,
        help="another source tree: adds the `wire` candidate (its `proxy` transport)",
    )  # fmt: skip
    parser.add_argument(
        "--h2", action="store_true", help="hypercorn upstream (h1 + h2c); default transports "
        "httpx, httpx-h2, proxy (needs `pip install h2 hypercorn`)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.h2 and args.transports == NAMES:
        args.transports = ["httpx", "httpx-h2", "proxy"]
    if args.baseline is not None and "wire" not in args.transports:
        args.transports.append("wire")

    results: dict[tuple[str, int, str], list[harness.Result]] = {}
    kind = "hypercorn" if args.h2 else "fast"
    with (
        harness.upstream(kind) as up_port,
        _relays(args.transports, up_port, args.server, args.baseline) as ports,
    ):
        for _ in range(args.repeats):
            for conc in args.concurrency:
                for stream in args.stream:
                    for name in args.transports:
                        srv = ports[name]
                        r = harness.load(
                            srv.port, conc, args.body, stream == "yes", args.duration,
                            args.warmup, srv.pid,
                        )  # fmt: skip
                        results.setdefault((name, conc, stream), []).append(r)
    print(
        f"\nrelay x transport, body={args.body}, server={args.server}, upstream={kind}, "
        f"pinned={harness.PINNED}, {args.repeats} interleaved repeat(s) x {args.duration}s"
    )
    header = ["transport", "conc", "stream", "req/s", "p50 ms", "p99 ms", "CPU us/req", "vs httpx",
              "vs own c1", "errors"]  # fmt: skip
    rows = []
    for conc in args.concurrency:
        for stream in args.stream:
            for name in args.transports:
                r = harness.median_result(results[(name, conc, stream)])
                base = harness.median_result(results.get(("httpx", conc, stream)) or [r])
                own1 = harness.median_result(
                    results.get((name, min(args.concurrency), stream)) or [r]
                )
                rows.append([
                    name, str(conc), stream, f"{r.rps:,.0f}", f"{r.p50_ms:.2f}",
                    f"{r.p99_ms:.2f}", f"{r.cpu_us:.0f}", f"{r.rps / base.rps:.2f}x",
                    f"{r.rps / own1.rps:.2f}x", str(r.errors),
                ])  # fmt: skip
    harness.print_table(header, rows)


@contextlib.contextmanager
def _relays(
    names: list[str], up_port: int, kind: str, baseline: Path | None = None
) -> Iterator[dict[str, harness.Server]]:
    """One relay per transport, all pinned to the server CPU (idle ones cost nothing); `wire`
    is the baseline tree's relay with its own `proxy` transport."""
    with contextlib.ExitStack() as stack:
        servers = {}
        for name in names:
            port = harness.free_port()
            tree = harness.ROOT
            transport = name
            if name == "wire":
                if baseline is None:
                    raise ValueError("the wire candidate needs --baseline PATH")
                tree, transport = baseline.resolve(), "proxy"
            env = {"BENCH_UPSTREAM": f"http://127.0.0.1:{up_port}", "BENCH_TRANSPORT": transport}
            cmd = harness.uvicorn_cmd("bench.relay:create_app", port, kind)
            servers[name] = stack.enter_context(harness.server(cmd, port, env, cwd=tree))
        yield servers


if __name__ == "__main__":
    main()
