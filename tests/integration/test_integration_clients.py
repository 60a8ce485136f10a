"""Other real clients through the proxy: langchain-openai, curl, and the npm `openai` package."""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import API_KEY, PIECES, REPLY_TEXT, WAIT_S, FakeUpstream

pytestmark = pytest.mark.integration

NPM_INSTALL_S = 120.0


def test_langchain_chat_openai_invoke_and_stream(
    proxy_url: str, fake_upstream: FakeUpstream
) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    model = langchain_openai.ChatOpenAI(
        model="echo",
        base_url=proxy_url,
        api_key=API_KEY,
        max_retries=0,
        timeout=WAIT_S,
        use_responses_api=False,
        stream_usage=True,
    )
    reply = model.invoke("Say hello.")
    assert reply.content == REPLY_TEXT
    pieces = [chunk.content for chunk in model.stream("Say hello.")]
    assert "".join(str(piece) for piece in pieces) == REPLY_TEXT
    assert [str(p) for p in pieces if p] == PIECES  # one message chunk per upstream SSE event
    invoked, streamed = fake_upstream.requests
    assert invoked.json()["messages"] == [{"role": "user", "content": "Say hello."}]
    assert not invoked.json().get("stream")
    assert streamed.json()["stream"] is True
    assert streamed.json()["stream_options"] == {"include_usage": True}


class LineReader:
    """Lines from a child's stdout, each read bounded by a deadline (never blocks forever)."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        self.fd = process.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.fd, selectors.EVENT_READ)
        self.buffer = b""

    def line(self, limit_s: float = WAIT_S) -> bytes | None:
        """The next line without its newline; None at the end of the output."""
        deadline = time.monotonic() + limit_s
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no complete line within {limit_s}s; have {self.buffer!r}")
            if not self.selector.select(remaining):
                continue
            data = os.read(self.fd, 65536)
            if not data:
                rest, self.buffer = self.buffer, b""
                return rest or None
            self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def close(self) -> None:
        self.selector.close()


def data_lines(reader: LineReader) -> Iterator[bytes]:
    """The payloads of the `data:` lines, up to `[DONE]` or the end of the output."""
    while (line := reader.line()) is not None:
        if line.startswith(b"data: "):
            yield line.removeprefix(b"data: ")
        if line == b"data: [DONE]":
            return


def test_curl_streams_sse_lines_as_they_come(proxy_url: str, fake_upstream: FakeUpstream) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    body = {"model": "lockstep", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    command = [
        curl, "-sS", "-N", "--max-time", str(2 * WAIT_S),
        "-H", "content-type: application/json", "-H", f"authorization: Bearer {API_KEY}",
        "-d", json.dumps(body), f"{proxy_url}/chat/completions",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reader = LineReader(process)
    try:
        events = data_lines(reader)
        first = json.loads(next(events))
        assert first["choices"][0]["delta"]["content"] == PIECES[0]
        assert not fake_upstream.signal("sent-1").is_set()  # printed before the rest exists
        for index in range(1, len(PIECES)):
            fake_upstream.signal(f"next-{index}").set()
        rest = list(events)
        _, stderr = process.communicate(timeout=WAIT_S)
    finally:
        reader.close()
        if process.poll() is None:
            process.kill()
            process.wait(WAIT_S)
    assert process.returncode == 0, stderr
    assert rest[-1] == b"[DONE]"
    text = "".join(
        choice["delta"].get("content", "")
        for event in rest[:-1]
        for choice in json.loads(event)["choices"]
    )
    assert PIECES[0] + text == REPLY_TEXT


@pytest.fixture(scope="session")
def node_openai(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the npm `openai` package installed; skips if node/npm/registry fail."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node/npm not installed")
    directory = tmp_path_factory.mktemp("node-openai")
    (directory / "package.json").write_text('{"name": "proxy-it", "private": true}\n')
    command = [npm, "install", "--no-audit", "--no-fund", "--prefer-offline", "openai"]
    try:
        subprocess.run(
            command, cwd=directory, capture_output=True, timeout=NPM_INSTALL_S, check=True
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"npm install openai failed: {exc}")
    return directory


NODE_SCRIPT = """
import OpenAI from "openai";
const client = new OpenAI({ baseURL: process.env.PROXY_URL, apiKey: process.env.API_KEY,
                            maxRetries: 0, timeout: Number(process.env.TIMEOUT_MS) });
const messages = [{ role: "user", content: "Say hello." }];
const { data: reply, response } = await client.chat.completions
  .create({ model: "echo", messages }).withResponse();
const pieces = [];
for await (const chunk of await client.chat.completions.create({ model: "echo", messages,
                                                                 stream: true })) {
  pieces.push(chunk.choices[0]?.delta?.content ?? "");
}
console.log(JSON.stringify({ content: reply.choices[0].message.content, pieces,
  status: response.headers.get("x-compaction-status") }));
"""


def test_node_openai_package_chat_call(
    node_openai: Path, proxy_url: str, fake_upstream: FakeUpstream
) -> None:
    script = node_openai / "chat.mjs"
    script.write_text(NODE_SCRIPT)
    env = {
        **os.environ,
        "PROXY_URL": proxy_url,
        "API_KEY": API_KEY,
        "TIMEOUT_MS": str(int(WAIT_S * 1000)),
    }
    done = subprocess.run(
        ["node", str(script)], cwd=node_openai, env=env, capture_output=True, timeout=2 * WAIT_S
    )
    assert done.returncode == 0, done.stderr.decode()
    result = json.loads(done.stdout)
    assert result["content"] == REPLY_TEXT
    assert "".join(result["pieces"]) == REPLY_TEXT
    assert result["status"] == "passthrough"
    plain, streamed = fake_upstream.requests
    assert plain.header("authorization") == f"Bearer {API_KEY}"
    assert (plain.header("user-agent") or "").startswith("OpenAI/JS")
    assert streamed.json()["stream"] is True
