"""POST /v1/chat/completions: the request path, top to bottom.

read body -> check it -> count its tokens -> compaction step -> quota verdict -> forward ->
relay the reply.
Each step is a call into the module that owns it; this file is only the order of things
(the steps it shares with the Responses API's route are in proxy/forwarding.py).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from proxy.auth import check_model
from proxy.compaction.protocol import Spend
from proxy.compactor import model_of
from proxy.errors import ClientDisconnected, ProxyError
from proxy.exchange import Exchange
from proxy.forwarding import compact_and_forward, compacts, read_control
from proxy.forwarding import reencode as reencode
from proxy.jsonspans import Parsed
from proxy.report import PASSTHROUGH
from proxy.usage import ChatTap, end_user
from proxy.validation import discard_messages, parse_chat, read_body


async def chat_completions(request: Request) -> Response:
    exchange = Exchange(request)
    state = exchange.state
    try:
        caller = exchange.admit()
        control = read_control(request, caller.key)
        raw = await read_body(request, state.settings.server.max_body_bytes)
        scope = state.gate.scope(caller, exchange.client_headers)
        # Kept for the next turn only when the compaction step will use what it derives.
        memo = state.turns if compacts(control, state.settings) else None
        body, spans = await parse_chat(raw, state.settings.server.max_messages, memo, scope)
        parsed = Parsed(raw, spans)
        exchange.describe(body)
        content, hide_usage = raw, False
        model = model_of(body)
        tap: ChatTap | None = None
        if caller.key is not None:
            check_model(caller.key, model)
            asked = state.meter.with_stream_usage(body, raw)
            if asked is not None:
                (body, content), hide_usage = asked, True
            # Accounted from here on, its summarizer calls as they answer (see unanswered).
            tap = exchange.usage = state.meter.tap(
                caller.key.id, model, PASSTHROUGH, hide_usage=hide_usage, spend=Spend(),
                team=caller.key.team, user=end_user(body),
            )  # fmt: skip
        chat = state.compactor.chat
        step = (exchange, "chat/completions", chat, body, content, caller, control, parsed)
        response, quota_headers = await exchange.guard(
            lambda: compact_and_forward(*step, scope, tap)
        )
        if memo is None:  # (a kept body's messages are the memo's, and freed with it)
            await discard_messages(body)  # sent: only `model` is read from here on
    except ProxyError as exc:  # (502/504 from the upstream: `unsent` when it never had it)
        exchange.unanswered(sent=not exc.unsent)
        return exchange.error(exc, exchange.compaction_headers())
    except ClientDisconnected:
        exchange.unanswered(sent=True)
        return exchange.disconnected()
    headers = {**exchange.compaction_headers(), **quota_headers}
    return await exchange.relay(response, headers, tap)
