"""The turn memo: a body parsed from a kept earlier one answers exactly what a cold parse
does, and whole requests forward the same bytes with the same headers either way."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy import jsonspans
from proxy.app import create_app
from proxy.compaction.prompt import SYSTEM_PROMPT
from proxy.jsonspans import Spans
from proxy.turnmemo import HEAD_BYTES, TurnMemo, size_of
from proxy.validation import SPANS_MIN_AVERAGE, parse_chat
from tests.conftest import make_settings
from tests.test_jsonspans import FORMATS, encoded, messages

SYSTEM = {"role": "system", "content": "You are a coding agent. " + "Follow the rules. " * 120}


def history(turns: int, *, size: int = 1500, first: int = 0) -> list[dict[str, Any]]:
    """A system prompt, a task, then per turn a tool call and its result."""
    out: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Fix the parser tests."}]
    for turn in range(first, first + turns):
        call = {"id": f"call_{turn}", "type": "function"}
        call["function"] = {"name": "run", "arguments": json.dumps({"cmd": f"pytest -k {turn}"})}
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        out.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": f"{turn} " * size})
    return out


def compact(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode("utf-8", "surrogatepass")


def cold(raw: bytes, min_average: int = SPANS_MIN_AVERAGE) -> tuple[dict[str, Any], Spans]:
    parsed = jsonspans.loads_chat_fast(raw, 0, min_average)
    assert parsed, "the fixtures are bodies the fast path parses"
    return parsed


def assert_same(got: tuple[dict[str, Any], Spans], want: tuple[dict[str, Any], Spans]) -> None:
    (body, spans), (cold_body, cold_spans) = got, want
    assert body == cold_body
    assert body["messages"] is spans.messages
    assert (spans.open, spans.close) == (cold_spans.open, cold_spans.close)
    assert spans.starts == cold_spans.starts and spans.ends == cold_spans.ends
    assert spans.messages == cold_spans.messages
    assert spans.keys() == cold_spans.keys()
    assert [spans.index_of(m) for m in spans.messages] == list(range(len(spans.messages)))


def kept(raw: bytes, scope: str = "s") -> TurnMemo:
    memo = TurnMemo(64 << 20)
    spans = cold(raw)[1]
    spans.keys(), spans.index_of(None)
    assert memo.keep(scope, spans)
    return memo


def test_appended_and_resent_bodies_are_parsed_from_the_kept_one() -> None:
    first = compact({"model": "gpt-4o", "messages": history(6)})
    memo = kept(first)
    for later in (
        compact({"model": "gpt-4o", "messages": history(7)}),  # two new messages
        first,  # the same body again
        compact({"model": "gpt-4o", "messages": history(9), "tools": [{"type": "x"}]}),
        compact({"model": "gpt-4.1", "messages": history(8)}),  # other model (before messages)
        compact({"messages": history(8), "model": "o3", "temperature": 0}),
    ):
        hit = memo.parse("s", later)
        assert hit is not None
        assert_same(hit[:2], cold(later))


def test_what_does_not_extend_the_kept_bytes_misses() -> None:
    first = compact({"model": "gpt-4o", "messages": history(6)})
    memo = kept(first)
    edited = history(7)
    edited[3] = {**edited[3], "content": edited[3]["content"] + "!"}
    same_size = history(7)  # one byte changed: every span where the kept one says
    same_size[3] = {**same_size[3], "content": "X" + same_size[3]["content"][1:]}
    spaced = json.dumps({"model": "gpt-4o", "messages": history(7)}).encode()
    shorter = compact({"model": "gpt-4o", "messages": history(5)})
    for later in (
        compact({"model": "gpt-4o", "messages": edited}),
        compact({"model": "gpt-4o", "messages": same_size}),
        spaced,
        shorter,
    ):
        assert memo.parse("s", later) is None
    assert memo.parse("other tenant", compact({"model": "gpt-4o", "messages": history(7)})) is None


def test_new_messages_the_fast_path_cannot_read_are_left_to_the_cold_parser() -> None:
    first = compact({"model": "gpt-4o", "messages": history(6)})
    memo = kept(first)
    for odd in ('{"role":"user","content":"\\ud800"}', '{"role":"user","n":NaN}', "1", "{}"):
        raw = first.replace(b"]}", b"," + odd.encode() + b"]}")
        assert memo.parse("s", raw) is None
    brace = {"role": "user", "content": 'looks like },{"role":"x"} and }]}'}
    raw = compact({"model": "gpt-4o", "messages": [*history(6), brace]})
    hit = memo.parse("s", raw)
    assert hit is not None and hit[0]["messages"][-1] == brace
    assert_same(hit[:2], cold(raw))


def test_tiny_new_messages_get_the_cold_parsers_answer() -> None:
    """Past the fast path's tiny-message checks the cold parser hands the body to the
    stdlib; a hit must not answer otherwise."""
    first = compact({"model": "m", "messages": history(2, size=200)})
    memo = kept(first)
    tiny = [{"role": "user", "content": "y"}] * 600
    raw = compact({"model": "m", "messages": [*history(2, size=200), *tiny]})
    assert jsonspans.loads_chat_fast(raw, 0, SPANS_MIN_AVERAGE) == ()
    assert memo.parse("s", raw, 0, SPANS_MIN_AVERAGE) is None


@given(
    st.lists(messages, min_size=1, max_size=5),
    st.lists(messages, max_size=4),
    st.dictionaries(st.sampled_from(["model", "tools", "z", "stream"]), st.integers(), max_size=2),
    st.sampled_from(FORMATS),
)
def test_a_hit_is_the_cold_parse(
    old: list[dict[str, Any]], new: list[dict[str, Any]], rest: dict[str, Any], form: dict[str, Any]
) -> None:
    head = [{"role": "system", "content": "x" * HEAD_BYTES}]
    before = encoded({**rest, "messages": head + old}, form)
    after = encoded({**rest, "messages": head + old + new}, form)
    first = jsonspans.loads_chat_fast(before)
    if not first:
        return  # the cold parser's business (strings it must read, ...)
    memo = TurnMemo(64 << 20)
    memo.keep("s", first[1])
    hit = memo.parse("s", after)
    want = jsonspans.loads_chat_fast(after)
    if hit is None:
        return
    assert want, "a hit where the cold path would not span-parse"
    assert_same(hit[:2], want)


def test_one_entry_per_session_bounded_by_bytes_empty_at_start() -> None:
    bodies = [compact({"model": "m", "messages": history(n)}) for n in range(4, 12)]
    memo = TurnMemo(10 * size_of(cold(bodies[-1])[1]))
    assert len(memo) == 0 and memo.bytes_used == 0
    base = None
    for raw in bodies:
        hit = memo.parse("s", raw)
        assert (hit is None) == (raw is bodies[0])
        spans = cold(raw)[1] if hit is None else hit[1]
        memo.keep("s", spans, None if hit is None else hit[2])
        base = spans
    assert len(memo) == 1 and memo.bytes_used == size_of(base) if base else False
    for tenant in range(40):  # other sessions push the oldest out; the bound holds
        raw = compact({"model": "m", "messages": history(8, first=tenant * 100)})
        memo.keep(f"t{tenant}", cold(raw)[1])
        assert memo.bytes_used <= memo.max_bytes
    assert TurnMemo(0).parse("s", bodies[0]) is None


@pytest.mark.asyncio
async def test_parse_chat_checks_new_messages_and_words_errors_as_cold() -> None:
    memo = TurnMemo(64 << 20)
    first = compact({"model": "m", "messages": history(6)})
    await parse_chat(first, 0, memo, "s")
    bad = compact({"model": "m", "messages": [*history(6), {"role": "robot"}]})
    with pytest.raises(Exception) as caught:
        await parse_chat(bad, 0, memo, "s")
    with pytest.raises(Exception) as cold_error:
        await parse_chat(bad, 0)
    assert str(caught.value) == str(cold_error.value) and "messages[14].role" in str(caught.value)
    with pytest.raises(Exception) as too_many:
        await parse_chat(compact({"model": "m", "messages": history(7)}), 15, memo, "s")
    assert "array too long" in str(too_many.value)


# -- whole requests: memo on vs off ---------------------------------------------------------


class Upstream:
    """Records every request's bytes; summaries are derived from their input."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request.content)
        text = "ok"
        if SYSTEM_PROMPT.encode() in request.content[:512]:
            digest = hashlib.blake2b(request.content, digest_size=8).hexdigest()
            text = f"Summary {digest}: " + "tests pass. " * 30
        reply = {
            "id": "x",
            "object": "chat.completion",
            "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }
        return httpx.Response(200, json=reply)


def _app(turn_memo_bytes: int) -> tuple[Any, Upstream]:
    upstream = Upstream()
    settings = make_settings(
        compaction={"budget_tokens": 6000, "summarizer": {"retries": 0}},
        cache={"turn_memo_bytes": turn_memo_bytes},
    )
    return create_app(settings, transport=httpx.MockTransport(upstream)), upstream


async def _send(
    client: httpx.AsyncClient, raw: bytes, key: str, off: bool = False
) -> dict[str, str]:
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    if off:
        headers["x-compaction"] = "off"
    response = await client.post("/v1/chat/completions", content=raw, headers=headers)
    assert response.status_code == 200, response.text
    return {
        k: v
        for k, v in response.headers.items()
        if k.startswith("x-compaction") and k != "x-compaction-overhead-ms"
    }


def _session() -> list[tuple[bytes, str]]:
    """A session's turns, with the cases a memo could get wrong, under two keys."""
    tools = [{"type": "function", "function": {"name": "run", "parameters": {}}}]
    turns: list[tuple[bytes, str]] = []
    for n in range(6, 30):
        turns.append((compact({"model": "gpt-4o", "messages": history(n), "tools": tools}), "a"))
    turns.append(turns[-1])  # resent
    same_size = history(30)  # an earlier message changed, its length not
    same_size[7] = {**same_size[7], "content": "X" + same_size[7]["content"][1:]}
    turns.append((compact({"model": "gpt-4o", "messages": same_size, "tools": tools}), "a"))
    turns.append((compact({"messages": history(30), "model": "gpt-4o-mini"}), "a"))  # model after
    turns.append((compact({"model": "gpt-4o", "messages": history(30), "tools": []}), "a"))
    edited = history(31)
    edited[5] = {**edited[5], "content": "edited " + edited[5]["content"]}
    turns.append((compact({"model": "gpt-4o", "messages": edited}), "a"))
    turns.append((json.dumps({"model": "gpt-4o", "messages": history(31)}).encode(), "a"))
    odd = [*history(31), {"role": "user", "content": "\ud800 lone"}]
    turns.append((compact({"model": "gpt-4o", "messages": odd}), "a"))
    turns.append((compact({"model": "gpt-4o", "messages": [*odd, *history(1, first=40)[2:]]}), "a"))
    split = history(33)
    turns.append((compact({"model": "gpt-4o", "messages": split[:-1]}), "a"))  # call, no result
    turns.append((compact({"model": "gpt-4o", "messages": split}), "a"))  # its result
    turns.append((compact({"model": "gpt-4o", "messages": history(34)}), "b"))  # another key
    turns.append((compact({"model": "gpt-4o", "messages": history(35)}), "b"))
    many = [SYSTEM, *[{"role": "user", "content": f"note {i} " * 8} for i in range(1100)]]
    turns.append((compact({"model": "gpt-4o", "messages": many}), "a"))  # freed in slices cold
    turns.append((compact({"model": "gpt-4o", "messages": [*many, SYSTEM]}), "a"))
    big = history(8, size=70_000)  # over a MB: parsed and hashed off the loop
    turns.append((compact({"model": "gpt-4o", "messages": big}), "a"))
    turns.append((compact({"model": "gpt-4o", "messages": history(9, size=70_000)}), "a"))
    return turns


@pytest.mark.asyncio
async def test_requests_forward_the_same_bytes_and_headers_with_and_without_the_memo() -> None:
    (warm, warm_up), (cold_app, cold_up) = _app(32 << 20), _app(0)
    transports = [httpx.ASGITransport(app=app) for app in (warm, cold_app)]
    clients = [httpx.AsyncClient(transport=t, base_url="http://proxy") for t in transports]
    statuses = set()
    try:
        for raw, key in _session():
            got = [await _send(client, raw, f"sk-{key}") for client in clients]
            assert got[0] == got[1]
            statuses.add(got[0]["x-compaction-status"])
            assert warm_up.seen == cold_up.seen
        assert {"reused", "extended", "compacted"} <= statuses
        memo = warm.state.proxy.turns
        assert memo.hits >= 20
        assert cold_app.state.proxy.turns.hits == 0 and len(cold_app.state.proxy.turns) == 0
        # Two requests of one session at once: each answered as alone.
        one, two = (compact({"model": "gpt-4o", "messages": history(n)}) for n in (36, 37))
        for client in clients:
            await _send(client, compact({"model": "gpt-4o", "messages": history(35)}), "sk-c")
        together = [
            await asyncio.gather(*(_send(c, raw, "sk-c") for raw in (one, two))) for c in clients
        ]
        assert together[0] == together[1]
        assert sorted(warm_up.seen[-2:]) == sorted(cold_up.seen[-2:])
        hits = memo.hits
        await _send(clients[0], one, "sk-c", off=True)  # not compacting: not parsed from it
        assert memo.hits == hits
    finally:
        for client in clients:
            await client.aclose()


def test_store_keys_of_a_hit_reuse_the_kept_chain_and_equal_a_cold_chain() -> None:
    from proxy.store.chain import chain_hashes

    first = compact({"model": "gpt-4o", "messages": history(6)})
    memo = kept(first)
    kept_spans = memo.parse("s", first)
    assert kept_spans is not None
    base = kept_spans[2]
    chain_hashes("scope", "ns", base.messages[1:], base, base.cache)  # derived on the kept body
    assert base.cache.chains
    for later in (history(7), history(6)[:-3], [*history(7), {"role": "user", "content": "x"}]):
        raw = compact({"model": "gpt-4o", "messages": later})
        hit = memo.parse("s", raw)
        assert hit is not None or len(later) < len(base.messages)
        if hit is None:
            continue
        spans, fresh = hit[1], cold(raw)[1]
        assert spans.cache.chains and spans.cache.chains is not base.cache.chains
        for run in (slice(1, None), slice(1, 5), slice(2, None)):
            assert chain_hashes(
                "scope", "ns", spans.messages[run], spans, spans.cache
            ) == chain_hashes("scope", "ns", fresh.messages[run], fresh)
        other = chain_hashes("other scope", "ns", spans.messages[1:], spans, spans.cache)
        assert other == chain_hashes("other scope", "ns", fresh.messages[1:], fresh)


@pytest.mark.asyncio
async def test_token_counts_kept_with_a_body_are_a_cold_count_of_each_message() -> None:
    """A turn extending a kept body counts only its new messages; every count, the sum and
    the request's total equal a cold count, per encoding, and a changed byte is counted anew."""
    from proxy.tokens import TokenCounter

    settings = make_settings(compaction={"budget_tokens": 6000})
    app = create_app(settings)
    compactor, counter = app.state.proxy.compactor, app.state.proxy.counter
    tools = [{"type": "function", "function": {"name": "run", "parameters": {}}}]
    first = compact({"model": "gpt-4o", "messages": history(6), "tools": tools})
    memo = kept(first)
    base = memo.parse("s", first)
    assert base is not None
    await compactor.message_counts("gpt-4o", base[2])
    later = history(8)
    raw = compact({"model": "gpt-4o", "messages": later, "tools": tools})
    hit = memo.parse("s", raw)
    assert hit is not None
    body, spans, _ = hit
    calls = counter.encode_calls
    counts = await compactor.message_counts("gpt-4o", spans)
    alone = TokenCounter(settings)
    alone.count_each("gpt-4o", later[-4:])
    assert counter.encode_calls - calls == alone.encode_calls  # the four new messages only
    for model in ("gpt-4o", "gpt-4", "gpt-4o-mini"):
        fresh = TokenCounter(settings)  # its own memo: nothing remembered
        got = await compactor.message_counts(model, spans)
        assert got == [fresh.count_message(model, m) for m in later]
        with_tools = {**body, "model": model}
        total = counter.request_tokens(sum(got), counter.count_tools(model, with_tools))
        assert total == fresh.count_request(with_tools)
    assert await compactor.message_counts("gpt-4o", spans) == counts
    assert len(spans.cache.counts) == 2  # kept for two encodings at most
    edited = [*later[:3], {**later[3], "content": "changed"}, *later[4:]]
    again = memo.parse("s", compact({"model": "gpt-4o", "messages": edited, "tools": tools}))
    assert again is None or (await compactor.message_counts("gpt-4o", again[1]))[3] == (
        counter.count_message("gpt-4o", edited[3])
    )


@pytest.mark.asyncio
async def test_counting_each_message_stops_past_the_request_limit() -> None:
    from proxy.tokens.counter import TokenCounter, TooManyTokens

    messages = history(3, size=300)  # ~300 tokens a result
    each = TokenCounter(make_settings()).count_each("gpt-4o", messages)
    limit = 3 + sum(each[:4]) + 10  # reply priming, then room for the first four only
    counter = TokenCounter(make_settings(tokenizer={"max_request_tokens": limit}))
    with pytest.raises(TooManyTokens):
        await counter.acount_request({"model": "gpt-4o", "messages": messages})
    with pytest.raises(TooManyTokens):
        await counter.acount_each("gpt-4o", messages)
    counts = await counter.acount_each("gpt-4o", messages[:4])
    assert counts == [counter.count_message("gpt-4o", m) for m in messages[:4]]
    with pytest.raises(TooManyTokens):
        await counter.acount_each("gpt-4o", messages[:4], counted=11)
    assert counter.request_tokens(sum(counts), 10) == limit
    with pytest.raises(TooManyTokens):
        counter.request_tokens(sum(counts), 11)
