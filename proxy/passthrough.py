"""Every other route under /v1/: relayed to the same path under the upstream base URL.

The path goes up as the client wrote it (percent-encodings kept), never above the base path
(proxy/paths.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import httpx
from starlette.requests import Request
from starlette.responses import Response

from proxy.auth import check_model
from proxy.errors import ClientDisconnected, ProxyError
from proxy.exchange import Exchange
from proxy.paths import upstream_path
from proxy.report import PASSTHROUGH
from proxy.upstream import RequestContent
from proxy.usage import ChatTap
from proxy.validation import Upload, read_body


async def passthrough(request: Request) -> Response:
    """Relay any method and body. Bodies up to server.max_body_bytes are read first so that a
    client disconnect can cancel the upstream call; bigger uploads are streamed through."""
    exchange = Exchange(request)
    length = request.headers.get("content-length")
    chunked = "chunked" in request.headers.get("transfer-encoding", "").lower()
    limit = exchange.state.settings.server.max_body_bytes
    content: RequestContent | None = None
    upload: Upload | None = None
    watch = True
    tap: ChatTap | None = None
    try:
        path = upstream_path(request.scope)
        caller = exchange.admit()
        headers = exchange.upstream_headers()
        if length is not None and length.isdigit() and int(length) <= limit:
            content = await read_body(request, limit)
            if caller.key is not None:
                model = model_in(content)
                check_model(caller.key, model)
                if model and request.method == "POST":  # a billed call: embeddings, responses...
                    tap = exchange.usage = exchange.state.meter.tap(
                        caller.key.id, model, PASSTHROUGH, hide_usage=False, team=caller.key.team
                    )
        elif length is not None or chunked:
            upload = Upload(request)
            content = upload.chunks()
            watch = False  # `receive` belongs to the upload until it ends
            if length is not None:
                headers.append(("content-length", length))

        async def charge_and_send() -> tuple[httpx.Response, Mapping[str, str]]:
            reserve = exchange.state.quotas.estimate_content(caller.key, content)
            verdict = await exchange.charge(caller.key, 0, reserve)
            if verdict.refusal is not None:
                raise verdict.refusal
            response = await exchange.open(request.method, path, headers=headers, content=content)
            return response, verdict.headers

        try:
            response, quota_headers = await (
                exchange.guard(charge_and_send) if watch else charge_and_send()
            )
        except ProxyError:
            if upload is not None:
                upload.raise_if_gone()
            raise
    except ProxyError as exc:
        exchange.unanswered(sent=not exc.unsent)
        return exchange.error(exc)
    except ClientDisconnected:
        exchange.unanswered(sent=True)
        return exchange.disconnected()
    return await exchange.relay(response, quota_headers, tap, watch=watch)


def model_in(content: bytes) -> str:
    """The `model` of a JSON body ("" if none): keys' allowed_models apply to every route."""
    if b'"model"' not in content:
        return ""
    try:
        data = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return ""
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else ""
