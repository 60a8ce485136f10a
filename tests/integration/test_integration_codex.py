"""Codex CLI (`codex exec`, the real binary from npm) through the proxy, against a scripted
fake upstream that makes it run 40 shell commands with large outputs, then finish. At a
small budget the run completes, and every request the upstream got is valid: calls paired
with their outputs, reasoning items whole and before what they led to, every field other
than `input` as Codex sent it, kept items as Codex's own bytes. Codex first tries a
WebSocket (`supports_websockets`): refused with 426, it falls back to HTTP at once."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.testing import Call, FakeOpenAI, Reply, ToolCall, make_app, serve
from tests.integration.codex_cli import codex_binary
from tests.responses.shapes import check_forwarded

pytestmark = pytest.mark.integration

COMMANDS = 40
BUDGET = 16_000
MODEL = "gpt-5.1-codex"  # its tools: exec_command, a function taking {"cmd": ...}
RUN_S = 300


class Script:
    """`COMMANDS` shell commands, each printing ~6 KB, then a final answer."""

    def __init__(self) -> None:
        self.issued = 0

    def __call__(self, call: Call) -> Reply:
        if self.issued < COMMANDS:
            self.issued += 1
            command = f"seq {self.issued} {self.issued + 1200}"
            return Reply(
                tool_calls=[ToolCall("exec_command", {"cmd": command})],
                reasoning=f"run step {self.issued}",
            )
        return Reply("All done: 40 commands ran.")


class Recording:
    """The proxy app, with what Codex sent on POST /v1/responses and what it was answered."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.bodies: list[bytes] = []
        self.headers: list[dict[str, str]] = []
        self.websockets = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            self.websockets += 1
        if scope["type"] != "http" or scope["path"] != "/v1/responses":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []

        async def recording_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    self.bodies.append(b"".join(chunks))
            return message

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                raw = message.get("headers", [])
                self.headers.append({k.decode(): v.decode() for k, v in raw})
            await send(message)

        await self.app(scope, recording_receive, recording_send)


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI(replies=Script())
    with serve(fake, lifespan="off") as url:
        fake.base_url = f"{url}/v1"
        yield fake


def test_codex_exec_runs_40_commands_through_a_small_budget(
    fake: FakeOpenAI, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    codex = codex_binary(request.config, tmp_path)
    proxy = Recording(
        make_app(upstream={"base_url": fake.base_url}, compaction={"budget_tokens": BUDGET})
    )
    home, repo = tmp_path / "codex-home", tmp_path / "repo"
    home.mkdir()
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    with serve(proxy) as url:
        (home / "config.toml").write_text(
            f'model = "{MODEL}"\n'
            'model_provider = "proxy"\n'
            "[model_providers.proxy]\n"
            'name = "compaction-proxy"\n'
            f'base_url = "{url}/v1"\n'
            'wire_api = "responses"\n'
            'env_key = "PROXY_API_KEY"\n'
            "supports_websockets = true\n"
        )
        started = time.monotonic()
        done = subprocess.run(
            [str(codex), "exec", "--skip-git-repo-check",
             "--dangerously-bypass-approvals-and-sandbox", "Count to 1200, forty times."],
            cwd=repo, capture_output=True, text=True, timeout=RUN_S, check=False,
            env={"PATH": _path(), "HOME": str(tmp_path), "CODEX_HOME": str(home),
                 "PROXY_API_KEY": "sk-test", "NO_COLOR": "1"},
        )  # fmt: skip
        seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    assert "All done: 40 commands ran." in done.stdout
    calls = fake.responses_calls
    assert len(calls) == COMMANDS + 1 == len(proxy.bodies)
    # The WebSocket was tried once and refused; no 7 retries over ~6 s.
    assert proxy.websockets == 1
    assert seconds < RUN_S
    statuses = [headers["x-compaction-status"] for headers in proxy.headers]
    detail = [
        (
            h["x-compaction-status"],
            h.get("x-compaction-tokens-before"),
            h.get("x-compaction-tokens-after"),
        )
        for h in proxy.headers
    ]
    assert statuses.count("compacted") + statuses.count("extended") >= 2, detail
    outputs_seen = 0
    for sent, call, headers in zip(proxy.bodies, calls, proxy.headers, strict=True):
        items = check_forwarded(sent, call.request.content)
        outputs_seen = max(outputs_seen, _outputs(json.loads(sent)["input"]))
        if headers["x-compaction-status"] in ("compacted", "extended", "reused"):
            assert int(headers["x-compaction-tokens-after"]) <= BUDGET
            assert len(items) < len(json.loads(sent)["input"])
    assert outputs_seen == COMMANDS  # Codex sent every command's output back


def _outputs(items: list[dict[str, Any]]) -> int:
    return sum(1 for item in items if item.get("type") == "function_call_output")


def _path() -> str:
    return os.environ.get("PATH", "/usr/bin:/bin")
