"""The README's "Your own strategy" example, run as written: loaded by name, end to end
through the proxy with the summary store."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from proxy.app import create_app
from proxy.compaction import Compaction, StrategyOptions
from tests.agent_sim import TOOLS, agent_turns
from tests.conftest import make_settings
from tests.upstream_fakes import FakeUpstream

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("#### Your own strategy") :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "no python block in the README's strategy section"
    return match.group(1)


@pytest.fixture
def my_strategies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    (tmp_path / "my_strategies.py").write_text(readme_example(), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_strategies  # type: ignore[import-not-found]

    yield my_strategies
    sys.modules.pop("my_strategies", None)


async def test_the_readme_strategy_runs_end_to_end_with_the_store(
    my_strategies: Any, upstream: respx.MockRouter
) -> None:
    fake = FakeUpstream().install(upstream)
    settings = make_settings(
        compaction={"budget_tokens": 2000, "strategy": "my_strategies:NoopCompaction"},
        cache={"backend": "memory"},
    )
    assert isinstance(my_strategies.NoopCompaction(StrategyOptions()), Compaction)
    app = create_app(settings)
    statuses: list[str] = []
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://p") as client:
        for history in agent_turns(60):
            response = await client.post(
                "/v1/chat/completions",
                json={"model": "gpt-4o-mini", "messages": history, "tools": TOOLS},
                headers={"authorization": "Bearer sk-readme"},
            )
            assert response.status_code == 200
            status = response.headers["x-compaction-status"]
            statuses.append(status)
            if status == "passthrough":
                continue
            assert status in ("compacted", "extended", "reused"), response.headers
            assert int(response.headers["x-compaction-tokens-after"]) <= 2000
            summarized = response.headers["x-compaction-messages-summarized"]
            sent = fake.forwarded[-1]["messages"]
            assert {"role": "user", "content": f"[{summarized} earlier messages omitted]"} in sent
    assert fake.summary_calls == []  # the strategy never calls the summarizer
    assert statuses.count("compacted") == 1  # later ones extend the stored "summary"
    assert "reused" in statuses and "extended" in statuses
