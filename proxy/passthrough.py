"""Every other route under /v1/: relayed to the same path under the upstream base URL."""

from __future__ import annotations

import logging
from collections.abc import Awaitable

import httpx
from starlette.requests import Request
from starlette.responses import Response

from proxy.disconnect import cancel_on_disconnect
from proxy.errors import ClientDisconnected, ProxyError
from proxy.headers import client_headers_of, request_id_of, upstream_request_headers
from proxy.state import ProxyState
from proxy.upstream import RequestContent
from proxy.validation import read_body

log = logging.getLogger("proxy.passthrough")


async def passthrough(request: Request) -> Response:
    """Relay any method and body. Bodies up to server.max_body_bytes are read first so that a
    client disconnect can cancel the upstream call; bigger uploads are streamed through."""
    state: ProxyState = request.app.state.proxy
    client_headers = client_headers_of(request.scope)
    request_id = request_id_of(client_headers)
    headers = upstream_request_headers(
        client_headers, request_id=request_id, api_key=state.upstream.api_key
    )
    length = request.headers.get("content-length")
    chunked = "chunked" in request.headers.get("transfer-encoding", "").lower()
    limit = state.settings.server.max_body_bytes
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
            return state.upstream.open(
                request.method,
                request.path_params["path"],
                headers=headers,
                content=content,
                query=request.scope.get("query_string", b""),
            )

        response = await (cancel_on_disconnect(request.receive, send) if watch else send())
    except ProxyError as exc:
        return exc.response({"x-request-id": request_id})
    except ClientDisconnected:
        log.info("client disconnected before the upstream answered request_id=%s", request_id)
        return Response(status_code=499)
    return await state.upstream.relay(response, request_id)
