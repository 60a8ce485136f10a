"""POST /v1/responses: the Responses API's request path, top to bottom.

read body -> check it -> compaction step (stateless requests: the whole history is the
`input` list) -> quota verdict -> forward -> relay the reply, its usage read from the JSON
reply or the stream's `response.completed` event.

Left alone, reported `skipped`: a request whose history lives upstream
(`previous_response_id`, `conversation`: reason `server_state`), one whose `input` is not a
list of items (`nothing_to_compact`), and a client's own compaction request (Codex's
"context checkpoint compaction" turn, sent with no tools, or an `input` ending in a
`compaction_trigger` item: reason `client_compaction`), which must reach the model as sent.

A WebSocket upgrade on this path is refused at once with 426 (`refuse_websocket`): clients
that try one first (Codex) fall back to HTTP, where compaction happens.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.websockets import WebSocket

from proxy.auth import check_model
from proxy.compaction.protocol import Spend
from proxy.compaction.render import content_text
from proxy.compactor import model_of
from proxy.errors import ClientDisconnected, ProxyError
from proxy.exchange import Exchange
from proxy.forwarding import compact_and_forward, compacts, read_control
from proxy.jsonspans import Parsed
from proxy.report import PASSTHROUGH
from proxy.usage import ChatTap, end_user
from proxy.validation import discard_messages, parse_responses, read_body

# What Codex's own compaction request asks in its last user message.
CLIENT_COMPACTION = "context checkpoint compaction"


async def responses(request: Request) -> Response:
    exchange = Exchange(request)
    state = exchange.state
    try:
        caller = exchange.admit()
        control = read_control(request, caller.key)
        raw = await read_body(request, state.settings.server.max_body_bytes)
        scope = state.gate.scope(caller, exchange.client_headers)
        runs = compacts(control, state.settings)
        memo = state.turns if runs else None
        body, spans = await parse_responses(raw, state.settings.server.max_messages, memo, scope)
        parsed = Parsed(raw, spans)
        exchange.describe(body)
        model = model_of(body)
        tap: ChatTap | None = None
        if caller.key is not None:
            check_model(caller.key, model)
            # The stream's `response.completed` and the JSON reply always carry `usage`.
            tap = exchange.usage = state.meter.tap(
                caller.key.id, model, PASSTHROUGH, hide_usage=False, spend=Spend(),
                team=caller.key.team, user=end_user(body),
            )  # fmt: skip
        api = state.compactor.responses
        skip = skip_reason(body) if runs else None
        step = (exchange, "responses", api, body, raw, caller, control, parsed, scope, tap)
        response, quota_headers = await exchange.guard(
            lambda: compact_and_forward(*step, skip=skip)
        )
        if memo is None:
            await discard_messages(body, "input")  # sent: only `model` is read from here on
    except ProxyError as exc:  # (502/504 from the upstream: `unsent` when it never had it)
        exchange.unanswered(sent=not exc.unsent)
        return exchange.error(exc, exchange.compaction_headers())
    except ClientDisconnected:
        exchange.unanswered(sent=True)
        return exchange.disconnected()
    headers = {**exchange.compaction_headers(), **quota_headers}
    return await exchange.relay(response, headers, tap)


def skip_reason(body: dict[str, Any]) -> str | None:
    """Why the compaction step must leave this request alone (see the module docstring)."""
    if body.get("previous_response_id") is not None or body.get("conversation") is not None:
        return "server_state"
    items = body.get("input")
    if not isinstance(items, list) or not items:
        return "nothing_to_compact"
    if is_client_compaction(body, items):
        return "client_compaction"
    return None


def is_client_compaction(body: dict[str, Any], items: list[Any]) -> bool:
    """A client compacting its own history: an `input` ending in a `compaction_trigger`, or
    no tools and a last user message asking for a context checkpoint compaction."""
    last = items[-1]
    if isinstance(last, dict) and last.get("type") == "compaction_trigger":
        return True
    if body.get("tools") not in ([], None):
        return False
    for item in reversed(items):
        if isinstance(item, dict) and item.get("role") == "user":
            text = content_text(item.get("content"))
            return CLIENT_COMPACTION in text[:400].lower()
    return False


async def refuse_websocket(websocket: WebSocket) -> None:
    """A WebSocket upgrade on /v1/responses: 426 at once, which Codex takes as "use HTTP"
    (after one attempt; a 403 or 404 costs it 7 attempts over ~6 s). The HTTP path is the
    one that compacts."""
    body = json.dumps(
        {
            "error": {
                "message": "This proxy serves the Responses API over HTTP only (it compacts "
                "POST /v1/responses); WebSocket connections are not accepted.",
                "type": "invalid_request_error",
                "param": None,
                "code": "websocket_unsupported",
            }
        }
    ).encode()
    response = Response(body, status_code=426, media_type="application/json")
    try:
        await websocket.send_denial_response(response)
    except RuntimeError:  # a server without the denial-response extension: a plain refusal
        await websocket.close(code=1008)
