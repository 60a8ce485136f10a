"""POST /v1/compress: this proxy's compaction as a compression engine for another gateway.

The contract agentgateway's `contextCompression` policy calls (Headroom's shape):

    POST /v1/compress  {"messages": [...], "model": "gpt-4o"}
    200                {"messages": [...], "tokens_saved": 11500}

`messages` are the request's own messages, as the gateway got them: chat completions
messages, or the Responses API's `input` items (told apart by their `type` fields). They go
through the same compaction step as a forwarded request (the budget from the request's
`x-compaction-budget`, the key's policy or the configuration; the same strategies, summary
store, key and scope), and come back compacted when they are over the budget, unchanged
otherwise (`tokens_saved` 0). Messages in Anthropic's shape (`tool_use` / `tool_result`
blocks) are returned unchanged: the adapters read OpenAI's shapes only.

Nothing goes upstream but the summarizer's calls (accounted to the key); the request is not
charged to the key's quotas, since the compressed request itself does not pass here.
Errors are OpenAI's envelope with a 4xx; a failed compaction under `on_error = "reject"`
is a 502 (the gateway then fails open or closed, as its policy says).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from proxy import jsonbytes
from proxy.auth import check_model
from proxy.compaction.protocol import Spend
from proxy.compactor import Api, compaction_error
from proxy.errors import ClientDisconnected, ProxyError, bad_request
from proxy.exchange import Exchange
from proxy.forwarding import read_control
from proxy.jsonspans import Parsed
from proxy.report import PASSTHROUGH, Outcome
from proxy.usage import ChatTap
from proxy.validation import Shape, check_chat_body, check_objects, parse_history, read_body

_ANTHROPIC_BLOCKS = frozenset({"tool_use", "tool_result"})


def check_compress_body(body: dict[str, Any], max_items: int = 0) -> None:
    """`messages`: an array of objects (chat messages or Responses items); `model`: a string
    when given."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request(
            "Missing required parameter: 'messages' (an array of messages).",
            param="messages",
            code="missing_required_parameter",
        )
    check_objects(messages, "messages", max_items)
    if messages and not any("type" in m for m in messages):
        check_chat_body(body, max_items)  # chat messages: each with a known role
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("Invalid 'model': expected a string.", param="model", code="invalid_type")


COMPRESS = Shape("messages", check_compress_body)


async def compress(request: Request) -> Response:
    exchange = Exchange(request)
    state = exchange.state
    try:
        caller = exchange.admit()
        control = read_control(request, caller.key)
        raw = await read_body(request, state.settings.server.max_body_bytes)
        body, spans = await parse_history(COMPRESS, raw, state.settings.server.max_messages)
        messages: list[Any] = body["messages"]
        model = body.get("model") or ""
        exchange.describe(body)
        tap: ChatTap | None = None
        if caller.key is not None:
            if model:
                check_model(caller.key, model)
            # Only the summarizer's calls are billed: recorded once the step is over.
            tap = exchange.usage = state.meter.tap(
                caller.key.id, model, PASSTHROUGH, hide_usage=False, spend=Spend(),
                team=caller.key.team,
            )  # fmt: skip
        api = api_for(state.compactor, messages)
        scope = state.gate.scope(caller, exchange.client_headers)

        async def step() -> Outcome:
            if not messages:
                return state.compactor.skipped("nothing_to_compact", model)
            if api is None:
                return state.compactor.skipped("unsupported_format", model)
            return await state.compactor.run(
                {"model": model, api.field: messages},
                control,
                client_headers=caller.summarizer_headers(
                    exchange.client_headers, exchange.request_id
                ),
                scope=scope,
                parsed=Parsed(raw, spans),
                spend=None if tap is None else tap.spend,
                api=api,
            )

        outcome = exchange.compacted(await exchange.guard(step))
        if outcome.rejected:
            raise compaction_error(outcome)
    except ProxyError as exc:
        exchange.unanswered(sent=False)
        return exchange.error(exc, exchange.compaction_headers())
    except ClientDisconnected:
        exchange.unanswered(sent=False)
        return exchange.disconnected()
    # Never a request upstream: the key's usage records its summarizer calls only.
    exchange.unanswered(sent=False)
    before, after = outcome.tokens_before, outcome.tokens_after
    saved = before - after if before is not None and after is not None and after < before else 0
    out = outcome.messages if outcome.messages is not None else messages
    content = jsonbytes.forwarded({"messages": out, "tokens_saved": saved})
    headers = exchange.compaction_headers()
    return Response(content, media_type="application/json", headers=headers)


def api_for(compactor: Any, messages: list[Any]) -> Api | None:
    """The adapter for `messages`: Responses items carry a `type`, chat messages do not;
    None for Anthropic's content blocks."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(
            isinstance(part, dict) and part.get("type") in _ANTHROPIC_BLOCKS for part in content
        ):
            return None
    if not messages:
        return None
    if any("type" in message for message in messages):
        api: Api = compactor.responses
        return api
    chat: Api = compactor.chat
    return chat
