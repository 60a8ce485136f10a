"""Real servers for the integration tests: uvicorn in a background thread, a fake upstream.

Nothing here sleeps to synchronise: tests and the fake upstream hand off through `Signal`s,
and every wait is bounded, so a broken proxy fails a test instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import json
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.settings import Settings

# The longest a test waits for something that should happen promptly.
WAIT_S = 5.0
# The fake upstream never holds a response longer than this waiting on a test (> WAIT_S, so a
# test sees its own timeout first and an abandoned handler still ends on its own).
HOLD_S = 10.0

PIECES = ["Hel", "lo", " from", " the", " upstream"]
REPLY_TEXT = "".join(PIECES)
CREATED = 1_700_000_000
RATE_LIMIT_MESSAGE = "Rate limit reached for ratelimit in organization org-test on requests."
API_KEY = "sk-integration-test"
MODELS = ["echo", "lockstep", "hang", "think", "ratelimit"]


class UpstreamCrash(Exception):
    """Raised inside the fake upstream to make uvicorn abort the connection."""


class Signal:
    """A one-shot event: set from any thread, awaited on any loop or waited on from a thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flag = threading.Event()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def set(self) -> None:
        with self._lock:
            self._flag.set()
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # that loop has closed meanwhile
                loop.call_soon_threadsafe(event.set)

    def is_set(self) -> bool:
        return self._flag.is_set()

    def wait(self, limit_s: float = WAIT_S) -> bool:
        """Block this thread until set; False on timeout."""
        return self._flag.wait(limit_s)

    async def wait_async(self, limit_s: float = WAIT_S) -> bool:
        """Await until set, on whatever loop is running; False on timeout."""
        event = asyncio.Event()
        entry = (asyncio.get_running_loop(), event)
        with self._lock:
            if self._flag.is_set():
                return True
            self._waiters.append(entry)
        try:
            async with asyncio.timeout(limit_s):
                await event.wait()
            return True
        except TimeoutError:
            return False
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._waiters.remove(entry)


@dataclass
class Recorded:
    """One request as the fake upstream received it."""

    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k == name.lower()]
        return values[0] if values else None

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class UpstreamState:
    """What one test saw and controls; replaced wholesale between tests."""

    requests: list[Recorded] = field(default_factory=list)
    signals: dict[str, Signal] = field(default_factory=dict)
    holds: list[str] = field(default_factory=list)  # how each hold ended
    lock: threading.Lock = field(default_factory=threading.Lock)

    def signal(self, name: str) -> Signal:
        with self.lock:
            return self.signals.setdefault(name, Signal())

    def release_all(self) -> None:
        with self.lock:
            signals = list(self.signals.values())
        for item in signals:
            item.set()


