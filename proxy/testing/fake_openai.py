"""FakeOpenAI: an OpenAI-compatible upstream for tests, on a respx router or as an ASGI app.

It answers `POST .../chat/completions` (JSON or SSE, `usage` counted with the proxy's own
token counter), `POST .../responses` (a Response object or its event stream, as
proxy/testing/fake_responses.py renders them), `GET .../models` and `GET .../models/{id}`.
On respx, other requests fall through to the test's own routes; served as an ASGI app, it
404s them OpenAI-style. It tells the proxy's summarizer calls (recognised by the
summarizer's system prompt) from forwarded requests, records every request, and replies
from a script:

    fake = FakeOpenAI(replies=[ToolCall("read_file", {"path": "a.py"}), "done"])
    fake.summaries = [Error(503)]          # the next summarizer call fails

A script is a list (consumed in order; when empty, the default reply) or a callable of the
`Call` returning an item or None (None: the default reply). An item is a `str` (assistant
text), a `Reply`, a `ToolCall`, an `Error` or a `BrokenStream`. The default summary is
`FAKE SUMMARY <digest of its input>: fact fact ...`, exactly `summary_tokens` tokens long.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import httpx
from starlette.types import Receive, Scope, Send

from proxy.compaction.prompt import SYSTEM_PROMPT
from proxy.testing import fake_responses
from proxy.testing.app import FAKE_UPSTREAM, load_offline_tokenizer, make_settings
from proxy.testing.script import DEFAULT_REPLY, BrokenStream, Error, Item, Reply, ToolCall
from proxy.tokens import TokenCounter
from proxy.tokens.responses import ResponsesCounter

if TYPE_CHECKING:  # respx is needed to mock, not to serve (`compaction-proxy fake-upstream`)
    import respx

FAKE_SUMMARY_PREFIX = "FAKE SUMMARY"
DEFAULT_MODELS = ("gpt-4o-mini", "gpt-4o", "gpt-4.1-mini")
CREATED = 1_700_000_000

Kind = Literal["chat", "responses", "summarizer", "models", "other"]




@dataclass
class Call:
    """One request the fake received."""

    kind: Kind
    request: httpx.Request
    body: Any  # the parsed JSON body, or None

    @property
    def path(self) -> str:
        return self.request.url.path

    @property
    def headers(self) -> httpx.Headers:
        return self.request.headers

    @property
    def model(self) -> str | None:
        return self.body.get("model") if isinstance(self.body, dict) else None

    @property
    def messages(self) -> list[dict[str, Any]]:
        messages = self.body.get("messages") if isinstance(self.body, dict) else None
        return messages if isinstance(messages, list) else []

    @property
    def input(self) -> list[dict[str, Any]]:
        """A Responses API request's `input` items ([] for a string or none)."""
        items = self.body.get("input") if isinstance(self.body, dict) else None
        return items if isinstance(items, list) else []

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and bool(self.body.get("stream"))


Script = Sequence[Item] | Callable[[Call], Item | None] | None


