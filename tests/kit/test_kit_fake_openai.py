"""proxy.testing: FakeOpenAI behind the proxy, through the plugin's fixtures."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import respx

from proxy.testing import (
    FAKE_SUMMARY_PREFIX,
    BrokenStream,
    Call,
    CompactionReport,
    Error,
    FakeOpenAI,
    Reply,
    ToolCall,
)

AUTH = {"authorization": "Bearer sk-test"}


def history(turns: int, words: int = 60) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"step {i}: " + "log line " * words})
        messages.append({"role": "assistant", "content": f"done {i}"})
    messages.append({"role": "user", "content": "What now?"})
    return messages


def chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": messages, **extra}


async def test_usage_is_counted_with_the_proxys_own_counter(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    body = chat(history(1))
    reply = await proxy_client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert reply.status_code == 200
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] == fake_openai.counter.count_request(body)
    assert usage["prompt_tokens"] == int(reply.headers["x-compaction-tokens-before"])
    text = reply.json()["choices"][0]["message"]["content"]
    assert usage["completion_tokens"] == fake_openai.counter.count_text("gpt-4o-mini", text)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_a_reply_can_report_the_usage_it_is_given(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    usage = {"prompt_tokens": 1234, "completion_tokens": 56, "total_tokens": 1290}
    fake_openai.replies = [Reply("billed", usage=usage)]
    reply = await proxy_client.post("/v1/chat/completions", json=chat(history(1)), headers=AUTH)
    assert reply.json()["usage"] == usage


@pytest.mark.compaction_proxy(compaction={"budget_tokens": 300})
async def test_summarizer_calls_are_told_from_forwarded_chats(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    sent = history(4)
    reply = await proxy_client.post("/v1/chat/completions", json=chat(sent), headers=AUTH)
    report = CompactionReport.from_headers(reply.headers)
    assert report.status == "compacted"
    assert [c.kind for c in fake_openai.calls] == ["summarizer", "chat"]
    assert len(fake_openai.summarizer_calls) == 1
    assert len(fake_openai.chat_calls) == 1
    forwarded = fake_openai.last_forwarded_messages
    assert len(forwarded) < len(sent)
    summaries = [m for m in forwarded if FAKE_SUMMARY_PREFIX in str(m.get("content"))]
    assert len(summaries) == 1
    assert report.summary_output_tokens == fake_openai.summary_tokens  # exactly that long


async def test_the_default_summary_is_deterministic_and_its_length_configurable() -> None:
    fake = FakeOpenAI(summary_tokens=25)
    body = {"model": "gpt-4o-mini", "messages": [{"role": "system", "content": "x"}]}
    with fake.mock():
        async with httpx.AsyncClient() as client:
            from proxy.compaction.prompt import SYSTEM_PROMPT

            body["messages"] = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": "## Message 1\nRole: user\nContent:\nhi"},
            ]
            url = f"{fake.base_url}/chat/completions"
            first = (await client.post(url, json=body)).json()
            again = (await client.post(url, json=body)).json()
            body["messages"][1]["content"] += " there"
            other = (await client.post(url, json=body)).json()
    text = first["choices"][0]["message"]["content"]
    assert text.startswith(FAKE_SUMMARY_PREFIX)
    assert again["choices"][0]["message"]["content"] == text
    assert other["choices"][0]["message"]["content"] != text
    assert first["usage"]["completion_tokens"] == 25
    assert fake.counter.count_text("gpt-4o-mini", text) == 25
    assert len(fake.summarizer_calls) == 3 and fake.chat_calls == []


async def test_a_scripted_list_is_replied_in_order_then_the_default(
    openai_client: openai.AsyncOpenAI, fake_openai: FakeOpenAI
) -> None:
    fake_openai.replies = [ToolCall("read_file", {"path": "a.py"}), "first", Reply("second")]
    messages: Any = [{"role": "user", "content": "go"}]
    replies = [
        (
            await openai_client.chat.completions.create(model="gpt-4o-mini", messages=messages)
        ).choices[0]
        for _ in range(4)
    ]
    call = replies[0].message.tool_calls
    assert replies[0].finish_reason == "tool_calls"
    assert call is not None and call[0].function.name == "read_file"
    assert json.loads(call[0].function.arguments) == {"path": "a.py"}
    texts = [choice.message.content for choice in replies[1:]]
    assert texts == ["first", "second", fake_openai.reply_text]
    assert fake_openai.replies == []


async def test_a_callable_script_sees_the_forwarded_request(
    openai_client: openai.AsyncOpenAI, fake_openai: FakeOpenAI
) -> None:
    def reply(call: Call) -> str | None:
        return f"you said {call.messages[-1]['content']}" if call.model == "gpt-4o" else None

    fake_openai.replies = reply
    mine = await openai_client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
    )
    other = await openai_client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
    )
    assert mine.choices[0].message.content == "you said hi"
    assert other.choices[0].message.content == fake_openai.reply_text


async def test_streams_are_openai_shaped_with_tool_calls_and_usage(
    openai_client: openai.AsyncOpenAI, fake_openai: FakeOpenAI
) -> None:
    fake_openai.replies = [Reply("Reading it now.", [ToolCall("read_file", {"path": "b.py"})])]
    stream = await openai_client.chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "open b.py"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    text, arguments, names, finish, usage = "", "", [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for tool in choice.delta.tool_calls or []:
                if tool.function and tool.function.name:
                    names.append(tool.function.name)
                arguments += (tool.function.arguments if tool.function else None) or ""
            finish = choice.finish_reason or finish
    assert text == "Reading it now."
    assert names == ["read_file"]
    assert json.loads(arguments) == {"path": "b.py"}
    assert finish == "tool_calls"
    assert usage is not None
    assert usage.prompt_tokens == fake_openai.counter.count_request(fake_openai.chat_calls[0].body)


async def test_errors_on_demand_reach_the_client_as_sent(
    openai_client: openai.AsyncOpenAI, fake_openai: FakeOpenAI
) -> None:
    fake_openai.replies = [Error(429, message="slow down", headers={"retry-after": "3"})]
    with pytest.raises(openai.RateLimitError) as caught:
        await openai_client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.response.headers["retry-after"] == "3"
    assert caught.value.body == {
        "message": "slow down",
        "type": "server_error",
        "param": None,
        "code": "rate_limit_exceeded",
    }


async def test_an_error_body_can_be_anything(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    fake_openai.replies = [Error(503, body={"detail": "maintenance"})]
    reply = await proxy_client.post("/v1/chat/completions", json=chat(history(0)), headers=AUTH)
    assert reply.status_code == 503
    assert reply.json() == {"detail": "maintenance"}


@pytest.mark.compaction_proxy(compaction={"budget_tokens": 300})
async def test_a_failing_summarizer_leaves_the_request_uncompacted(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    fake_openai.summaries = lambda call: Error(500)
    sent = history(4)
    reply = await proxy_client.post("/v1/chat/completions", json=chat(sent), headers=AUTH)
    assert reply.status_code == 200
    assert CompactionReport.from_headers(reply.headers).status == "failed"
    assert fake_openai.last_forwarded_messages == sent
    assert len(fake_openai.summarizer_calls) == 3  # the first try and the default 2 retries


@pytest.mark.compaction_proxy(
    compaction={"budget_tokens": 300, "summarizer": {"timeout_s": 0.2, "retries": 0}}
)
async def test_a_delayed_summary_runs_into_the_summarizer_deadline(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    fake_openai.summaries = [Reply("late", delay_s=60)]  # far beyond the 0.2 s deadline
    reply = await proxy_client.post("/v1/chat/completions", json=chat(history(4)), headers=AUTH)
    report = CompactionReport.from_headers(reply.headers)
    assert report.status == "failed"
    assert len(fake_openai.chat_calls) == 1


async def test_a_json_body_that_breaks_off_is_a_502(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI
) -> None:
    fake_openai.replies = [BrokenStream()]
    reply = await proxy_client.post("/v1/chat/completions", json=chat(history(0)), headers=AUTH)
    assert reply.status_code == 502
    assert reply.json()["error"]["code"] == "upstream_broke_off"


async def test_a_stream_that_breaks_off_stops_after_the_chunks_asked_for() -> None:
    fake = FakeOpenAI(replies=[BrokenStream("one two three", after_chunks=2)])
    received: list[bytes] = []
    with fake.mock():
        async with httpx.AsyncClient() as client:
            body = chat([{"role": "user", "content": "hi"}], stream=True)
            async with client.stream("POST", f"{fake.base_url}/chat/completions", json=body) as r:
                with pytest.raises(httpx.RemoteProtocolError):
                    async for chunk in r.aiter_bytes():
                        received.append(chunk)
    events = [json.loads(line[6:]) for line in b"".join(received).decode().split("\n\n") if line]
    assert [e["choices"][0]["delta"].get("content") for e in events] == ["", "one", " two"]


async def test_models_are_listed_and_looked_up(
    openai_client: openai.AsyncOpenAI, fake_openai: FakeOpenAI
) -> None:
    listed = [m.id async for m in openai_client.models.list()]
    assert listed == fake_openai.models
    assert (await openai_client.models.retrieve("gpt-4o")).id == "gpt-4o"
    with pytest.raises(openai.NotFoundError):
        await openai_client.models.retrieve("no-such-model")
    assert [c.kind for c in fake_openai.calls] == ["models"] * 3


async def test_what_the_fake_does_not_serve_falls_through_to_the_tests_own_routes(
    proxy_client: httpx.AsyncClient, fake_openai: FakeOpenAI, respx_mock: respx.MockRouter
) -> None:
    assert fake_openai.router is not None
    fake_openai.router.post(f"{fake_openai.base_url}/embeddings").respond(json={"data": []})
    respx_mock.get(f"{fake_openai.base_url}/files").respond(json={"object": "list"})
    embeddings = await proxy_client.post("/v1/embeddings", json={"input": "x"}, headers=AUTH)
    files = await proxy_client.get("/v1/files", headers=AUTH)
    chat_reply = await proxy_client.post("/v1/chat/completions", json=chat(history(0)))
    assert embeddings.json() == {"data": []}
    assert files.json() == {"object": "list"}
    assert chat_reply.status_code == 200
    assert [c.kind for c in fake_openai.calls] == ["chat"]


async def test_last_forwarded_messages_says_when_nothing_was_forwarded() -> None:
    with pytest.raises(LookupError, match="no chat completion"):
        _ = FakeOpenAI().last_forwarded_messages
