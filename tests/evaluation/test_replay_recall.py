"""Needed-later recall: the extractor on hand-made text, and its share on a hand-made session;
the validity check on hand-made histories."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proxy.replay import validity
from proxy.replay.identifiers import identifiers, message_text
from proxy.replay.session import load
from proxy.testing import FakeOpenAI, make_settings
from tests.evaluation.replaying import replay, run_of


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "stockroom.errors.ReservationConflictError: sku=SKU-48213 expected version 17 at "
            "stockroom/reservations.py:212 in reserve_stock",
            {"ReservationConflictError", "SKU-48213", "48213", "stockroom/reservations.py",
             "212", "reserve_stock"},
        ),
        (
            "See https://status.example.com/incidents/20931. LOCK_TIMEOUT_MS is 2500 ms.",
            {"https://status.example.com/incidents/20931", "LOCK_TIMEOUT_MS", "2500"},
        ),
        (
            "Trips fell 18.4 percent, from 412,600 to 336,700; run `make check` now",
            {"18.4", "412,600", "336,700", "make check"},
        ),
        ('{"path": "tests/test_race.py", "cmd": "pytest -q"}',
         {"tests/test_race.py", "test_race", "pytest -q"}),
        ("call getUserById(7) from run.sh or ./bin/tool", {"getUserById", "run.sh", "./bin/tool"}),
        ("Order HB-100482 of 2024-05-02: 149.90", {"HB-100482", "100482", "2024", "149.90"}),
        ("tracking 1Z999AA10123456784, commit 7f04953", {"1Z999AA10123456784", "7f04953"}),
        # Not identifiers: plain words, short numbers, JSON keys, names of prose calls.
        ('the value was 42 and "path" or print(x) in a', set()),
    ],
)  # fmt: skip
def test_identifiers_are_found_as_documented(text: str, expected: set[str]) -> None:
    assert identifiers(text) == expected


def test_a_message_s_text_includes_its_tool_calls() -> None:
    message = {
        "role": "assistant",
        "content": [{"type": "text", "text": "Reading it."}, {"type": "image_url"}],
        "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "read_file", "arguments": '{"path": "a/b.py"}'}},
        ],
    }  # fmt: skip
    assert message_text(message) == 'Reading it.\nread_file\n{"path": "a/b.py"}'


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ([{"role": "user", "content": "hi"}], None),
        ([{"role": "assistant", "tool_calls": [{"id": "a"}]}, {"role": "tool", "tool_call_id": "a"},
          {"role": "user", "content": "x"}], None),
        ([{"role": "user"}, {"role": "tool", "tool_call_id": "a"}], "answers no call"),
        ([{"role": "assistant", "tool_calls": [{"id": "a"}, {"id": "b"}]},
          {"role": "tool", "tool_call_id": "a"}, {"role": "user"}], "left unanswered"),
        ([{"role": "assistant", "tool_calls": [{"id": "a"}]}], "ends with calls"),
        ([{"role": "robot", "content": "x"}], "role 'robot'"),
    ],
)  # fmt: skip
def test_validity_names_the_first_problem(messages: list[Any], problem: str | None) -> None:
    found = validity.problem(messages)
    assert found is None if problem is None else problem in (found or "")


FILLER = "and then some more plain words go here " * 40


def recall_session() -> list[dict[str, Any]]:
    """The tool output names parse_amount and AmountFormatError; the assistant uses both again
    at message 8."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You fix bugs."},
        {"role": "user", "content": "Fix the import please."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "read_file", "arguments": '{"file": "importer"}'}}]},
        {"role": "tool", "tool_call_id": "c1",
         "content": "def parse_amount(text): raise AmountFormatError(text) " + FILLER * 2},
        {"role": "assistant", "content": "Next I read the tests. " + FILLER},
        {"role": "user", "content": "go on"},
        {"role": "assistant", "content": "Still reading. " + FILLER},
        {"role": "user", "content": "continue"},
        {"role": "assistant", "content": "parse_amount raises AmountFormatError: fixing it."},
        {"role": "user", "content": "thanks"},
    ]  # fmt: skip
    ends = [2, 4, 6, 8, 10]  # each request ends with a user or tool message
    return [{"model": "gpt-4o-mini", "messages": messages[:n]} for n in ends]


async def test_recall_is_the_share_of_needed_identifiers_still_forwarded(tmp_path: Path) -> None:
    path = tmp_path / "recall.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recall_session()))
    fake = FakeOpenAI(summaries=lambda call: "The agent read parse_amount in the importer.")
    settings = make_settings(compaction={"keep_recent_ratio": 0})
    report = await replay(load([str(path)]), settings, fake, budgets=[500])
    run = run_of(report, "recall", "simple", 500)
    recall = run["recall"]
    # Every compacted turn before message 8 needs both names; the summary kept one.
    assert recall["measured_turns"] >= 1
    assert recall["needed"] == 2 * recall["measured_turns"]
    assert recall["kept"] == recall["measured_turns"]
    assert recall["mean"] == recall["worst"] == 0.5
    assert recall["lost"] == ["AmountFormatError"]
    baseline = run_of(report, "recall", "none", None)
    assert baseline["recall"]["mean"] is None  # nothing compacted, nothing measured
    assert report["summary"][0]["recall_mean"] == 1.0  # the baseline forwards everything
