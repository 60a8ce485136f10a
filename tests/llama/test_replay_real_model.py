"""`replay` with a real model (llama.cpp, SmolLM2-135M) as summarizer, judge and answer model.

The model is weak, so only the report's structure is checked: every run replayed, summaries
made by the model, probes of the four kinds answered and scored in 0..5 (or unscored).
"""

from __future__ import annotations

import pytest

from proxy.replay.judge import KINDS, ModelEndpoint
from proxy.replay.session import Session
from proxy.testing import make_settings
from tests.evaluation.replaying import replay, run_of, shipped

pytestmark = pytest.mark.llama

MODEL = "smollm2-135m-instruct"
BUDGET = 1500


async def test_replay_with_a_real_summarizer_and_judge(llama_base_url: str) -> None:
    [support] = shipped("support-chat")
    session = Session(**{**support.__dict__, "lines": support.lines[:9]})
    settings = make_settings(
        compaction={
            "summary_max_tokens": 64,
            "keep_recent_ratio": 0.2,
            "summarizer": {"context_tokens": 1200, "max_message_tokens": 60, "timeout_s": 300},
        }
    )
    judge = ModelEndpoint(llama_base_url, MODEL, max_tokens=40)
    report = await replay(
        [session], settings, None, budgets=[BUDGET], summarizer_url=llama_base_url,
        summarizer_model=MODEL, judge=judge, probes_per_session=1, judge_context_tokens=1200,
    )  # fmt: skip
    run = run_of(report, "support-chat", "simple", BUDGET)
    assert run["status"] == "ok", run["error"]
    assert run["turns"] == 9
    assert run["summarizer"]["calls"] >= 1 and run["summarizer"]["output_tokens"] > 0
    assert run["statuses"].get("failed", 0) == 0
    assert run["invalid_requests"]["turns"] == 0
    probes = run["probes"]
    assert probes is not None and not probes["errors"]
    assert set(probes["by_kind"]) == set(KINDS)
    assert len(probes["items"]) == 4
    for item in probes["items"]:
        assert item["question"] and isinstance(item["full_answer"], str)
        for score in (item["full_score"], item["compacted_score"]):
            assert score is None or 0 <= score <= 5
    row = next(r for r in report["summary"] if r["strategy"] == "simple")
    assert row["probe_compacted"] is None or 0 <= row["probe_compacted"] <= 5
