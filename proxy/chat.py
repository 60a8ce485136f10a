"""POST /v1/chat/completions: the request path, top to bottom.

read body -> check it -> count its tokens -> compaction step -> forward -> relay the reply.
Each step is a call into the module that owns it; this file is only the order of things.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response

from proxy.compactor import Control, summarizer_headers
from proxy.disconnect import cancel_on_disconnect
from proxy.errors import ClientDisconnected, ProxyError, bad_request
from proxy.headers import client_headers_of, request_id_of, upstream_request_headers
from proxy.report import Outcome
from proxy.state import ProxyState
from proxy.validation import parse_chat_body, read_body

log = logging.getLogger("proxy.chat")


async def chat_completions(request: Request) -> Response:
    state: ProxyState = request.app.state.proxy
    started = time.perf_counter()
    client_headers = client_headers_of(request.scope)
    request_id = request_id_of(client_headers)
    outcome = Outcome()
    overhead_ms = 0.0

    async def compact_and_forward(body: dict[str, Any], raw: bytes) -> httpx.Response:
        """Everything that waits on someone else, so one disconnect watcher covers it all."""
        nonlocal outcome, overhead_ms
        outcome = await state.compactor.run(
            body,
            parse_control(request),
            client_headers=summarizer_headers(client_headers),
            request_id=request_id,
        )
        content = raw if outcome.messages is None else reencode(body, outcome.messages)
        headers = upstream_request_headers(
            client_headers, request_id=request_id, api_key=state.upstream.api_key
        )
        overhead_ms = (time.perf_counter() - started) * 1000
        return await state.upstream.open(
            "POST",
            "chat/completions",
            headers=headers,
            content=content,
            query=request.scope.get("query_string", b""),
        )

    try:
        raw = await read_body(request, state.settings.server.max_body_bytes)
        body = parse_chat_body(raw)
        response = await cancel_on_disconnect(
            request.receive, lambda: compact_and_forward(body, raw)
        )
    except ProxyError as exc:
        return exc.response(_response_headers(outcome, started, request_id))
    except ClientDisconnected:
        log.info("client disconnected before the upstream answered request_id=%s", request_id)
        return Response(status_code=499)
    return await state.upstream.relay(response, request_id, outcome.headers(overhead_ms))


def _response_headers(outcome: Outcome, started: float, request_id: str) -> dict[str, str]:
    headers = outcome.headers((time.perf_counter() - started) * 1000)
    headers["x-request-id"] = request_id
    return headers


def parse_control(request: Request) -> Control:
    """The per-request control headers: `x-compaction: off|force|auto`, `x-compaction-budget: N`."""
    mode = request.headers.get("x-compaction", "auto").strip().lower() or "auto"
    if mode not in ("auto", "off", "force"):
        raise bad_request(
            f"Invalid x-compaction header {mode!r}: expected 'auto', 'off' or 'force'.",
            param="x-compaction",
            code="invalid_header",
        )
    budget: int | None = None
    raw_budget = request.headers.get("x-compaction-budget")
    if raw_budget is not None:
        if not raw_budget.strip().isdigit() or int(raw_budget) <= 0:
            raise bad_request(
                f"Invalid x-compaction-budget header {raw_budget!r}: expected a positive integer.",
                param="x-compaction-budget",
                code="invalid_header",
            )
        budget = int(raw_budget)
    return Control(mode=mode, budget=budget)  # type: ignore[arg-type]


def reencode(body: dict[str, Any], messages: list[Any]) -> bytes:
    """The client's body with only `messages` replaced; every other field kept as sent."""
    return json.dumps(
        {**body, "messages": messages}, ensure_ascii=False, separators=(",", ":")
    ).encode("utf-8")
