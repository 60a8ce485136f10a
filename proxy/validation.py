"""Reading and checking a chat request body before anything else looks at it.

The checks are the minimum the proxy needs to do its job (a JSON object with a list of
messages that have roles, at most `server.max_messages` of them); everything else is the
upstream's to judge, so we forward it. Bodies are parsed message by message by
`proxy.jsonspans` (orjson, and where each message's bytes are); what it leaves to the stdlib
goes to `json.loads`, or over `OFFLOAD_BYTES` to `proxy.jsonparse`. Up to `INLINE_BYTES`
the span parser's fast path runs on the event loop; bigger bodies, and what the fast path
cannot do, are parsed in a worker thread, one message per GIL hold, so the event loop runs
between messages.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from typing import Any

import anyio.to_thread
from starlette.requests import ClientDisconnect, Request

from proxy import jsonparse, jsonspans
from proxy.connections import read_timed_out
from proxy.errors import ClientDisconnected, ProxyError, bad_request
from proxy.jsonspans import Spans
from proxy.turnmemo import TurnMemo

# Below this, json.loads on the loop takes under ~2 ms; above, a stdlib parse leaves the loop.
OFFLOAD_BYTES = 256 * 1024
# Below this, the span parser's fast path (one orjson call for the messages, ~1.6 ms/MB)
# runs on the loop: a worker thread's hop costs more than it saves. What it cannot parse
# goes to a worker thread as before.
INLINE_BYTES = 1024 * 1024
# Below this, json.loads is faster than knowing the spans; the compaction step asks for them
# only when it runs (proxy.compactor), most small requests never do.
SPANS_MIN_BYTES = 32 * 1024
# The span parser gives up for messages smaller than this on average (the stdlib is faster).
SPANS_MIN_AVERAGE = 256
_FREE_SLICE = 1024  # messages freed per GIL hold (~0.1 ms)

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing with 413 as soon as it is known to exceed `limit` bytes.

    A client that leaves mid-upload raises ClientDisconnected (a 499 in the log, no traceback).
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            if chunk:  # (Starlette ends with b""): a body of one chunk is that very object
                chunks.append(chunk)
    except ClientDisconnect:  # left mid-upload, or timed out by proxy.connections
        raise read_timed_out(request.scope) or ClientDisconnected() from None
    return b"".join(chunks)


class Upload:
    """A body streamed on to the upstream as it arrives, remembering if the client left.

    The upstream transport reports a failing body as its own error (a 502); `raise_if_gone`
    turns that back into what happened: the client left (499) or timed out (408).
    """

    def __init__(self, request: Request) -> None:
        self._request = request
        self._gone: ProxyError | ClientDisconnected | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._request.stream():
                yield chunk
        except ClientDisconnect:
            self._gone = read_timed_out(self._request.scope) or ClientDisconnected()
            raise

    def raise_if_gone(self) -> None:
        if self._gone is not None:
            raise self._gone


def _too_large(limit: int) -> ProxyError:
    return ProxyError(
        413,
        f"Request body is larger than this proxy accepts ({limit} bytes; server.max_body_bytes).",
        code="request_too_large",
    )


def _type_name(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


@dataclass(frozen=True)
class Shape:
    """A kind of body whose history array the span parser reads: the field that holds it and
    the checks a parsed body must pass (raising a 400 ProxyError)."""

    field_name: str
    check: Callable[[dict[str, Any], int], None]


async def parse_chat(
    raw: bytes, max_messages: int, memo: TurnMemo | None = None, scope: str | None = None
) -> tuple[dict[str, Any], Spans | None]:
    """parse_chat_spans (parse_chat_body for small bodies), in a worker thread when `raw`
    is big. With `memo` and `scope`: a body that extends one the scope sent recently is
    parsed from it (proxy.turnmemo; the same answer), and the body is kept for the next."""
    return await parse_history(CHAT, raw, max_messages, memo, scope)


async def parse_responses(
    raw: bytes, max_items: int, memo: TurnMemo | None = None, scope: str | None = None
) -> tuple[dict[str, Any], Spans | None]:
    """A Responses API body, as `parse_chat` parses a chat one: a JSON object whose `input`,
    when it is an array, holds objects (at most `max_items`); spans for that array when the
    span parser can tell."""
    return await parse_history(RESPONSES, raw, max_items, memo, scope)


async def parse_history(
    shape: Shape,
    raw: bytes,
    max_items: int,
    memo: TurnMemo | None = None,
    scope: str | None = None,
) -> tuple[dict[str, Any], Spans | None]:
    if len(raw) < SPANS_MIN_BYTES:
        return parse_body(shape, raw, max_items), None
    if memo is None or scope is None:
        return await _parse_spans(shape, raw, max_items)
    remembered = await _remembered(shape, raw, max_items, memo, scope)
    if remembered is not None:
        return remembered
    body, spans = await _parse_spans(shape, raw, max_items)
    if spans is not None:
        memo.keep(scope, spans)
    return body, spans


async def _remembered(
    shape: Shape, raw: bytes, max_items: int, memo: TurnMemo, scope: str
) -> tuple[dict[str, Any], Spans] | None:
    """The body parsed from a kept one it extends; None: parse it cold (which also words
    any error: only the new messages are checked here, the kept ones passed before)."""
    if len(raw) > jsonspans.WHOLE_ARRAY_BYTES:
        return None
    parse = partial(memo.parse, scope, raw, max_items, SPANS_MIN_AVERAGE, shape.field_name)
    hit = parse() if len(raw) <= INLINE_BYTES else await anyio.to_thread.run_sync(parse)
    if hit is None:
        return None
    body, spans, base = hit
    new = spans.messages[len(base.messages) :]
    if not (_all_have_roles(new) if shape is CHAT else all(map(_is_dict, new))):
        return None
    memo.keep(scope, spans, base)
    return body, spans


async def _parse_spans(
    shape: Shape, raw: bytes, max_items: int
) -> tuple[dict[str, Any], Spans | None]:
    if len(raw) <= INLINE_BYTES:
        try:
            fast = jsonspans.loads_chat_fast(raw, max_items, SPANS_MIN_AVERAGE, shape.field_name)
        except jsonparse.TooManyItems:
            raise too_many_messages(max_items, shape.field_name) from None
        if fast:
            shape.check(fast[0], max_items)
            return fast
        if fast is not None:  # not for the span parser: the stdlib's, as parse_spans
            if len(raw) <= OFFLOAD_BYTES:
                return parse_body(shape, raw, max_items), None
            body = await anyio.to_thread.run_sync(partial(parse_body, shape, raw, max_items))
            return body, None
    return await anyio.to_thread.run_sync(partial(parse_spans, shape, raw, max_items))


def parse_chat_spans(raw: bytes, max_messages: int = 0) -> tuple[dict[str, Any], Spans | None]:
    """parse_chat_body, with where each message is in `raw` when the span parser could tell
    (proxy.jsonspans); same result, same errors."""
    return parse_spans(CHAT, raw, max_messages)


def parse_spans(
    shape: Shape, raw: bytes, max_items: int = 0
) -> tuple[dict[str, Any], Spans | None]:
    try:
        parsed = jsonspans.loads_chat(raw, max_items, SPANS_MIN_AVERAGE, shape.field_name)
    except jsonparse.TooManyItems:
        raise too_many_messages(max_items, shape.field_name) from None
    if parsed is not None:
        shape.check(parsed[0], max_items)
        return parsed
    return parse_body(shape, raw, max_items), None


async def discard_messages(body: dict[str, Any], field_name: str = "messages") -> None:
    """Free a big body's messages (or the items `field_name` holds) once they are sent, in a
    worker thread, a slice at a time: dropping a million message dicts at once holds the GIL
    (the loop) for ~100 ms."""
    messages = body.get(field_name)
    if isinstance(messages, list) and len(messages) > _FREE_SLICE:
        body[field_name] = []
        await anyio.to_thread.run_sync(_free_in_slices, messages)


def _free_in_slices(items: list[Any]) -> None:
    while items:
        del items[-_FREE_SLICE:]


def parse_chat_body(raw: bytes, max_messages: int = 0) -> dict[str, Any]:
    """Parse and check a chat completions body; raise a 400 ProxyError naming the field.

    `max_messages` (0: no limit) stops parsing as soon as `messages` is longer.
    """
    return parse_body(CHAT, raw, max_messages)


def parse_body(shape: Shape, raw: bytes, max_items: int = 0) -> dict[str, Any]:
    """Parse a body with the stdlib and check it as `shape` says; 400 ProxyError if not."""
    if not raw.strip():
        raise bad_request("The request body is empty; expected a JSON object.", code="invalid_json")
    try:
        if len(raw) <= OFFLOAD_BYTES:
            body = json.loads(raw)
        else:
            body = jsonparse.loads(raw, limited_key=shape.field_name, max_items=max_items)
    except jsonparse.TooManyItems:
        raise too_many_messages(max_items, shape.field_name) from None
    except (ValueError, RecursionError) as exc:
        raise bad_request(
            f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise bad_request(
            f"The request body must be a JSON object, but got {_type_name(body)}.",
            code="invalid_type",
        )
    shape.check(body, max_items)
    return body


def check_chat_body(body: dict[str, Any], max_messages: int = 0) -> None:
    """The checks on a parsed body: a non-empty `messages` array of objects with roles."""
    if "messages" not in body:
        raise bad_request(
            "Missing required parameter: 'messages'.",
            param="messages",
            code="missing_required_parameter",
        )
    messages = body["messages"]
    if not isinstance(messages, list):
        raise bad_request(
            f"Invalid type for 'messages': expected an array, but got {_type_name(messages)}.",
            param="messages",
            code="invalid_type",
        )
    if not messages:
        raise bad_request(
            "Invalid 'messages': empty array. Expected an array with at least one message.",
            param="messages",
            code="empty_array",
        )
    if max_messages and len(messages) > max_messages:
        raise too_many_messages(max_messages)
    if _all_have_roles(messages):
        return
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(
                f"Invalid type for 'messages[{index}]': expected an object, "
                f"but got {_type_name(message)}.",
                param=f"messages[{index}]",
                code="invalid_type",
            )
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            shown = "missing" if role is None else repr(role)
            raise bad_request(
                f"Invalid 'messages[{index}].role': {shown}. Supported values are: "
                + ", ".join(f"'{r}'" for r in sorted(ROLES))
                + ".",
                param=f"messages[{index}].role",
                code="invalid_value",
            )


def _all_have_roles(messages: list[Any]) -> bool:
    """Every message a dict with a known role, in C loops (~3x the loop that words errors)."""
    if not all(map(_is_dict, messages)):
        return False
    try:
        return ROLES.issuperset(map(dict.get, messages, repeat("role")))
    except TypeError:  # an unhashable role: the loop words the error
        return False


def _is_dict(value: object) -> bool:
    return type(value) is dict


def too_many_messages(limit: int, field_name: str = "messages") -> ProxyError:
    items = "messages" if field_name == "messages" else "items"
    return bad_request(
        f"Invalid '{field_name}': array too long. This proxy accepts at most {limit} {items} "
        "per request (server.max_messages).",
        param=field_name,
        code="array_above_max_length",
    )


def check_responses_body(body: dict[str, Any], max_items: int = 0) -> None:
    """The checks on a parsed Responses API body: `input`, when it is an array, holds
    objects, at most `max_items` of them. Everything else is the upstream's to judge (a
    string `input`, none at all with `previous_response_id` or a stored prompt)."""
    items = body.get("input")
    if isinstance(items, list):
        check_objects(items, "input", max_items)


def check_objects(items: list[Any], field_name: str, max_items: int = 0) -> None:
    """A 400 naming the first element of `items` (the body's `field_name`) that is not an
    object, or the array's length past `max_items` (0: no limit)."""
    if max_items and len(items) > max_items:
        raise too_many_messages(max_items, field_name)
    if all(map(_is_dict, items)):
        return
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_request(
                f"Invalid type for '{field_name}[{index}]': expected an object, "
                f"but got {_type_name(item)}.",
                param=f"{field_name}[{index}]",
                code="invalid_type",
            )


CHAT = Shape("messages", check_chat_body)
RESPONSES = Shape("input", check_responses_body)
