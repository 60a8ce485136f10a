"""StructuredCompaction: the same cut as SimpleCompaction, a fixed template, extended
section by section, under its own prompt version."""

from __future__ import annotations

from typing import Any

from compaction_fakes import FakeSummarizer, compact_message

from proxy.compaction.prompt import (
    COMPACT_PROMPT,
    STRUCTURED_EXTEND_PROMPT,
    STRUCTURED_PROMPT,
    SUMMARY_MARKER,
)
from proxy.compaction.protocol import Message, Summarizing
from proxy.compaction.simple import SimpleCompaction
from proxy.compaction.structured import StructuredCompaction


def msg(role: str, content: Any = None, **extra: Any) -> Message:
    return {"role": role, "content": content, **extra}


HISTORY = [
    msg("system", "rules"),
    msg("user", "fix ledger/csv_import.py"),
    msg("assistant", "reading it"),
    msg("user", "the error is ValueError: bad amount '1.234,56'"),
    msg("assistant", "found it"),
    msg("user", "go on"),
]


def test_satisfies_the_protocol_and_cuts_like_simple() -> None:
    structured = StructuredCompaction(2)
    assert isinstance(structured, Summarizing)
    assert structured.cut(HISTORY).index == SimpleCompaction(2).cut(HISTORY).index


def test_asks_for_the_template_with_facts_kept_verbatim() -> None:
    message = compact_message(StructuredCompaction(2), HISTORY)
    assert message is not None
    content = message["content"]
    assert content.endswith(STRUCTURED_PROMPT) and COMPACT_PROMPT not in content
    for heading in ("## Goal", "## Constraints and decisions", "## Done", "## Open items"):
        assert heading in STRUCTURED_PROMPT
    assert "## Key facts" in STRUCTURED_PROMPT and "character for character" in STRUCTURED_PROMPT


async def test_extending_gives_the_summary_back_to_be_updated_by_section(
    fake: FakeSummarizer,
) -> None:
    structured = StructuredCompaction(2)
    span = HISTORY[3:5]
    await structured.summarize_span(fake, span, previous_summary="## Goal\nfix the importer")
    content = fake.content(0)
    assert content.startswith(f"## Message 1\nRole: user\nContent:\n{SUMMARY_MARKER}\n## Goal")
    assert content.endswith(STRUCTURED_EXTEND_PROMPT)
    assert "section by section" in STRUCTURED_EXTEND_PROMPT
    assert "keep every line exactly" in STRUCTURED_EXTEND_PROMPT


def test_its_fingerprint_differs_and_follows_its_settings() -> None:
    simple, structured = SimpleCompaction(2), StructuredCompaction(2)
    assert simple.fingerprint != structured.fingerprint
    assert structured.fingerprint == StructuredCompaction(5).fingerprint  # the cut: not text
    assert structured.fingerprint != StructuredCompaction(2, summary_max_tokens=999).fingerprint
    assert structured.fingerprint != StructuredCompaction(2, custom_instruction="SQL").fingerprint
    assert structured.fingerprint != StructuredCompaction(2, summary_role="system").fingerprint
