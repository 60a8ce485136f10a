"""Every other route under /v1/: relayed to the same path under the upstream base URL."""

from __future__ import annotations

from collections.abc import Awaitable

import httpx
from starlette.requests import Request
from starlette.responses import Response

from proxy.errors import ClientDisconnected, ProxyError
from proxy.exchange import Exchange
from proxy.upstream import RequestContent
from proxy.validation import read_body


async def passthrough(request: Request) -> Response:
    """Relay any method and body. Bodies up to server.max_body_bytes are read first so that a
    client disconnect can cancel the upstream call; bigger uploads are streamed through."""
    exchange = Exchange(request)
    headers = exchange.upstream_headers()
    length = request.headers.get("content-length")
    chunked = "chunked" in request.headers.get("transfer-encoding", "").lower()
    limit = exchange.state.settings.server.max_body_bytes
    content: RequestContent | None = None
    watch = True
    try:
        if length is not None and length.isdigit() and int(length) <= limit:
            content = await read_body(request, limit)
        elif length is not None or chunked:
            content = request.stream()
            watch = False  # `receive` belongs to the upload until it ends
            if length is not None:
                headers.append(("content-length", length))

        def send() -> Awaitable[httpx.Response]:
            return exchange.open(
                request.method, request.path_params["path"], headers=headers, content=content
            )

        response = await (exchange.guard(send) if watch else send())
    except ProxyError as exc:
        return exchange.error(exc)
    except ClientDisconnected:
        return exchange.disconnected()
    return await exchange.relay(response)