class FakeOpenAI:
    """See the module docstring. Thread-safe enough to serve under uvicorn in a thread."""

    def __init__(
        self,
        base_url: str = FAKE_UPSTREAM,
        *,
        replies: Script = None,
        summaries: Script = None,
        summary_tokens: int = 40,
        reply_text: str = DEFAULT_REPLY,
        models: Sequence[str] = DEFAULT_MODELS,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.replies: Script = list(replies) if isinstance(replies, Sequence) else replies
        self.summaries: Script = list(summaries) if isinstance(summaries, Sequence) else summaries
        self.summary_tokens = summary_tokens
        self.reply_text = reply_text
        self.models = list(models)
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._counter: TokenCounter | None = None
        self._responses_counter: ResponsesCounter | None = None
        self.router: respx.MockRouter | None = None  # while `mock()` is active

    # -- what was received -------------------------------------------------------------------

    @property
    def summarizer_calls(self) -> list[Call]:
        return [c for c in self.calls if c.kind == "summarizer"]

    @property
    def chat_calls(self) -> list[Call]:
        """Chat completions the proxy forwarded (summarizer calls excluded)."""
        return [c for c in self.calls if c.kind == "chat"]

    @property
    def responses_calls(self) -> list[Call]:
        """Responses API requests the proxy forwarded (summarizer calls excluded)."""
        return [c for c in self.calls if c.kind == "responses"]

    @property
    def last_forwarded_input(self) -> list[dict[str, Any]]:
        calls = self.responses_calls
        if not calls:
            raise LookupError("the fake upstream has received no Responses API request")
        return calls[-1].input

    @property
    def last_forwarded_messages(self) -> list[dict[str, Any]]:
        chats = self.chat_calls
        if not chats:
            raise LookupError("the fake upstream has received no chat completion")
        return chats[-1].messages

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()

    # -- respx -------------------------------------------------------------------------------

    def register(self, router: respx.Router) -> list[respx.Route]:
        """Route the fake's endpoints under `base_url` on `router` to it.

        Nothing else is routed: other paths and hosts fall through to the test's other respx
        routes and routers (e.g. the `respx_mock` fixture), and respx refuses what none mocks.
        """
        base = re.escape(self.base_url)
        tail = r"(\?.*)?$"
        routes = [
            router.route(method="POST", url__regex=f"^{base}/chat/completions{tail}"),
            router.route(method="POST", url__regex=f"^{base}/responses{tail}"),
            router.route(method="GET", url__regex=f"^{base}/models(/[^/?]+)?{tail}"),
        ]
        for route in routes:
            route.mock(side_effect=self.handle)
        return routes

    @contextmanager
    def mock(self) -> Iterator[respx.MockRouter]:
        """A respx mock (httpx's transports patched) with this fake registered, as `router`."""
        import respx

        with respx.mock(assert_all_called=False) as router:
            self.register(router)
            self.router = router
            try:
                yield router
            finally:
                self.router = None

    async def handle(self, request: httpx.Request) -> httpx.Response:
        """The respx side effect: answer one request."""
        await request.aread()
        call = self._record(request)
        return await self._answer(call)

    # -- ASGI --------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve as an ASGI app (e.g. uvicorn on 127.0.0.1); point `base_url` at it."""
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        host = dict(scope["headers"]).get(b"host", b"fake").decode("latin-1")
        query = scope.get("query_string", b"")
        url = f"{scope.get('scheme', 'http')}://{host}{scope['path']}"
        request = httpx.Request(
            scope["method"],
            url + (f"?{query.decode('latin-1')}" if query else ""),
            headers=[(k, v) for k, v in scope["headers"]],
            content=b"".join(chunks),
        )
        response = await self._answer(self._record(request))
        headers = [(k.lower(), v) for k, v in response.headers.raw]
        await send(
            {"type": "http.response.start", "status": response.status_code, "headers": headers}
        )
        async for chunk in cast(httpx.AsyncByteStream, response.stream):  # bytes or a generator
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    # -- answering ---------------------------------------------------------------------------

    def _record(self, request: httpx.Request) -> Call:
        try:
            body = json.loads(request.content) if request.content else None
        except ValueError:
            body = None
        path = request.url.path
        kind: Kind = "other"
        if request.method == "POST" and path.endswith("/chat/completions"):
            is_summary = isinstance(body, dict) and _first_content(body) == SYSTEM_PROMPT
            kind = "summarizer" if is_summary else "chat"
        elif request.method == "POST" and path.endswith("/responses"):
            is_summary = isinstance(body, dict) and body.get("instructions") == SYSTEM_PROMPT
            kind = "summarizer" if is_summary else "responses"
        elif request.method == "GET" and re.search(r"/models(/[^/]+)?$", path):
            kind = "models"
        call = Call(kind, request, body)
        with self._lock:
            self.calls.append(call)
        return call

    async def _answer(self, call: Call) -> httpx.Response:
        if call.kind == "models":
            return self._models(call)
        if call.kind == "other":
            return _error(404, f"The fake upstream has no route {call.request.method} {call.path}")
        if not isinstance(call.body, dict):
            return _error(400, "The fake upstream expects a JSON object body")
        script = self.summaries if call.kind == "summarizer" else self.replies
        item = self._next(script, call)
        if item is None:
            item = self._default_summary(call) if call.kind == "summarizer" else self.reply_text
        return await self._render(call, item)

    def _next(self, script: Script, call: Call) -> Item | None:
        if script is None:
            return None
        if callable(script):
            return script(call)
        with self._lock:
            return script.pop(0) if isinstance(script, list) and script else None

    def _default_summary(self, call: Call) -> str:
        read = call.messages or call.input
        digest = hashlib.sha256(json.dumps(read, sort_keys=True).encode()).hexdigest()
        text = f"{FAKE_SUMMARY_PREFIX} {digest[:12]}:"
        missing = self.summary_tokens - self._count_text(call.model, text)
        return text + " fact" * max(missing, 0)  # " fact" is one token in both encodings

    async def _render(self, call: Call, item: Item) -> httpx.Response:
        if isinstance(item, Error):
            if item.delay_s:
                await asyncio.sleep(item.delay_s)
            return _error(item.status, item.json_body(), item.headers)
        broken = item if isinstance(item, BrokenStream) else None
        reply = _as_reply(item.reply if isinstance(item, BrokenStream) else item)
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        headers = {"x-fake-openai": call.kind, **reply.headers}
        if call.path.endswith("/responses"):
            return self._response(call, reply, broken, headers)
        usage = dict(reply.usage) if reply.usage is not None else self._usage(call, reply)
        model = call.model or "fake"
        if call.stream:
            events = _stream_events(model, reply, usage, call.body)
            if broken is not None:
                events = events[: broken.after_chunks + 1]  # role chunk + `after_chunks`
            body = _sse(events, broken=broken is not None)
            headers["content-type"] = "text/event-stream"
            return httpx.Response(200, headers=headers, content=body)
        raw = json.dumps(_completion(model, reply, usage)).encode()
        if broken is not None:
            headers["content-type"] = "application/json"
            headers["content-length"] = str(len(raw))
            return httpx.Response(200, headers=headers, content=_cut(raw[: len(raw) // 2]))
        headers["content-type"] = "application/json"
        return httpx.Response(200, headers=headers, content=raw)

    def _response(
        self, call: Call, reply: Reply, broken: BrokenStream | None, headers: dict[str, str]
    ) -> httpx.Response:
        """A Responses API reply (see proxy/testing/fake_responses.py)."""
        body = call.body
        output = fake_responses.output_items(reply, fake_responses.seed_of(body))
        if reply.usage is not None:
            usage = dict(reply.usage)
        else:
            completion = self._count_text(call.model, fake_responses.output_text(output))
            usage = fake_responses.usage_of(self._input_tokens(body), completion)
        if call.stream:
            events = fake_responses.stream_events(body, output, usage)
            if broken is not None:
                events = events[: broken.after_chunks + 1]
            headers["content-type"] = "text/event-stream"
            stream = fake_responses.sse(events, broken=broken is not None)
            return httpx.Response(200, headers=headers, content=stream)
        raw = json.dumps(fake_responses.response_object(body, output, usage, "completed")).encode()
        headers["content-type"] = "application/json"
        if broken is not None:
            headers["content-length"] = str(len(raw))
            return httpx.Response(200, headers=headers, content=_cut(raw[: len(raw) // 2]))
        return httpx.Response(200, headers=headers, content=raw)

    def _input_tokens(self, body: dict[str, Any]) -> int:
        """A Responses request's input tokens, as the proxy counts them."""
        try:
            return self.responses_counter.count_request(body)
        except Exception:  # a body the counter rejects still gets an answer
            return 0

    def _models(self, call: Call) -> httpx.Response:
        match = re.search(r"/models/([^/]+)$", call.path)
        entries = [
            {"id": m, "object": "model", "created": CREATED, "owned_by": "fake-openai"}
            for m in self.models
        ]
        if match is None:
            return httpx.Response(200, json={"object": "list", "data": entries})
        for entry in entries:
            if entry["id"] == match.group(1):
                return httpx.Response(200, json=entry)
        return _error(404, f"The model '{match.group(1)}' does not exist")

    # -- usage -------------------------------------------------------------------------------

    @property
    def counter(self) -> TokenCounter:
        """The proxy's own counter over the offline tokenizer files (shared per fake)."""
        if self._counter is None:
            load_offline_tokenizer()
            counter = TokenCounter(make_settings())
            counter.load()
            self._counter = counter
        return self._counter

    @property
    def responses_counter(self) -> ResponsesCounter:
        """The proxy's Responses API counter, over `counter`."""
        if self._responses_counter is None:
            self._responses_counter = ResponsesCounter(self.counter, make_settings())
        return self._responses_counter

    def _count_text(self, model: str | None, text: str) -> int:
        return self.counter.count_text(model or "gpt-4o-mini", text)

    def _usage(self, call: Call, reply: Reply) -> dict[str, int]:
        try:
            prompt = self.counter.count_request(call.body)
        except Exception:  # a body the counter rejects still gets an answer
            prompt = 0
        text = (reply.content or "") + "".join(
            t.name + t.arguments_json() for t in reply.tool_calls
        )
        completion = self._count_text(call.model, text)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }


def _first_content(body: dict[str, Any]) -> Any:
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        return messages[0].get("content")
    return None


def _as_reply(item: str | Reply | ToolCall) -> Reply:
    if isinstance(item, Reply):
        return item
    if isinstance(item, ToolCall):
        return Reply(tool_calls=[item])
    return Reply(content=item)


def _error(status: int, body: Any, headers: Mapping[str, str] | None = None) -> httpx.Response:
    if isinstance(body, str):
        body = {
            "error": {
                "message": body,
                "type": "invalid_request_error",
                "param": None,
                "code": "not_found" if status == 404 else None,
            }
        }
    return httpx.Response(status, json=body, headers=dict(headers or {}))


def _tool_call_id(index: int, call: ToolCall) -> str:
    return call.id or f"call_fake_{index}"


def _finish_reason(reply: Reply) -> str:
    return reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")


def _completion(model: str, reply: Reply, usage: dict[str, int]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content, "refusal": None}
    if reply.tool_calls:
        message["tool_calls"] = [
            {
                "id": _tool_call_id(i, t),
                "type": "function",
                "function": {"name": t.name, "arguments": t.arguments_json()},
            }
            for i, t in enumerate(reply.tool_calls)
        ]
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": _finish_reason(reply),
    }
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": CREATED,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def _chunk(model: str, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


def _stream_events(
    model: str, reply: Reply, usage: dict[str, int], body: dict[str, Any]
) -> list[dict[str, Any]]:
    """Role first, the text word by word, each tool call (name, then arguments), the finish."""
    events = [_chunk(model, {"role": "assistant", "content": ""}, None)]
    for piece in re.findall(r"\s*\S+", reply.content or ""):
        events.append(_chunk(model, {"content": piece}, None))
    for i, tool in enumerate(reply.tool_calls):
        head = {
            "index": i,
            "id": _tool_call_id(i, tool),
            "type": "function",
            "function": {"name": tool.name, "arguments": ""},
        }
        events.append(_chunk(model, {"tool_calls": [head]}, None))
        arguments = {"index": i, "function": {"arguments": tool.arguments_json()}}
        events.append(_chunk(model, {"tool_calls": [arguments]}, None))
    events.append(_chunk(model, {}, _finish_reason(reply)))
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append({**_chunk(model, {}, None), "choices": [], "usage": usage})
    return events


async def _sse(events: list[dict[str, Any]], *, broken: bool) -> AsyncIterator[bytes]:
    for event in events:
        yield b"data: " + json.dumps(event).encode() + b"\n\n"
    if broken:
        raise httpx.RemoteProtocolError("the fake upstream broke off the stream")
    yield b"data: [DONE]\n\n"


async def _cut(part: bytes) -> AsyncIterator[bytes]:
    yield part
    raise httpx.RemoteProtocolError("the fake upstream broke off the body")
