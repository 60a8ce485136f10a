"""Serve an ASGI app (the proxy, or a `FakeOpenAI`) on a real socket of 127.0.0.1, in a thread.

For code under test that makes its own client, synchronous ones included: `openai.OpenAI()`
reading OPENAI_BASE_URL, `requests`, a subprocess. The app's lifespan runs in the server's
thread; a respx mock (`FakeOpenAI.mock()`) patches httpx for every thread, so a served proxy
still reaches a mocked fake upstream.

    with serve(make_app()) as url:          # http://127.0.0.1:<port>
        OpenAI(base_url=f"{url}/v1", api_key="sk-test").models.list()
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.types import ASGIApp

START_S = 10.0  # the longest the start (lifespan included) may take
STOP_S = 10.0


@contextmanager
def serve(app: ASGIApp, *, lifespan: str = "on") -> Iterator[str]:
    """Serve `app` until the block ends; yields its base URL, `http://127.0.0.1:<port>`."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))  # held from here on: no race for the port
    port = listener.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan=lifespan,  # type: ignore[arg-type]
        timeout_graceful_shutdown=3,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [listener]}, name="compaction-proxy-test", daemon=True
    )
    thread.start()
    try:
        deadline = time.monotonic() + START_S
        while not server.started:  # a bounded poll of uvicorn's own flag
            if not thread.is_alive():
                raise RuntimeError("the served app exited during start-up (see its log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the served app did not start within {START_S:g} s")
            time.sleep(0.005)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(STOP_S)
        listener.close()