class FakeUpstream:
    """A small OpenAI-like upstream, as a raw ASGI app so it sees `http.disconnect` directly.

    The chat scenario is picked by the request's model:
      echo       a normal reply; streamed with a short pause between pieces
      lockstep   streams piece 0, then waits for signal `next-{i}` before piece i
      hang       streams piece 0, then waits for a `release` that never comes
      think      delays its response headers until `release` (a model thinking)
      ratelimit  answers 429 with an OpenAI error body
      truncate   streams piece 0, then crashes (`crashed`): uvicorn drops the connection
    JSON replies are gzipped when the request accepts gzip, as OpenAI's are.
    After sending piece i it sets `sent-{i}`; on seeing the client go away it sets `disconnected`;
    on receiving a `think` request it sets `received`.
    """

    def __init__(self) -> None:
        self.state = UpstreamState()

    def reset(self) -> UpstreamState:
        """Release whatever the previous test left waiting and start afresh."""
        old, self.state = self.state, UpstreamState()
        old.release_all()
        return self.state

    # Shorthands for the current test's state.
    @property
    def requests(self) -> list[Recorded]:
        return self.state.requests

    def signal(self, name: str) -> Signal:
        return self.state.signal(name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http", scope["type"]
        state = self.state  # a handler outliving its test keeps its own test's state
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        request = Recorded(
            method=scope["method"],
            path=scope["path"],
            query=scope["query_string"].decode("latin-1"),
            headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]],
            body=b"".join(chunks),
        )
        with state.lock:
            state.requests.append(request)
        route = (request.method, request.path)
        if route == ("POST", "/v1/chat/completions"):
            await self.chat(state, request, receive, send)
        elif route in (("GET", "/v1/models"), ("HEAD", "/v1/models")):  # (uvicorn: no HEAD body)
            data = [
                {"id": m, "object": "model", "created": CREATED, "owned_by": "fake"} for m in MODELS
            ]
            await send_json(send, request, 200, {"object": "list", "data": data})
        elif route == ("POST", "/v1/embeddings"):
            await self.embeddings(state, request, receive, send)
        elif route == ("POST", "/v1/files"):
            await self.files(request, send)
        else:
            error = error_body(f"no route {request.path}", "not_found")
            await send_json(send, request, 404, error)

    async def hold(self, state: UpstreamState, gate: str, receive: Receive) -> bool:
        """Wait for signal `gate` or the client's disconnect, whichever comes first."""

        async def client_gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        released = asyncio.ensure_future(state.signal(gate).wait_async(HOLD_S))
        gone = asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait({released, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            state.holds.append("cancelled")
            state.signal("disconnected").set()
            raise
        finally:
            released.cancel()
            gone.cancel()
        if gone.done() and not gone.cancelled():
            state.holds.append("disconnected")
            state.signal("disconnected").set()
            return False
        ok = released.done() and not released.cancelled() and released.result()
        state.holds.append("released" if ok else "timeout")
        return ok

    async def chat(
        self, state: UpstreamState, request: Recorded, receive: Receive, send: Send
    ) -> None:
        body = request.json()
        model = body["model"]
        headers = [("openai-processing-ms", "7"), ("x-upstream-marker", "fake")]
        if model == "ratelimit":
            error = error_body(RATE_LIMIT_MESSAGE, "rate_limit_exceeded", type="requests")
            await send_json(send, request, 429, error, [*headers, ("retry-after", "7")])
            return
        if model == "think":
            state.signal("received").set()
            if not await self.hold(state, "release", receive):
                return
        if not body.get("stream"):
            await send_json(send, request, 200, completion(model), headers)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": encode_headers(
                    [*headers, ("content-type", "text/event-stream; charset=utf-8")]
                ),
            }
        )
        for index, piece in enumerate(PIECES):
            if index > 0:
                if model == "lockstep" and not await self.hold(state, f"next-{index}", receive):
                    return
                if model == "hang" and not await self.hold(state, "release", receive):
                    return
                if model == "echo":
                    await asyncio.sleep(0.01)  # a pause between tokens, as a real model has
                if model == "truncate":
                    # The upstream dies mid-stream: uvicorn drops the connection without the
                    # terminating chunk, so the body is visibly incomplete.
                    state.signal("crashed").set()
                    raise UpstreamCrash("the fake upstream died mid-stream")
            delta: dict[str, Any] = {"content": piece}
            if index == 0:
                delta["role"] = "assistant"
            await send_event(send, chunk(model, delta, None))
            state.signal(f"sent-{index}").set()
        await send_event(send, chunk(model, {}, "stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {**chunk(model, {}, None), "choices": [], "usage": USAGE}
            await send_event(send, usage)
        await send(sse(b"[DONE]", more=False))

    async def embeddings(
        self, state: UpstreamState, request: Recorded, receive: Receive, send: Send
    ) -> None:
        body = request.json()
        if body["model"] == "think":
            state.signal("received").set()
            if not await self.hold(state, "release", receive):
                return
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = []
        for index, _ in enumerate(inputs):
            vector = embedding_vector(index)
            value: Any = vector
            if body.get("encoding_format") == "base64":
                value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": value})
        usage = {"prompt_tokens": 3, "total_tokens": 3}
        reply = {"object": "list", "data": data, "model": body["model"], "usage": usage}
        await send_json(send, request, 200, reply)

    async def files(self, request: Recorded, send: Send) -> None:
        parts = parse_multipart(request.header("content-type") or "", request.body)
        filename, data = parts["file"]
        reply = {
            "id": "file-upstream1",
            "object": "file",
            "bytes": len(data),
            "created_at": CREATED,
            "filename": filename,
            "purpose": parts["purpose"][1].decode(),
            "status": "processed",
        }
        await send_json(send, request, 200, reply)


USAGE = {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}


def embedding_vector(index: int) -> list[float]:
    return [0.5, -0.25, float(index + 1)]  # exact in float32, so base64 round-trips exactly


def completion(model: str) -> dict[str, Any]:
    message = {"role": "assistant", "content": REPLY_TEXT, "refusal": None}
    return {
        "id": "chatcmpl-upstream",
        "object": "chat.completion",
        "created": CREATED,
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}],
        "usage": USAGE,
    }


