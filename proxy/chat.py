"""POST /v1/chat/completions: the request path, top to bottom.

read body -> check it -> count its tokens -> compaction step -> quota verdict -> forward ->
relay the reply.
Each step is a call into the module that owns it; this file is only the order of things.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response

from proxy import jsonbytes
from proxy.auth import Caller, ProxyKey, check_model
from proxy.compaction.protocol import Spend
from proxy.compactor import Control, compaction_error, model_of
from proxy.errors import ClientDisconnected, ProxyError, bad_request
from proxy.exchange import Exchange
from proxy.jsonspans import Parsed, Spans
from proxy.report import PASSTHROUGH
from proxy.settings import Settings
from proxy.usage import ChatTap
from proxy.validation import discard_messages, parse_chat, read_body


async def chat_completions(request: Request) -> Response:
    exchange = Exchange(request)
    state = exchange.state

    async def compact_and_forward(
        body: dict[str, Any],
        content: bytes,
        caller: Caller,
        control: Control,
        parsed: Parsed,
        scope: str | None,
        tap: ChatTap | None,
    ) -> tuple[httpx.Response, Mapping[str, str]]:
        """Everything that waits on someone else, so one disconnect watcher covers it all."""
        outcome = exchange.compacted(
            await state.compactor.run(
                body,
                control,
                client_headers=caller.summarizer_headers(
                    exchange.client_headers, exchange.request_id
                ),
                scope=scope,
                parsed=parsed,
                spend=None if tap is None else tap.spend,
            )
        )
        if outcome.rejected:  # failed under on_error = "reject"
            raise compaction_error(outcome)
        tokens = exchange.record.tokens_after
        if tokens is None and state.quotas.counts_tokens(caller.key):  # not counted (mode off)
            tokens = await state.counter.acount_request(body)
        if tap is not None:
            tap.outcome = outcome
        verdict = await exchange.charge(caller.key, tokens or 0)
        if verdict.refusal is not None:
            raise verdict.refusal
        if outcome.messages is not None:
            content = reencode(body, outcome.messages, content, parsed.spans)
        response = await exchange.open(
            "POST", "chat/completions", headers=exchange.upstream_headers(), content=content
        )
        return response, verdict.headers

    try:
        caller = exchange.admit()
        raw = await read_body(request, state.settings.server.max_body_bytes)
        scope = state.gate.scope(caller, exchange.client_headers)
        # Kept for the next turn only when the compaction step will use what it derives.
        memo = state.turns if compacts(request, caller, state.settings) else None
        body, spans = await parse_chat(raw, state.settings.server.max_messages, memo, scope)
        parsed = Parsed(raw, spans)
        exchange.describe(body)
        control = parse_control(request)
        content, hide_usage = raw, False
        model = model_of(body)
        tap: ChatTap | None = None
        if caller.key is not None:
            check_model(caller.key, model)
            control = key_control(request, control, caller.key)
            asked = state.meter.with_stream_usage(body, raw)
            if asked is not None:
                (body, content), hide_usage = asked, True
            # Accounted from here on, its summarizer calls as they answer (see unanswered).
            tap = exchange.usage = state.meter.tap(
                caller.key.id, model, PASSTHROUGH, hide_usage=hide_usage, spend=Spend()
            )
        response, quota_headers = await exchange.guard(
            lambda: compact_and_forward(body, content, caller, control, parsed, scope, tap)
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


def compacts(request: Request, caller: Caller, settings: Settings) -> bool:
    """Whether the compaction step will run (count, maybe cut): not with `x-compaction: off`
    (or a key's mode "off" when the request does not say), nor with compaction disabled."""
    if not settings.compaction.enabled:
        return False
    mode = request.headers.get("x-compaction")
    if mode is None:
        return caller.key is None or caller.key.mode != "off"
    return mode.strip().lower() != "off"


def key_control(request: Request, control: Control, key: ProxyKey) -> Control:
    """A key's compaction defaults; the request's own control headers still win."""
    if key.mode is None and key.budget_tokens is None and key.strategy is None:
        return Control(control.mode, control.budget, prepare=key.prepare)
    mode = control.mode
    if key.mode is not None and "x-compaction" not in request.headers:
        mode = key.mode
    budget = control.budget if control.budget is not None else key.budget_tokens
    return Control(mode=mode, budget=budget, strategy=key.strategy, prepare=key.prepare)


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
        if not _is_positive_integer(raw_budget):
            raise bad_request(
                f"Invalid x-compaction-budget header {raw_budget!r}: expected a positive integer.",
                param="x-compaction-budget",
                code="invalid_header",
            )
        budget = int(raw_budget.strip())
    return Control(mode=mode, budget=budget)  # type: ignore[arg-type]


def _is_positive_integer(text: str) -> bool:
    """ASCII digits only: `str.isdigit` also accepts '²' or '٣', which `int` refuses or reads."""
    text = text.strip()
    return text.isascii() and text.isdigit() and int(text) > 0


def reencode(
    body: dict[str, Any],
    messages: list[Any],
    content: bytes | None = None,
    spans: Spans | None = None,
) -> bytes:
    """The client's body with only `messages` replaced; every other field kept as sent, and
    the client's own messages as their own bytes when `spans` knows them."""
    if spans is not None and content is not None:
        spliced = spans.splice(content, messages, jsonbytes.forwarded_message)
        if spliced is not None:
            return spliced
    return jsonbytes.forwarded({**body, "messages": messages})
