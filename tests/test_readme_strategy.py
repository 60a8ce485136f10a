"""The "Your own strategy" examples of docs/compaction.md, run as written: loaded by name, end
to end through the proxy (the summarizing one with the summary store)."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from proxy.compaction import Compaction, Summarizing
from tests.agent_sim import TOOLS, agent_turns
from tests.conftest import make_settings, respx_app
from tests.upstream_fakes import FakeUpstream

PAGE = Path(__file__).resolve().parents[1] / "docs" / "compaction.md"


def readme_examples() -> str:
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index("\n## Your own strategy\n") :]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 2, "the strategy section of docs/compaction.md has two python examples"
    return "\n\n".join(blocks)


@pytest.fixture
def my_strategies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    (tmp_path / "my_strategies.py").write_text(readme_examples(), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_strategies  # type: ignore[import-not-found]

    yield my_strategies
    sys.modules.pop("my_strategies", None)


async def run(strategy: str | list[str], turns: int = 60) -> tuple[FakeUpstream, list[Any]]:
    fake = FakeUpstream()
    settings = make_settings(
        compaction={"budget_tokens": 2000, "strategy": strategy}, cache={"backend": "memory"}
    )
    app = respx_app(settings)
    responses = []
    with respx.mock(base_url="http://upstream.test/v1", assert_all_called=False) as router:
        fake.install(router)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://p") as client:
            for history in agent_turns(turns):
                response = await client.post(
                    "/v1/chat/completions",
                    json={"model": "gpt-4o-mini", "messages": history, "tools": TOOLS},
                    headers={"authorization": "Bearer sk-readme"},
                )
                assert response.status_code == 200
                responses.append(response)
    await app.state.proxy.upstream.client.aclose()
    return fake, responses


async def test_the_readme_compact_strategy_runs_end_to_end(my_strategies: Any) -> None:
    assert isinstance(my_strategies.ShortenOldOutputs(), Compaction)
    fake, responses = await run("my_strategies:ShortenOldOutputs", turns=40)
    statuses = {r.headers["x-compaction-status"] for r in responses}
    assert statuses <= {"passthrough", "compacted", "over_budget"} and "compacted" in statuses
    shortened = [
        m
        for body in fake.forwarded
        for m in body["messages"]
        if m["role"] == "tool" and m["content"].endswith(" [...]")
    ]
    assert shortened and all(len(m["content"]) == 206 for m in shortened)
    assert fake.summary_calls == []


async def test_the_readme_summarizing_strategy_runs_end_to_end_with_the_store(
    my_strategies: Any,
) -> None:
    assert isinstance(my_strategies.CountOmitted(), Summarizing)
    fake, responses = await run("my_strategies:CountOmitted")
    statuses = [r.headers["x-compaction-status"] for r in responses]
    for response, body in zip(responses, fake.forwarded, strict=True):
        if response.headers["x-compaction-status"] == "passthrough":
            continue
        assert int(response.headers["x-compaction-tokens-after"]) <= 2000
        summarized = response.headers["x-compaction-messages-summarized"]
        omitted = {"role": "user", "content": f"[{summarized} earlier messages omitted]"}
        assert omitted in body["messages"]
    assert fake.summary_calls == []  # the strategy never calls the summarizer
    assert statuses.count("compacted") == 1  # later ones extend the stored "summary"
    assert "reused" in statuses and "extended" in statuses


async def test_the_readme_strategies_go_in_a_list_with_the_built_ins(my_strategies: Any) -> None:
    fake, responses = await run(["mask", "my_strategies:CountOmitted"], turns=80)
    masked = [int(r.headers.get("x-compaction-messages-masked", 0)) for r in responses]
    assert any(masked)
    assert fake.summary_calls == []
