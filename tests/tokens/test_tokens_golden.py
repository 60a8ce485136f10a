"""Golden cases: OpenAI's own examples with the `usage.prompt_tokens` its API reported.

Source: openai/openai-cookbook, examples/How_to_count_tokens_with_tiktoken.ipynb (sections 6
and 7, commit c81359cdc6744f001e40c08a192604c5113fdab3). The notebook sends each request to
the API and prints `response.usage.prompt_tokens`; the numbers below are those outputs.
"""

from __future__ import annotations

from typing import Any

import pytest

from proxy.tokens import TokenCounter

EXAMPLE_MESSAGES: list[dict[str, Any]] = [
    {
        "role": "system",
        "content": "You are a helpful, pattern-following assistant that translates corporate "
        "jargon into plain English.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "New synergies will help drive top-line growth.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Things working well together will increase revenue.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "Let's circle back when we have more bandwidth to touch base on opportunities "
        "for increased leverage.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Let's talk later when we're less busy about how to do better.",
    },
    {
        "role": "user",
        "content": "This late pivot means we don't have time to boil the ocean for the client "
        "deliverable.",
    },
]

WEATHER_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "description": "Get the current weather in a given location",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {
                        "type": "string",
                        "description": "The city and state, e.g. San Francisco, CA",
                    },
                    "unit": {
                        "type": "string",
                        "description": "The unit of temperature to return",
                        "enum": ["celsius", "fahrenheit"],
                    },
                },
                "required": ["location"],
            },
        },
    }
]

WEATHER_MESSAGES: list[dict[str, Any]] = [
    {
        "role": "system",
        "content": "You are a helpful assistant that can answer to questions about the weather.",
    },
    {"role": "user", "content": "What's the weather like in San Francisco?"},
]


@pytest.mark.parametrize(
    ("model", "api_prompt_tokens"),
    [
        ("gpt-3.5-turbo", 129),
        ("gpt-4-0613", 129),
        ("gpt-4", 129),
        ("gpt-4o", 124),
        ("gpt-4o-mini", 124),
    ],
)
def test_messages_with_names_match_the_api(
    counter: TokenCounter, model: str, api_prompt_tokens: int
) -> None:
    body = {"model": model, "messages": EXAMPLE_MESSAGES}
    assert counter.count_request(body) == api_prompt_tokens
    assert counter.count_messages(model, EXAMPLE_MESSAGES) == api_prompt_tokens


@pytest.mark.parametrize(
    ("model", "api_prompt_tokens"),
    [("gpt-3.5-turbo", 105), ("gpt-4", 105), ("gpt-4o", 101), ("gpt-4o-mini", 101)],
)
def test_function_tool_definition_matches_the_api(
    counter: TokenCounter, model: str, api_prompt_tokens: int
) -> None:
    body = {"model": model, "messages": WEATHER_MESSAGES, "tools": WEATHER_TOOLS}
    assert counter.count_request(body) == api_prompt_tokens
    assert (
        counter.count_messages(model, WEATHER_MESSAGES) + counter.count_tools(model, body)
        == api_prompt_tokens
    )


@pytest.mark.parametrize(
    ("model", "same_as"),
    [
        ("gpt-4o-2024-08-06", "gpt-4o"),
        ("openai/gpt-4o", "gpt-4o"),
        ("ft:gpt-4o-mini-2024-07-18:my-org::abc123", "gpt-4o-mini"),
        ("gpt-4-0613", "gpt-4"),
        ("gpt-3.5-turbo-0125", "gpt-3.5-turbo"),
    ],
)
async def test_dated_prefixed_and_fine_tuned_names_count_like_their_base(
    counter: TokenCounter, model: str, same_as: str
) -> None:
    body = {"model": model, "messages": WEATHER_MESSAGES, "tools": WEATHER_TOOLS}
    base = {**body, "model": same_as}
    assert counter.count_request(body) == counter.count_request(base)
    assert await counter.acount_request(body) == counter.count_request(base)


def test_legacy_functions_count_like_the_same_tools(counter: TokenCounter) -> None:
    legacy = {
        "model": "gpt-4o",
        "messages": WEATHER_MESSAGES,
        "functions": [tool["function"] for tool in WEATHER_TOOLS],
    }
    tools = {"model": "gpt-4o", "messages": WEATHER_MESSAGES, "tools": WEATHER_TOOLS}
    assert counter.count_request(legacy) == counter.count_request(tools)
