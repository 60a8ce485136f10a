"""The kit for applications on the synchronous `openai.OpenAI` client: a proxy on a real
socket in front of the fake upstream, and an `OpenAI` client pointed at it."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from proxy.testing import FAKE_SUMMARY_PREFIX, CompactionReport, FakeOpenAI

pytestmark = pytest.mark.compaction_proxy(compaction={"budget_tokens": 400})


def agent_turns(client: openai.OpenAI, turns: int) -> list[CompactionReport]:
    """An application's agent loop on the sync client: each turn resends the history."""
    messages: list[Any] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the failing parser tests."},
    ]
    reports = []
    for step in range(turns):
        raw = client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=messages
        )
        reports.append(CompactionReport.from_headers(raw.headers))
        messages.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
        messages.append({"role": "user", "content": f"output of step {step}: " + "log " * 80})
    return reports


def test_an_app_on_the_sync_client_sees_compaction_then_reuse(
    sync_openai_client: openai.OpenAI, fake_openai: FakeOpenAI
) -> None:
    statuses = [report.status for report in agent_turns(sync_openai_client, 6)]
    first = statuses.index("compacted")
    assert statuses[first + 1] == "reused", statuses
    assert len(fake_openai.summarizer_calls) == 1
    forwarded = fake_openai.last_forwarded_messages
    assert any(FAKE_SUMMARY_PREFIX in str(m["content"]) for m in forwarded)


def test_the_sync_client_streams_through_the_served_proxy(
    sync_openai_client: openai.OpenAI, fake_openai: FakeOpenAI
) -> None:
    fake_openai.replies = ["streamed word by word"]
    stream = sync_openai_client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == "streamed word by word"
    assert fake_openai.chat_calls[-1].stream


def test_an_app_that_makes_its_own_client_from_the_environment(
    served_proxy_url: str, fake_openai: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", served_proxy_url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-environment")
    with openai.OpenAI(max_retries=0) as client:  # what the application does on its own
        reports = agent_turns(client, 6)
    assert "compacted" in [report.status for report in reports]
    # The client's own credential went through the proxy to the upstream.
    assert fake_openai.chat_calls[0].headers["authorization"] == "Bearer sk-from-the-environment"
