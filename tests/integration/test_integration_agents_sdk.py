"""The OpenAI Agents SDK (Responses API by default) through the proxy, over real sockets: a
multi-turn agent whose function tools return large outputs, at a budget small enough that
the proxy compacts several times. The run completes, and every request the upstream got is
valid (calls paired, reasoning whole, every field but `input` as the SDK sent it) and within
the budget."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from proxy.testing import Call, FakeOpenAI, Reply, ToolCall, make_app, serve
from tests.responses.shapes import check_forwarded

agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK (pip install openai-agents)")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.integration

BUDGET = 4000
STEPS_PER_TASK = 6
TASKS = ["Find why the nightly build fails.", "Now check the flaky test too.", "Summarize."]


class Script:
    """A tool call per step until the latest task (the last one the input names: the proxy
    keeps the user's asks verbatim) has had its steps, then an answer."""

    def __init__(self) -> None:
        self.steps: dict[str, int] = {}

    def __call__(self, call: Call) -> Reply:
        text = json.dumps(call.input)
        task = max(TASKS, key=lambda t: text.rfind(json.dumps(t)[1:-1]))
        done = self.steps.get(task, 0)
        if done < STEPS_PER_TASK:
            self.steps[task] = done + 1
            name = "read_log" if done % 2 == 0 else "grep_source"
            return Reply(tool_calls=[ToolCall(name, {"target": f"part-{done}"})], reasoning="r")
        return Reply(f"Done after {done} steps.")


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI(replies=Script())
    with serve(fake, lifespan="off") as url:
        fake.base_url = f"{url}/v1"
        yield fake


@pytest.fixture
def proxy_url(fake: FakeOpenAI) -> Iterator[str]:
    app = make_app(upstream={"base_url": fake.base_url}, compaction={"budget_tokens": BUDGET})
    with serve(app) as url:
        yield f"{url}/v1"


def test_a_multi_turn_agent_with_large_tool_outputs_completes(
    proxy_url: str, fake: FakeOpenAI
) -> None:
    sent: list[bytes] = []
    statuses: list[str] = []

    async def on_request(request: Any) -> None:
        sent.append(request.content)

    async def on_response(response: Any) -> None:
        statuses.append(response.headers.get("x-compaction-status", ""))

    @agents.function_tool
    def read_log(target: str) -> str:
        """Read the build log of a part."""
        return f"[{target}] " + "ERROR: step failed while linking module core. " * 120

    @agents.function_tool
    def grep_source(target: str) -> str:
        """Search the sources."""
        return f"[{target}] " + "src/core/link.py:42: def link(modules): ... " * 120

    async def run() -> list[str]:
        http = openai.DefaultAsyncHttpxClient(
            event_hooks={"request": [on_request], "response": [on_response]}
        )
        client = openai.AsyncOpenAI(
            base_url=proxy_url, api_key="sk-test", max_retries=0, http_client=http
        )
        agent = agents.Agent(
            name="builder",
            instructions="You fix builds. Use the tools.",
            tools=[read_log, grep_source],
            model=agents.OpenAIResponsesModel("gpt-4o-mini", client),
        )
        answers: list[str] = []
        history: list[Any] = []
        for task in TASKS:
            history = [*history, {"role": "user", "content": task}]
            result = await agents.Runner.run(
                agent, history, max_turns=STEPS_PER_TASK + 2,
                run_config=agents.RunConfig(tracing_disabled=True),
            )  # fmt: skip
            answers.append(str(result.final_output))
            history = result.to_input_list()
        await client.close()
        return answers

    answers = asyncio.run(run())
    assert answers == [f"Done after {STEPS_PER_TASK} steps."] * len(TASKS)
    calls = fake.responses_calls
    assert len(calls) == len(sent) == len(TASKS) * (STEPS_PER_TASK + 1)
    assert statuses.count("compacted") + statuses.count("extended") >= 3
    for body, call in zip(sent, calls, strict=True):
        check_forwarded(body, call.request.content)
        assert fake.responses_counter.count_request(call.body) <= BUDGET
    # The tasks reached the model verbatim in every request after they were asked.
    last = json.dumps(calls[-1].input)
    assert all(task in last for task in TASKS)
