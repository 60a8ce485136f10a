"""proxy.testing: make_settings / make_app defaults, CompactionReport, FakeOpenAI on a socket."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from proxy.testing import (
    FAKE_UPSTREAM,
    BrokenStream,
    CompactionReport,
    FakeOpenAI,
    make_app,
    make_settings,
)
from tests.integration.harness import ServerThread

REPO = Path(__file__).resolve().parents[2]


def test_make_settings_merges_nested_sections_over_the_test_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COMPACTION_PROXY_UPSTREAM__BASE_URL", "https://api.openai.com/v1")
    monkeypatch.setenv("COMPACTION_PROXY_COMPACTION__BUDGET_TOKENS", "99999")
    settings = make_settings(compaction={"summarizer": {"retries": 0}, "max_preserved_messages": 4})
    assert settings.upstream.base_url == FAKE_UPSTREAM  # the environment is not read
    assert settings.compaction.budget_tokens == 1000
    assert settings.compaction.summarizer.retries == 0
    assert settings.compaction.summarizer.backoff_base_s == 0.0  # a default kept beside it
    assert settings.compaction.max_preserved_messages == 4
    assert settings.cache.backend == "memory"


def test_make_settings_rejects_unknown_keys_with_their_path() -> None:
    with pytest.raises(ValueError, match="budget_token"):
        make_settings(compaction={"budget_token": 5})


def test_make_app_takes_settings_or_sections_not_both() -> None:
    with pytest.raises(TypeError):
        make_app(make_settings(), compaction={"budget_tokens": 5})


def test_make_app_needs_no_network_and_no_tokenizer_cache(tmp_path: Path) -> None:
    # A fresh interpreter with every socket refused and an empty tiktoken cache.
    script = textwrap.dedent(
        """
        import socket
        def refuse(*args, **kwargs):
            raise OSError("network used")
        socket.socket.connect = refuse
        socket.create_connection = refuse
        from proxy.testing import make_app
        app = make_app()
        counter = app.state.proxy.counter
        print(counter.count_text("gpt-4o-mini", "hello world"), counter.estimated)
        """
    )
    env = {"PATH": "/usr/bin:/bin", "TIKTOKEN_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "False"]
    assert list(tmp_path.iterdir()) == []  # nothing written to the cache either


def test_compaction_report_reads_every_header() -> None:
    headers = httpx.Headers(
        {
            "X-Compaction-Status": "reused",
            "x-compaction-tokens-before": "1200",
            "x-compaction-tokens-after": "400",
            "x-compaction-budget": "1000",
            "x-compaction-messages-summarized": "6",
            "x-compaction-summary-input-tokens": "0",
            "x-compaction-summary-output-tokens": "0",
            "x-compaction-cache": "hit",
            "x-compaction-tokens-estimated": "true",
            "x-compaction-overhead-ms": "1.5",
            "x-compaction-something-new": "kept",
            "content-type": "application/json",
        }
    )
    report = CompactionReport.from_headers(headers)
    assert report == CompactionReport(
        status="reused",
        tokens_before=1200,
        tokens_after=400,
        budget=1000,
        messages_summarized=6,
        cache="hit",
        tokens_estimated=True,
        overhead_ms=1.5,
    )
    assert report.summarized
    assert report.headers["x-compaction-something-new"] == "kept"
    assert "content-type" not in report.headers


def test_compaction_report_of_a_passthrough_and_of_a_foreign_response() -> None:
    report = CompactionReport.from_headers([("x-compaction-status", "passthrough")])
    assert not report.summarized
    assert report.tokens_before is None and report.reason is None
    with pytest.raises(ValueError, match="x-compaction-status"):
        CompactionReport.from_headers({"content-type": "application/json"})


@pytest.fixture
def served_fake() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI()
    server = ServerThread(fake, "fake-openai").start()
    fake.base_url = f"{server.url}/v1"
    yield fake
    server.stop()


@pytest.fixture
def served_proxy(served_fake: FakeOpenAI) -> Iterator[str]:
    settings = make_settings(upstream={"base_url": served_fake.base_url})
    server = ServerThread(make_app(settings), "kit-proxy").start()
    yield f"{server.url}/v1"
    server.stop()


async def test_fake_openai_serves_real_sockets(served_fake: FakeOpenAI, served_proxy: str) -> None:
    served_fake.replies = ["over the wire", BrokenStream("never finished", after_chunks=1)]
    async with openai.AsyncOpenAI(base_url=served_proxy, api_key="sk-test", max_retries=0) as sdk:
        reply = await sdk.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content == "over the wire"
        assert reply.usage is not None and reply.usage.prompt_tokens > 0
        stream = await sdk.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        pieces: list[str] = []
        with pytest.raises(openai.APIError):
            async for chunk in stream:
                pieces.extend(c.delta.content or "" for c in chunk.choices)
        assert pieces == ["", "never"]
    async with httpx.AsyncClient() as direct:
        unknown = await direct.post(f"{served_fake.base_url}/embeddings", json={"input": "x"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "not_found"
    assert [c.kind for c in served_fake.calls] == ["chat", "chat", "other"]
    assert served_fake.calls[0].headers["authorization"] == "Bearer sk-test"
