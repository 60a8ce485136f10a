"""POST /v1/chat/completions: the request path, top to bottom.

read body -> check it -> count its tokens -> compaction step -> forward -> relay the reply.
Each step is a call into the module that owns it; this file is only the order of things.
"""

from __future__ import annotations

from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response

from proxy import jsonbytes
from proxy.compactor import Control, summarizer_headers
from proxy.errors import ClientDisconnected, ProxyError, bad_request
from proxy.exchange import Exchange
from proxy.validation import parse_chat_request, read_body


async def chat_completions(request: Request) -> Response:
    exchange = Exchange(request)
    state = exchange.state

    async def compact_and_forward(body: dict[str, Any], raw: bytes) -> httpx.Response:
        """Everything that waits on someone else, so one disconnect watcher covers it all."""
        outcome = exchange.compacted(
            await state.compactor.run(
                body,
                parse_control(request),
                client_headers=summarizer_headers(exchange.client_headers, exchange.request_id),
            )
        )
        content = raw if outcome.messages is None else reencode(body, outcome.messages)
        return await exchange.open(
            "POST", "chat/completions", headers=exchange.upstream_headers(), content=content
        )

    try:
        raw = await read_body(request, state.settings.server.max_body_bytes)
        body = await parse_chat_request(raw, state.settings.server.max_messages)
        exchange.describe(body)
        response = await exchange.guard(lambda: compact_and_forward(body, raw))
    except ProxyError as exc:
        return exchange.error(exc, exchange.compaction_headers())
    except ClientDisconnected:
        return exchange.disconnected()
    return await exchange.relay(response, exchange.compaction_headers())


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
    return jsonbytes.forwarded({**body, "messages": messages})
