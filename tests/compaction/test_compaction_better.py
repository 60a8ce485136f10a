"""Where SimpleCompaction deliberately does better than the reference: one test per item."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from compaction_fakes import FakeSummarizer
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.compaction import render
from proxy.compaction.prompt import SUMMARY_MARKER
from proxy.compaction.protocol import Message, SummarizerError
from proxy.compaction.render import TOOL_ARGUMENTS_MAX_CHARS, cap_tokens, default_count_tokens
from proxy.compaction.simple import SimpleCompaction


def msg(role: str, content: Any = None, **extra: Any) -> Message:
    return {"role": role, "content": content, **extra}


def call(call_id: str, name: str = "run", arguments: str = "{}") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def compact_text(compaction: SimpleCompaction, history: list[Message]) -> str:
    cut = compaction.cut(history)
    assert cut.to_compact
    content = compaction.render(cut.to_compact)["content"]
    assert isinstance(content, str)
    return content


# -- pinned system/developer messages ---------------------------------------------------------


async def test_leading_system_and_developer_messages_are_pinned(fake: FakeSummarizer) -> None:
    history = [
        msg("system", "SYSTEM-RULES"),
        msg("developer", "DEV-RULES"),
        msg("user", "u1"),
        msg("system", "mid-conversation note"),
        msg("assistant", "a1"),
        msg("user", "u2"),
        msg("assistant", "a2"),
        msg("user", "u3"),
    ]
    prepared = SimpleCompaction(2).cut(history)
    assert prepared.pinned == history[:2] and prepared.pinned[0] is history[0]
    assert prepared.to_compact == history[2:6] and prepared.index == 6
    content = compact_text(SimpleCompaction(2), history)
    assert "RULES" not in content
    assert "mid-conversation note" in content  # only leading ones are pinned
    assert content.startswith("## Message 1\nRole: user\n")

    result = await SimpleCompaction(2).compact(history, fake)
    assert result[0] is history[0] and result[1] is history[1]
    assert result[2]["content"].startswith(SUMMARY_MARKER)
    assert result[3:] == history[6:]


def test_only_pinned_messages_is_a_no_op() -> None:
    history = [msg("system", "s"), msg("developer", "d")]
    prepared = SimpleCompaction(0).cut(history)
    assert not prepared.to_compact and prepared.pinned == history
    assert not SimpleCompaction(1).cut(history).to_compact


# -- tool calls rendered ----------------------------------------------------------------------


def test_assistant_tool_calls_are_rendered_with_name_and_arguments() -> None:
    history = [
        msg("user", "look"),
        msg("assistant", "checking", tool_calls=[call("c1", "grep", '{"pattern": "TODO"}')]),
        msg("tool", "3 matches", tool_call_id="c1"),
        msg("assistant", "found 3"),
        msg("user", "fix them"),
        msg("assistant", "fixed"),
    ]
    content = compact_text(SimpleCompaction(2), history)
    assert 'checking\n[tool call c1] grep({"pattern": "TODO"})' in content
    assert "[result of tool call c1]\n3 matches" in content


def test_long_and_odd_tool_arguments_are_truncated_not_fatal() -> None:
    long_args = json.dumps({"code": "x" * 50_000, "tail": "END-MARK"})
    history = [
        msg("user", "write"),
        msg(
            "assistant",
            None,
            tool_calls=[
                call("c1", "write_file", long_args),
                {"id": "c2", "function": {"name": "obj", "arguments": {"a": 1}}},
                {"id": "c3", "function": "garbage"},
                "not a call",
            ],
        ),
        msg("tool", "ok", tool_call_id="c1"),
        msg("tool", "ok", tool_call_id="c2"),
        msg("tool", "ok", tool_call_id="c3"),
        msg("user", "next"),
        msg("assistant", "sure"),
    ]
    content = compact_text(SimpleCompaction(2), history)
    line = next(x for x in content.splitlines() if x.startswith("[tool call c1]"))
    assert len(line) < TOOL_ARGUMENTS_MAX_CHARS + 100
    assert line.startswith('[tool call c1] write_file({"code": "xxx') and "END-MARK" in line
    assert '[tool call c2] obj({"a": 1})' in content
    assert "[tool call c3] ?()" in content


# -- junk stripped ----------------------------------------------------------------------------


def strip_by_patterns(text: str) -> str:
    """strip_reasoning's three patterns, always applied."""
    text = render._REASONING_BLOCK.sub("", text)
    if render._UNCLOSED_OPEN.match(text):
        return ""
    return render._STRAY_CLOSE.sub("", text, count=1).strip()


