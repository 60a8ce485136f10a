"""The shipped sample sessions: made by our generator, and of the shapes sessions/README.md
promises."""

from __future__ import annotations

import json
import lzma
import re
from typing import Any

import pytest

from proxy.compaction.chat_format import DEFAULT_INJECTED
from proxy.replay import samples, validity
from proxy.replay.identifiers import identifiers, message_text
from proxy.replay.session import load
from proxy.settings import Settings
from proxy.tokens import TokenCounter
from tests.evaluation.replaying import SESSIONS


@pytest.fixture(scope="module")
def counter() -> Any:
    counter = TokenCounter(Settings())
    counter.load()
    yield counter
    counter.close()


@pytest.mark.parametrize("name", sorted(samples.SESSIONS))
def test_the_shipped_file_is_what_the_generator_writes(name: str) -> None:
    shipped = lzma.decompress((SESSIONS / f"{name}.jsonl.xz").read_bytes())
    assert shipped == b"".join(samples.lines_of(samples.SESSIONS[name](samples.SEED)))


def final(name: str) -> tuple[list[dict[str, Any]], list[Any], int]:
    [session] = load([str(SESSIONS / f"{name}.jsonl.xz")])
    return session.final, session.tools, session.turns


def calls(messages: list[dict[str, Any]]) -> list[list[Any]]:
    return [m["tool_calls"] for m in messages if m.get("tool_calls")]


def injected(message: dict[str, Any]) -> bool:
    return any(re.search(p, message_text(message)) for p in DEFAULT_INJECTED)


def is_empty(result: str) -> bool:
    """An empty tool result: nothing, or JSON with nothing in it."""
    if not result.strip():
        return True
    try:
        value = json.loads(result)
    except ValueError:
        return False
    return value in ([], {}) or (isinstance(value, dict) and all(v == [] for v in value.values()))


def back_references(messages: list[dict[str, Any]]) -> set[str]:
    """Identifiers of the first fifth of the history that assistant messages of its last
    third use again."""
    early: set[str] = set()
    for message in messages[: len(messages) // 5]:
        early |= identifiers(message_text(message))
    late: set[str] = set()
    for message in messages[-len(messages) // 3 :]:
        if message["role"] == "assistant":
            late |= identifiers(message_text(message))
    return early & late


@pytest.mark.parametrize("name", sorted(samples.SESSIONS))
def test_every_request_is_valid_and_extends_the_one_before(name: str) -> None:
    [session] = load([str(SESSIONS / f"{name}.jsonl.xz")])
    previous: list[Any] = []
    for raw in session.lines:
        messages = json.loads(raw)["messages"]
        assert validity.problem(messages) is None
        assert messages[: len(previous)] == previous
        previous = messages


def test_the_coding_agent(counter: Any) -> None:
    messages, _, turns = final("coding-agent")
    made = calls(messages)
    users = [m for m in messages if m["role"] == "user"]
    assert turns >= 200
    assert sum(len(c) for c in made) >= 150
    assert sum(1 for c in made if len(c) > 1) >= 10  # parallel calls
    assert sum(1 for m in users if injected(m)) == 1
    assert sum(1 for m in users if not injected(m)) <= 2  # one task (and a last question on it)
    outputs = [counter.count_message("gpt-4.1", m) for m in messages if m["role"] == "tool"]
    assert max(outputs) >= 4000  # huge tool outputs
    assert 90_000 <= counter.count_request({"model": "gpt-4.1", "messages": messages}) <= 150_000
    refs = back_references(messages)
    assert {"SKU-48213", "INC-20931", "reserve_stock", "stockroom/reservations.py"} <= refs


def test_the_support_chat() -> None:
    messages, tools, _ = final("support-chat")
    users = [m for m in messages if m["role"] == "user"]
    assert len(users) >= 25
    assert all(len(m["content"]) < 120 for m in users)  # short turns
    assert len(tools) >= 12
    results = [m["content"] for m in messages if m["role"] == "tool"]
    empty = [r for r in results if is_empty(r)]
    assert len(empty) >= 3
    assert {"HB-100482", "RF-30917", "1Z999AA10123456784"} <= back_references(messages)


def test_the_research_agent(counter: Any) -> None:
    messages, _, _ = final("research-agent")
    pages = [m for m in messages if m["role"] == "tool" and m["content"].startswith("URL: ")]
    assert len(pages) >= 20
    assert min(counter.count_message("gpt-4.1-mini", m) for m in pages) >= 1500  # long pages
    first_page = pages[0]["content"]
    later = " ".join(message_text(m) for m in messages[-10:] if m["role"] == "assistant")
    # The answer rests on facts of the first pages.
    for fact in ("412,600", "336,700", "18.4", "41.2", "33.9"):
        assert fact in later
    assert "412,600" in first_page