def chunk(model: str, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": "chatcmpl-upstream",
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": model,
        "choices": [choice],
    }


def error_body(message: str, code: str, *, type: str = "invalid_request_error") -> Any:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


def encode_headers(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]


def sse(data: bytes, *, more: bool = True) -> Message:
    return {"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": more}


async def send_event(send: Send, payload: dict[str, Any]) -> None:
    await send(sse(json.dumps(payload).encode()))


async def send_json(
    send: Send,
    request: Recorded,
    status: int,
    payload: Any,
    headers: list[tuple[str, str]] | None = None,
) -> None:
    """A JSON reply, gzipped when the request accepts gzip (as OpenAI's API does)."""
    raw = json.dumps(payload).encode()
    all_headers = [*(headers or []), ("content-type", "application/json")]
    if "gzip" in (request.header("accept-encoding") or ""):
        raw = gzip.compress(raw)
        all_headers.append(("content-encoding", "gzip"))
    all_headers.append(("content-length", str(len(raw))))
    await send(
        {"type": "http.response.start", "status": status, "headers": encode_headers(all_headers)}
    )
    await send({"type": "http.response.body", "body": raw, "more_body": False})


def parse_multipart(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """multipart/form-data -> {field name: (filename, raw bytes)}; strict about the framing."""
    params = dict(part.strip().split("=", 1) for part in content_type.split(";")[1:] if "=" in part)
    boundary = params["boundary"].strip('"').encode()
    delimiter = b"--" + boundary
    closing = b"\r\n" + delimiter + b"--\r\n"
    assert body.startswith(delimiter + b"\r\n"), body[:80]
    assert body.endswith(closing), body[-80:]
    fields: dict[str, tuple[str | None, bytes]] = {}
    for section in body[len(delimiter) : -len(closing)].split(b"\r\n" + delimiter):
        head, _, data = section.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        disposition = next(
            line.decode()
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-disposition:")
        )
        attributes = dict(
            (key.strip(), value.strip().strip('"'))
            for key, _, value in (item.partition("=") for item in disposition.split(";")[1:])
        )
        fields[attributes["name"]] = (attributes.get("filename"), data)
    return fields


def closed_port() -> int:
    """A loopback port with nothing listening on it (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class ServerThread:
    """An ASGI app served by uvicorn on a free 127.0.0.1 port, in a background thread."""

    def __init__(self, app: ASGIApp, name: str, *, lifespan: str = "on", **options: Any) -> None:
        self.name = name
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))  # held from here on: no race for the port
        self.port: int = self.socket.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan=lifespan,  # type: ignore[arg-type]
            timeout_graceful_shutdown=3,
            **options,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name=name, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not self.server.started:  # a bounded poll of uvicorn's own readiness flag
            if not self.thread.is_alive():
                raise RuntimeError(f"{self.name}: uvicorn exited during startup")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.name}: uvicorn not started after {WAIT_S}s")
            time.sleep(0.005)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S + 5)
        self.socket.close()
        if self.thread.is_alive():
            raise RuntimeError(f"{self.name}: uvicorn did not shut down")


def proxy_settings(upstream_base_url: str, **sections: dict[str, Any]) -> Settings:
    """Proxy settings pointing at `upstream_base_url`, with per-section overrides."""
    data: dict[str, Any] = {"upstream": {"base_url": upstream_base_url, "timeout_s": 30.0}}
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return Settings.model_validate(data)


class SentRequests:
    """What the SDK put on the wire, captured by an httpx event hook on its own client."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    def hook(self, request: Any) -> None:
        self.requests.append(request)

    async def ahook(self, request: Any) -> None:
        self.requests.append(request)

    @property
    def last(self) -> Any:
        return self.requests[-1]
