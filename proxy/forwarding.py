"""The steps every route whose requests carry a history shares: the per-request controls,
then compact -> charge the quota -> forward (proxy/chat.py, proxy/responses.py).

What differs between those routes is a value: the upstream path and the `Api` (the body
field holding the history, its adapter and its counter; proxy/compactor.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import httpx
from starlette.requests import Request

from proxy import jsonbytes
from proxy.audit.hook import audit
from proxy.auth import Caller, ProxyKey
from proxy.compactor import Api, Control, compaction_error
from proxy.errors import bad_request
from proxy.exchange import Exchange
from proxy.jsonspans import Parsed, Spans
from proxy.settings import Settings
from proxy.usage import ChatTap


async def compact_and_forward(
    exchange: Exchange,
    path: str,
    api: Api,
    body: dict[str, Any],
    content: bytes,
    caller: Caller,
    control: Control,
    parsed: Parsed,
    scope: str | None,
    tap: ChatTap | None,
    skip: str | None = None,
) -> tuple[httpx.Response, Mapping[str, str]]:
    """Everything that waits on someone else, so one disconnect watcher covers it all.
    Returns the upstream's response and the headers our reply adds (the key's remaining
    quota, the audit record's id).

    `skip`: the reason the compaction step leaves this request alone (not counted, not
    compacted, reported `skipped`), None to run it."""
    state = exchange.state
    compactor = state.compactor
    if skip is not None:
        outcome = exchange.compacted(compactor.skipped(skip, exchange.record.model or ""))
    else:
        outcome = exchange.compacted(
            await compactor.run(
                body,
                control,
                client_headers=caller.summarizer_headers(
                    exchange.client_headers, exchange.request_id
                ),
                scope=scope,
                parsed=parsed,
                spend=None if tap is None else tap.spend,
                api=api,
            )
        )
    if outcome.rejected:  # failed under on_error = "reject"
        raise compaction_error(outcome)
    audit_id = None
    if state.audit is not None and skip is None and api.field == "messages":  # chat only
        audit_id = audit(state, exchange.request_id, caller, body, outcome, control)
    tokens = exchange.record.tokens_after
    if tokens is None and state.quotas.counts_tokens(caller.key):  # not counted (off, skipped)
        tokens = await api.counter.acount_request(body)
    if tap is not None:
        tap.outcome = outcome
    reserve = state.quotas.estimate(caller.key, body, tokens or 0, outcome.usage)
    verdict = await exchange.charge(caller.key, tokens or 0, reserve)
    if verdict.refusal is not None:
        raise verdict.refusal
    if outcome.messages is not None:
        content = reencode(body, outcome.messages, content, parsed.spans, api.field)
    response = await exchange.open(
        "POST", path, headers=exchange.upstream_headers(), content=content
    )
    if audit_id is None:
        return response, verdict.headers
    return response, {**verdict.headers, "x-compaction-audit": audit_id}


def compacts(control: Control, settings: Settings) -> bool:
    """Whether the compaction step will run (count, maybe cut): not with `x-compaction: off`
    (or a key's mode "off" when the request does not say), nor with compaction disabled."""
    return settings.compaction.enabled and control.mode != "off"


def read_control(request: Request, key: ProxyKey | None) -> Control:
    """The request's compaction controls, its headers read once: `x-compaction:
    off|force|auto` and `x-compaction-budget: N`, over its proxy key's defaults (mode,
    budget, strategy, preparing ahead); what the request says wins. A bad value is a 400."""
    asked = request.headers.get("x-compaction")
    mode = None if asked is None else _mode(asked)
    budget = _budget(request.headers.get("x-compaction-budget"))
    if key is None:
        return Control(mode=mode or "auto", budget=budget)
    return Control(
        mode=mode or key.mode or "auto",
        budget=budget if budget is not None else key.budget_tokens,
        strategy=key.strategy,
        prepare=key.prepare,
    )


Mode = Literal["auto", "off", "force"]
_MODES: dict[str, Mode] = {"auto": "auto", "off": "off", "force": "force", "": "auto"}


def _mode(text: str) -> Mode:
    mode = _MODES.get(text.strip().lower())
    if mode is not None:
        return mode
    raise bad_request(
        f"Invalid x-compaction header {text.strip().lower()!r}: expected 'auto', 'off' or 'force'.",
        param="x-compaction",
        code="invalid_header",
    )


def _budget(text: str | None) -> int | None:
    if text is None:
        return None
    if not _is_positive_integer(text):
        raise bad_request(
            f"Invalid x-compaction-budget header {text!r}: expected a positive integer.",
            param="x-compaction-budget",
            code="invalid_header",
        )
    return int(text.strip())


def _is_positive_integer(text: str) -> bool:
    """ASCII digits only: `str.isdigit` also accepts '²' or '٣', which `int` refuses or reads."""
    text = text.strip()
    return text.isascii() and text.isdigit() and int(text) > 0


def reencode(
    body: dict[str, Any],
    messages: list[Any],
    content: bytes | None = None,
    spans: Spans | None = None,
    field: str = "messages",
) -> bytes:
    """The client's body with only `field` (its history) replaced; every other field kept as
    sent, and the client's own items as their own bytes when `spans` knows them."""
    if spans is not None and content is not None:
        spliced = spans.splice(content, messages, jsonbytes.forwarded_message)
        if spliced is not None:
            return spliced
    return jsonbytes.forwarded({**body, field: messages})