_PIECES = st.sampled_from(
    ["<think>", "</think>", "<THINKING>", "</reasoning>", "<", ">", "/", " ", "\n", "a", "é"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_PIECES | st.text(max_size=5), max_size=12).map("".join))
def test_reasoning_is_stripped_as_the_patterns_strip_it(text: str) -> None:
    assert render.strip_reasoning(text) == strip_by_patterns(text)


def test_empty_parts_media_and_reasoning_are_stripped() -> None:
    parts = [
        {"type": "text", "text": ""},
        {"type": "text", "text": "   \n "},
        {"type": "text", "text": "look at this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 10_000}},
        {"type": "input_audio", "input_audio": {"data": "B" * 10_000, "format": "wav"}},
        {"type": "file", "file": {"filename": "spec.pdf", "file_data": "C" * 10_000}},
        {"type": "thinking", "thinking": "hmm"},
        {"type": "redacted_thinking", "data": "zzz"},
        {"type": "some_future_part", "text": "FUTURE"},
    ]
    history = [msg("user", parts), msg("assistant", "  "), msg("user", "u"), msg("assistant", "a")]
    content = compact_text(SimpleCompaction(2), history)
    body = content.split("## Message 2")[0]
    assert body == "## Message 1\nRole: user\nContent:\nlook at this\n[image]\n[audio]\n" + (
        "[file: spec.pdf]\n\n"
    )
    for junk in ("AAAA", "BBBB", "CCCC", "hmm", "zzz", "FUTURE"):
        assert junk not in content
    assert "## Message 2\nRole: assistant\nContent:\n\n\n" in content  # whitespace-only: empty


@pytest.mark.parametrize(
    "odd",
    [
        msg("user", None),
        msg("user", 42),
        msg("user", {"type": "text", "text": "dict as content"}),
        msg("user", [None, 3, ["nested"], {"type": ["x"]}, {"type": "text", "text": None}]),
        {"content": "no role"},
        msg(None, "null role"),  # type: ignore[arg-type]
        msg("assistant", "x", tool_calls="garbage", function_call=[1]),
        msg("tool", "x", tool_call_id=7),
        msg("assistant", [{"type": "refusal", "refusal": "no"}, {"type": "text", "text": 5}]),
    ],
)
async def test_odd_shapes_never_raise(odd: Message, fake: FakeSummarizer) -> None:
    history = [odd, msg("user", "u"), msg("assistant", "a")]
    before = copy.deepcopy(history)
    result = await SimpleCompaction(2, keep_last_user_message=False).compact(history, fake)
    assert len(fake.calls) == 1 and len(result) == len(history)
    assert history == before


# -- per-message cap and folding --------------------------------------------------------------


def test_each_message_is_capped_head_and_tail() -> None:
    huge = "HEAD-" + "log line\n" * 100_000 + "-TAIL"
    history = [
        msg("user", "run it"),
        msg("tool", huge),
        msg("user", "u"),
        msg("assistant", "a"),
    ]
    content = compact_text(SimpleCompaction(2, max_message_tokens=500), history)
    assert default_count_tokens(content) < 500 + 1000  # the message plus the prompt
    assert "HEAD-" in content and "-TAIL" in content and "characters omitted" in content


def test_cap_uses_the_given_token_counter() -> None:
    def words(text: str) -> int:
        return len(text.split())

    text = " ".join(f"w{i}" for i in range(10_000))
    capped, tokens = cap_tokens(text, 100, words)
    assert tokens == words(capped) and tokens <= 100
    assert capped.startswith("w0 w1") and capped.endswith("w9999")
    assert cap_tokens("short text", 100, words) == ("short text", 2)


async def test_a_span_larger_than_the_window_is_folded(fake: FakeSummarizer) -> None:
    compaction = SimpleCompaction(
        2, summarizer_context_tokens=6000, summary_max_tokens=500, max_message_tokens=1000
    )
    span = [msg("user" if i % 2 else "assistant", f"M{i:02d} " + "y" * 3000) for i in range(20)]
    seen: list[tuple[int, str, int]] = []

    async def on_chunk(n: int, summary: Any) -> None:
        seen.append((n, summary.text, summary.usage.input_tokens))

    result = await compaction.summarize_span(fake, span, on_chunk=on_chunk)

    assert len(fake.calls) > 1
    assert [n for n, _, _ in seen] == sorted({n for n, _, _ in seen}) and seen[-1][0] == 20
    assert result.text == f"summary {len(fake.calls)}"
    assert result.usage.input_tokens == 10 * len(fake.calls)
    assert [u for _, _, u in seen] == [10 * (i + 1) for i in range(len(seen))]
    for i in range(len(fake.calls)):
        assert default_count_tokens(fake.content(i)) <= 6000 - 500
    # Each later chunk extends the previous summary, rendered as message 1.
    assert SUMMARY_MARKER + "\nsummary 1" in fake.content(1).split("## Message 2")[0]
    # Every message was summarized exactly once, in order.
    order = [m for i in range(len(fake.calls)) for m in _markers(fake.content(i))]
    assert order == [f"M{i:02d}" for i in range(20)]
    # Each chunk is exactly what render() gives for it.
    first_chunk = len(_markers(fake.content(0)))
    assert fake.content(0) == compaction.render(span[:first_chunk])["content"]


def _markers(content: str) -> list[str]:
    return [word for word in content.split() if len(word) == 3 and word.startswith("M")]


async def test_no_fold_when_it_fits(fake: FakeSummarizer) -> None:
    span = [msg("user", "a"), msg("assistant", "b")]
    compaction = SimpleCompaction(2)
    summary = await compaction.summarize_span(fake, span, previous_summary="old")
    assert len(fake.calls) == 1 and summary.text == "summary 1"
    assert fake.content(0) == compaction.render(span, previous_summary="old")["content"]


def test_render_with_previous_summary_is_a_history_starting_with_it() -> None:
    compaction = SimpleCompaction(2, summary_role="system")
    span = [msg("user", "a"), msg("assistant", "b")]
    with_summary = compaction.render(span, previous_summary="S", custom_instruction="focus")
    as_history = compaction.render(
        [compaction.summary_message("S"), *span], custom_instruction="focus"
    )
    assert with_summary == as_history
    assert with_summary["content"].startswith(
        f"## Message 1\nRole: system\nContent:\n{SUMMARY_MARKER}"
    )


async def test_an_empty_summary_is_an_error() -> None:
    history = [msg("user", "a"), msg("assistant", "b"), msg("user", "c"), msg("assistant", "d")]
    with pytest.raises(SummarizerError) as info:
        await SimpleCompaction(2).compact(history, FakeSummarizer(["<think>only this</think>"]))
    assert info.value.reason == "summarizer_empty"


# -- tool pairs never orphaned ----------------------------------------------------------------


def test_cut_moves_back_rather_than_orphan_a_tool_result() -> None:
    history = [
        msg("user", "u0"),
        msg("assistant", None, tool_calls=[call("c1"), call("c2")]),
        msg("tool", "r1", tool_call_id="c1"),
        msg("assistant", "interim"),  # odd but seen: text between results
        msg("tool", "r2", tool_call_id="c2"),
        msg("user", "u1"),
    ]
    prepared = SimpleCompaction(2, keep_last_user_message=False).cut(history)
    assert prepared.index == 1  # not 3, which would orphan r2


def test_cut_moves_back_rather_than_orphan_a_tool_calls_message() -> None:
    history = [
        msg("user", "u0"),
        msg("assistant", "a0"),
        msg("tool", "early result", tool_call_id="c9"),  # result listed before its call
        msg("assistant", None, tool_calls=[call("c9")]),
        msg("user", "u1"),
    ]
    prepared = SimpleCompaction(2, keep_last_user_message=False).cut(history)
    assert prepared.index == 2


def test_results_without_ids_pair_with_the_nearest_call() -> None:
    history = [
        msg("user", "u0"),
        msg("assistant", None, function_call={"name": "f", "arguments": "{}"}),
        msg("assistant", "between"),
        msg("function", "legacy result", name="f"),
        msg("user", "u1"),
    ]
    prepared = SimpleCompaction(2, keep_last_user_message=False).cut(history)
    assert prepared.index == 1


# -- the latest user message survives -------------------------------------------------------


def test_agent_loop_keeps_the_latest_user_message() -> None:
    history = [
        msg("system", "s"),
        msg("user", "old ask"),
        msg("assistant", "old answer"),
        msg("user", "LATEST ASK"),
        msg("assistant", None, tool_calls=[call("c1")]),
        msg("tool", "r1", tool_call_id="c1"),
        msg("assistant", None, tool_calls=[call("c2")]),
        msg("tool", "r2", tool_call_id="c2"),
    ]
    prepared = SimpleCompaction(2).cut(history)
    assert prepared.index == 3 and prepared.to_preserve[0] is history[3]
    assert prepared.to_compact == history[1:3]
    reference_like = SimpleCompaction(2, keep_last_user_message=False).cut(history)
    assert reference_like.index == 4  # the reference would have summarized the latest ask


def test_nothing_to_do_when_the_latest_user_message_is_first() -> None:
    history = [
        msg("user", "ASK"),
        msg("assistant", None, tool_calls=[call("c1")]),
        msg("tool", "r1", tool_call_id="c1"),
        msg("assistant", "done"),
    ]
    assert not SimpleCompaction(1).cut(history).to_compact


def test_summary_role_is_configurable() -> None:
    assert SimpleCompaction(summary_role="assistant").summary_message("x") == {
        "role": "assistant",
        "content": f"{SUMMARY_MARKER}\nx",
    }


# -- invariants over random agent histories ---------------------------------------------------


@st.composite
def agent_histories(draw: st.DrawFn) -> list[Message]:
    history: list[Message] = []
    if draw(st.booleans()):
        history.append(msg("system", "sys"))
    ids = iter(range(10_000))
    for _ in range(draw(st.integers(0, 8))):
        history.append(msg("user", "ask"))
        for _ in range(draw(st.integers(0, 3))):
            calls = [call(f"c{next(ids)}") for _ in range(draw(st.integers(1, 3)))]
            history.append(
                msg("assistant", draw(st.sampled_from([None, "text"])), tool_calls=calls)
            )
            results = draw(st.permutations([msg("tool", "r", tool_call_id=c["id"]) for c in calls]))
            if draw(st.booleans()):  # some clients interleave text between results
                results.insert(draw(st.integers(0, len(results))), msg("assistant", "interim"))
            history.extend(results)
        if draw(st.booleans()):
            history.append(msg("assistant", "answer"))
    return history


@settings(max_examples=300, deadline=None)
@given(history=agent_histories(), n=st.integers(0, 5), keep_user=st.booleans())
def test_cut_invariants(history: list[Message], n: int, keep_user: bool) -> None:
    before = copy.deepcopy(history)
    prepared = SimpleCompaction(n, keep_last_user_message=keep_user).cut(history)
    parts = prepared.pinned + prepared.to_compact + prepared.to_preserve
    assert len(parts) == len(history) and all(a is b for a, b in zip(parts, history, strict=True))
    assert prepared.index == len(prepared.pinned) + len(prepared.to_compact)
    assert history == before

    compacted_calls = {c["id"] for m in prepared.to_compact for c in m.get("tool_calls") or []}
    preserved_calls = {c["id"] for m in prepared.to_preserve for c in m.get("tool_calls") or []}
    for m in prepared.to_preserve:
        if m["role"] == "tool":
            assert m["tool_call_id"] in preserved_calls
    for m in prepared.to_compact:
        if m["role"] == "tool":
            assert m["tool_call_id"] in compacted_calls

    if prepared.to_compact:
        counted = [m for m in prepared.to_preserve if m["role"] in ("user", "assistant")]
        assert len(counted) >= n
        users = [i for i, m in enumerate(history) if m["role"] == "user"]
        if keep_user and users:
            assert users[-1] >= prepared.index
