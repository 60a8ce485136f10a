"""The bare Starlette + httpx relay: the baseline of this stack (no checks, no compaction).

uvicorn --factory bench.relay:create_app; BENCH_UPSTREAM = upstream URL; BENCH_TRANSPORT = a
client name from bench/transports.py (default: a plain `httpx.AsyncClient()`, as one writes it).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

HOP = {"connection", "keep-alive", "transfer-encoding", "host", "content-length", "upgrade"}


def create_app() -> Starlette:
    upstream = os.environ.get("BENCH_UPSTREAM", "http://127.0.0.1:9000")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        from bench.transports import make_client

        async with make_client(os.environ.get("BENCH_TRANSPORT", "httpx")) as client:
            app.state.client = client
            yield

    async def relay(request: Request) -> Response:
        client: httpx.AsyncClient = request.app.state.client
        headers = [(k, v) for k, v in request.headers.raw if k.decode() not in HOP]
        upstream_request = client.build_request(
            request.method, upstream + request.url.path, headers=headers,
            content=await request.body(), params=request.query_params,
        )  # fmt: skip
        response = await client.send(upstream_request, stream=True)
        out = [(k, v) for k, v in response.headers.raw if k.decode().lower() not in HOP]
        relayed = StreamingResponse(
            response.aiter_raw(), response.status_code, background=BackgroundTask(response.aclose)
        )
        relayed.raw_headers = [*relayed.raw_headers, *out]
        return relayed

    routes = [Route("/{path:path}", relay, methods=["GET", "POST"])]
    return Starlette(routes=routes, lifespan=lifespan)
