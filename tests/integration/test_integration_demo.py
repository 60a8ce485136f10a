"""The README's quick start, as a newcomer runs it: three commands, no key, no network.

`compaction-proxy fake-upstream`, `compaction-proxy serve --upstream <it>` and
`compaction-proxy demo`, each a process of its own on real sockets; then the official openai
SDK against the same proxy, as the newcomer's own code would talk to it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from proxy.demo import TOOLS, next_messages, opening_history
from tests.integration.harness import WAIT_S
from tests.integration.harness import closed_port as free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
START_S = 30.0  # import + tokenizer load on a loaded CI machine


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "proxy.cli", *args]


def environment() -> dict[str, str]:
    # No proxy settings of the test run's; no egress proxy (nothing may leave the machine).
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("COMPACTION_PROXY_") and k.upper() not in ("HTTP_PROXY", "HTTPS_PROXY")
    }


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    processes: list[subprocess.Popen[str]] = []
    yield processes
    for process in processes:
        process.terminate()
        try:
            process.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(WAIT_S)


def start(
    processes: list[subprocess.Popen[str]], command: list[str], ready_url: str
) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    processes.append(process)
    deadline = time.monotonic() + START_S
    while True:  # a bounded poll of the server's own answer
        if process.poll() is not None:
            pytest.fail(f"{command} exited: {process.communicate()[0]}")
        try:
            if httpx.get(ready_url, timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{command} did not start"
        time.sleep(0.05)


def test_three_commands_show_compacted_then_reused_without_a_key(
    started: list[subprocess.Popen[str]],
) -> None:
    fake_port, proxy_port = free_port(), free_port()
    upstream = f"http://127.0.0.1:{fake_port}/v1"
    proxy = f"http://127.0.0.1:{proxy_port}/v1"
    fake = start(started, cli("fake-upstream", "--port", str(fake_port)), f"{upstream}/models")
    start(
        started,
        cli("serve", "--upstream", upstream, "--port", str(proxy_port)),
        f"http://127.0.0.1:{proxy_port}/readyz",
    )

    demo = subprocess.run(
        cli("demo", "--url", proxy),
        cwd=REPO,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    rows = [line.split() for line in demo.stdout.splitlines() if line[:4].strip().isdigit()]
    statuses = [row[2] for row in rows]
    assert statuses[:2] == ["compacted", "reused"], demo.stdout
    assert "extended" in statuses[2:], demo.stdout
    assert "1 turn compacted" in demo.stdout

    # The newcomer's own code: the official SDK, any api_key, the proxy's URL. Another key than
    # the demo's: summaries are kept per credential, so this one starts with none.
    with openai.OpenAI(base_url=proxy, api_key="sk-any", max_retries=0, timeout=30) as client:
        messages: list[Any] = opening_history()
        seen = []
        for step in range(3):
            raw = client.chat.completions.with_raw_response.create(
                model="gpt-4o-mini",
                messages=messages,
                tools=TOOLS,  # type: ignore[arg-type]
                extra_headers={"x-compaction-budget": "3000"},
            )
            seen.append((raw.headers["x-compaction-status"], raw.headers["x-compaction-cache"]))
            completion = raw.parse()
            assert completion.choices[0].message.tool_calls  # the fake answers as an agent's model
            messages += next_messages(completion.model_dump(), 100 + step)
        assert seen == [("compacted", "miss"), ("reused", "hit"), ("reused", "hit")]

    fake.terminate()
    out, _ = fake.communicate(timeout=WAIT_S)
    assert f"fake OpenAI upstream on {upstream}" in out
    assert out.count("summarizer call #") == 3  # demo: compacted + extended; SDK: compacted
