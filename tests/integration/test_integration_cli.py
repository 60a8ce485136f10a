"""`compaction-proxy serve` as users run it: a subprocess with the real CLI's uvicorn setup."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.harness import (
    API_KEY,
    PIECES,
    REPLY_TEXT,
    WAIT_S,
    FakeUpstream,
    ServerThread,
)
from tests.integration.harness import closed_port as free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
START_S = 20.0  # import + tokenizer load on a loaded CI machine


@pytest.fixture(scope="module")
def cli_proxy(upstream_server: tuple[FakeUpstream, ServerThread]) -> Iterator[str]:
    """`python -m proxy.cli serve` pointed at the fake upstream; yields its /v1 URL."""
    _, upstream = upstream_server
    port = free_port()
    command = [
        sys.executable, "-m", "proxy.cli", "serve",
        "--upstream", f"{upstream.url}/v1",
        "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=dict(os.environ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:  # a bounded poll of the proxy's own readiness endpoint
            if process.poll() is not None:
                _, stderr = process.communicate()
                pytest.fail(f"compaction-proxy serve exited: {stderr.decode()}")
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "compaction-proxy serve did not become ready"
            time.sleep(0.05)
        yield f"{base}/v1"
    finally:
        process.terminate()
        try:
            process.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(WAIT_S)
        if process.stderr is not None:
            process.stderr.close()


def test_cli_serve_proxies_chat_and_streams(cli_proxy: str, fake_upstream: FakeUpstream) -> None:
    with openai.OpenAI(
        base_url=cli_proxy, api_key=API_KEY, max_retries=0, timeout=WAIT_S
    ) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="echo", messages=[{"role": "user", "content": "Say hello."}]
        )
        assert raw.parse().choices[0].message.content == REPLY_TEXT
        assert raw.headers["x-compaction-status"] == "passthrough"
        received: list[str] = []
        stream = client.chat.completions.create(
            model="lockstep", messages=[{"role": "user", "content": "Say hello."}], stream=True
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received.append(chunk.choices[0].delta.content)
                fake_upstream.signal(f"next-{len(received)}").set()
    assert received == PIECES


def test_cli_serve_sends_a_single_date_header(cli_proxy: str, fake_upstream: FakeUpstream) -> None:
    response = httpx.get(
        f"{cli_proxy}/models", headers={"authorization": f"Bearer {API_KEY}"}, timeout=WAIT_S
    )
    assert response.status_code == 200
    assert response.headers.get_list("server") == ["uvicorn"]  # the upstream's, relayed once
    assert len(response.headers.get_list("date")) == 1
