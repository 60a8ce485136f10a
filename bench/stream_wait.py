"""What a streaming client sees while the proxy makes a summary, and what the openai SDK
does with what an early-started stream would have to send instead.

    python -m bench.stream_wait

1. Silence: a streaming chat request that needs a summary, through the proxy (uvicorn on
   127.0.0.1), with the summarizer taking D seconds: time to the response headers and to
   the first event, against a request under budget.
2. The alternative: a stream started early must send `: keep-alive` comments while it waits
   and report an upstream failure in-stream, as `data: {"error": ...}`, because the 200 is
   already sent. The official openai SDK is pointed at an upstream doing exactly that, with
   a 429 inside: what does it raise, and does it retry?
Not a test: prints what it measured.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

for _name in [n for n in os.environ if n.startswith("COMPACTION_PROXY_")]:
    del os.environ[_name]

import httpx  # noqa: E402
import openai  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, Response, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from proxy.app import create_app  # noqa: E402
from proxy.compaction.prompt import SYSTEM_PROMPT  # noqa: E402
from tests.integration.harness import ServerThread, proxy_settings  # noqa: E402

DELAYS_S = (0.0, 1.0, 3.0)
state: dict[str, Any] = {"delay": 0.0, "attempts": 0}


async def chat(request: Request) -> Response:
    body = json.loads(await request.body())
    if body["messages"][0].get("content") == SYSTEM_PROMPT:
        await asyncio.sleep(state["delay"])
        reply = {"role": "assistant", "content": "Summary: the user fixes the importer."}
        return JSONResponse({"choices": [{"message": reply}], "usage": {}})
    if body["model"] == "error-in-stream":
        state["attempts"] += 1

        async def failing() -> Any:
            yield b": keep-alive\n\n"
            error = {"message": "Rate limit reached", "type": "requests", "code": "rate_limit"}
            yield b"data: " + json.dumps({"error": error}).encode() + b"\n\n"

        return StreamingResponse(failing(), media_type="text/event-stream")

    async def events() -> Any:
        for piece in ("Hel", "lo"):
            delta = {"choices": [{"index": 0, "delta": {"content": piece}}]}
            yield b"data: " + json.dumps(delta).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def history(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"step {i}: " + "log line " * 100})
        messages.append({"role": "assistant", "content": f"done {i}"})
    messages.append({"role": "user", "content": "And now?"})
    return messages


def timed_stream(client: httpx.Client, messages: list[dict[str, Any]]) -> tuple[float, float]:
    started = time.perf_counter()
    body = {"model": "m", "messages": messages, "stream": True}
    with client.stream("POST", "/chat/completions", json=body) as response:
        headers_at = time.perf_counter() - started
        for _ in response.iter_raw():
            return headers_at, time.perf_counter() - started
    raise RuntimeError("empty stream")


def main() -> int:
    upstream = ServerThread(
        Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])]),
        "upstream",
        lifespan="off",
    ).start()
    settings = proxy_settings(f"{upstream.url}/v1", compaction={"budget_tokens": 1000})
    proxy = ServerThread(create_app(settings), "proxy").start()
    try:
        print("1. streaming request through the proxy, summarizer taking D s")
        print(f"{'case':<32} {'headers s':>10} {'first event s':>14}")
        with httpx.Client(base_url=f"{proxy.url}/v1", timeout=60) as client:
            print(
                f"{'under budget':<32} "
                + "{:>10.3f} {:>14.3f}".format(*timed_stream(client, history(1)))
            )
            for delay in DELAYS_S:
                state["delay"] = delay
                label = f"needs a summary, D = {delay:g}"
                times = timed_stream(client, history(20 + int(delay * 10)))
                print(f"{label:<32} {times[0]:>10.3f} {times[1]:>14.3f}")
        print()
        print("2. the openai SDK on ': keep-alive' then 'data: {\"error\": ...}' (a 429 inside)")
        sdk = openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="sk-x", max_retries=2)
        try:
            stream = sdk.chat.completions.create(
                model="error-in-stream", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            for _ in stream:
                pass
            print("   no exception")
        except openai.APIError as exc:
            rate_limited = isinstance(exc, openai.RateLimitError)
            print(f"   raised {type(exc).__module__}.{type(exc).__name__}: {exc.message!r}")
            print(f"   RateLimitError: {rate_limited}; attempts sent: {state['attempts']}")
            print(f"   status_code attribute: {getattr(exc, 'status_code', None)}")
    finally:
        proxy.stop()
        upstream.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
