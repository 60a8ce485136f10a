"""Usage accounting: the upstream's reported usage per key, model and day, streams included."""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import respx

from proxy.usage.meter import content_encoding
from proxy.usage.tap import ReportedUsage, StreamTap, usage_of_body
from tests.keys.conftest import KEY_A, KEY_B, bearer, chat, history_chat, key_entry, keyed_settings
from tests.upstream_fakes import is_summarizer_call

pytestmark = pytest.mark.usefixtures("upstream")

ADMIN = {"authorization": "Bearer admin-token"}


def sse_events(model: str, usage: dict[str, Any] | None, *, usage_null: bool) -> list[bytes]:
    """An OpenAI-shaped stream; with include_usage, chunks carry "usage":null and one extra
    usage-only chunk comes before [DONE]."""
    extra = ',"usage":null' if usage_null else ""
    events = [
        b'data: {"id":"c1","object":"chat.completion.chunk","model":"%s","choices":[{"index":0,'
        b'"delta":{"role":"assistant","content":"Hel"},"finish_reason":null}]%s}\n\n'
        % (model.encode(), extra.encode()),
        b'data: {"id":"c1","object":"chat.completion.chunk","model":"%s","choices":[{"index":0,'
        b'"delta":{"content":"lo \\u00e9"},"finish_reason":"stop"}]%s}\n\n'
        % (model.encode(), extra.encode()),
    ]
    if usage is not None:
        events.append(
            b'data: {"id":"c1","object":"chat.completion.chunk","model":"%s","choices":[],'
            b'"usage":%s}\n\n' % (model.encode(), json.dumps(usage).encode())
        )
    events.append(b"data: [DONE]\n\n")
    return events


class Upstream:
    """Replies with fixed usage; streams split into awkward chunks; records what it got."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.streams: list[bytes] = []
        self.n = 0
        self.send_usage = True

    def usage(self) -> dict[str, Any]:
        self.n += 1
        return {
            "prompt_tokens": 100 * self.n,
            "completion_tokens": 7 * self.n,
            "total_tokens": 107 * self.n,
            "prompt_tokens_details": {"cached_tokens": 10 * self.n},
        }

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if is_summarizer_call(body):
            return httpx.Response(
                200,
                json={
                    "choices": [{"message": {"role": "assistant", "content": "SUMMARY: ok"}}],
                    "usage": {"prompt_tokens": 500, "completion_tokens": 20},
                },
            )
        self.bodies.append(body)
        if not body.get("stream"):
            reply: dict[str, Any] = {"id": "c", "object": "chat.completion", "choices": []}
            if self.send_usage:
                reply["usage"] = self.usage()
            return httpx.Response(200, json=reply)
        options = body.get("stream_options") or {}
        usage = self.usage() if options.get("include_usage") and self.send_usage else None
        raw = b"".join(sse_events(body["model"], usage, usage_null=usage is not None))
        self.streams.append(raw)
        return httpx.Response(
            200, stream=Chunked(raw, 37), headers={"content-type": "text/event-stream"}
        )


class Chunked(httpx.AsyncByteStream):
    def __init__(self, data: bytes, size: int) -> None:
        self.data, self.size = data, size

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for i in range(0, len(self.data), self.size):
            yield self.data[i : i + self.size]


def without_usage_event(raw: bytes) -> bytes:
    events = raw.split(b"\n\n")
    kept = [e for e in events if b'"choices":[],"usage"' not in e]
    return b"\n\n".join(kept)


@pytest.fixture
def fake(upstream: respx.MockRouter) -> Upstream:
    fake = Upstream()
    upstream.post("/chat/completions").mock(side_effect=fake)
    return fake


def admin_settings(**extra: Any) -> Any:
    return keyed_settings(
        key_entry("team-a", KEY_A),
        key_entry("team-b", KEY_B),
        admin={"token_env": "ADMIN_TOKEN"},
        **extra,
    )


@pytest.fixture(autouse=True)
def admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADMIN_TOKEN", "admin-token")


async def test_client_stream_is_byte_identical_to_upstream_minus_the_usage_event(
    make_app: Any, fake: Upstream
) -> None:
    app = await make_app(admin_settings())
    raw_request = json.dumps(chat(stream=True)).encode()
    async with app.client.stream(
        "POST", "/v1/chat/completions", content=raw_request, headers=bearer(KEY_A)
    ) as reply:
        received = b"".join([chunk async for chunk in reply.aiter_raw()])
    assert fake.bodies[-1]["stream_options"] == {"include_usage": True}
    upstream_raw = fake.streams[-1]
    assert b'"choices":[],"usage"' in upstream_raw
    assert received == without_usage_event(upstream_raw)
    assert received != upstream_raw
    await app.state.meter.join()
    rows = (await app.client.get("/admin/usage", headers=ADMIN)).json()["data"]
    assert rows[0]["prompt_tokens_forwarded"] == 100
    assert rows[0]["completion_tokens"] == 7
    assert rows[0]["estimated_requests"] == 0


async def test_a_client_that_asked_for_usage_gets_the_stream_exactly(
    make_app: Any, fake: Upstream
) -> None:
    app = await make_app(admin_settings())
    body = chat(stream=True, stream_options={"include_usage": True})
    async with app.client.stream(
        "POST", "/v1/chat/completions", json=body, headers=bearer(KEY_A)
    ) as reply:
        received = b"".join([chunk async for chunk in reply.aiter_raw()])
    assert received == fake.streams[-1]
    assert b'"choices":[],"usage"' in received


async def test_usage_after_a_mix_equals_what_the_upstream_reported(
    make_app: Any, fake: Upstream
) -> None:
    app = await make_app(admin_settings())
    long = history_chat(words=100)
    sent = [
        (KEY_A, chat(), {}),
        (KEY_A, chat(stream=True), {}),
        (KEY_A, {**long, "stream": True}, {"x-compaction": "force"}),
        (KEY_A, long, {"x-compaction": "force"}),
        (KEY_B, chat("gpt-4o"), {}),
        (KEY_A, chat(stream=True, stream_options={"include_usage": True}), {}),
    ]
    statuses, counted_a = [], 0
    for key, body, headers in sent:
        reply = await app.client.post(
            "/v1/chat/completions", json=body, headers={**bearer(key), **headers}
        )
        await reply.aread()
        assert reply.status_code == 200
        statuses.append(reply.headers["x-compaction-status"])
        if key == KEY_A:
            counted_a += int(reply.headers["x-compaction-tokens-before"])
    assert statuses.count("compacted") + statuses.count("reused") == 2
    await app.state.meter.join()
    data = (await app.client.get("/admin/usage", headers=ADMIN)).json()
    by = {(r["key"], r["model"]): r for r in data["data"]}
    a, b = by[("team-a", "gpt-4o-mini")], by[("team-b", "gpt-4o")]
    # Upstream usage n: prompt 100n, completion 7n, cached 10n; n = 1..6 in order sent.
    a_calls = [1, 2, 3, 4, 6]  # and n = 5 for team-b
    assert a["requests"] == 5 and b["requests"] == 1
    assert a["prompt_tokens_forwarded"] == sum(100 * n for n in a_calls)
    assert a["completion_tokens"] == sum(7 * n for n in a_calls)
    assert a["cached_prompt_tokens"] == sum(10 * n for n in a_calls)
    assert b["prompt_tokens_forwarded"] == 500
    assert a["estimated_requests"] == 0
    assert a["summarizer_prompt_tokens"] == 500  # one summary, then reused
    assert a["tokens_saved"] > 0
    assert a["prompt_tokens_sent"] == counted_a  # our count of what clients sent
    assert a["cost_usd"] > 0 and b["cost_usd"] > 0
    assert data["total_cost_usd"] == pytest.approx(a["cost_usd"] + b["cost_usd"])
    only_b = await app.client.get("/admin/usage", params={"key": "team-b"}, headers=ADMIN)
    assert [r["key"] for r in only_b.json()["data"]] == ["team-b"]
    by_model = await app.client.get("/admin/usage", params={"model": "gpt-4o"}, headers=ADMIN)
    assert [r["model"] for r in by_model.json()["data"]] == ["gpt-4o"]
    past = await app.client.get(
        "/admin/usage", params={"since": "2020-01-01", "until": "2020-01-31"}, headers=ADMIN
    )
    assert past.json()["data"] == []


async def test_no_usage_from_upstream_falls_back_to_our_counts_marked_estimated(
    make_app: Any, fake: Upstream
) -> None:
    fake.send_usage = False
    app = await make_app(admin_settings())
    reply = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert "x-compaction-cost-usd" in reply.headers
    streamed = await app.client.post(
        "/v1/chat/completions", json=chat(stream=True), headers=bearer(KEY_A)
    )
    assert streamed.content == fake.streams[-1]  # nothing to remove
    await app.state.meter.join()
    row = (await app.client.get("/admin/usage", headers=ADMIN)).json()["data"][0]
    assert row["requests"] == 2
    assert row["estimated_requests"] == 2
    assert row["prompt_tokens_forwarded"] == 2 * int(reply.headers["x-compaction-tokens-after"])
    assert row["completion_tokens"] == 2  # two content events in the stream


async def test_cost_header_prices_prompt_cached_and_completion(
    make_app: Any, fake: Upstream
) -> None:
    price = {"input": 1.0, "output": 2.0, "cached_input": 0.5}
    app = await make_app(admin_settings(pricing={"gpt-4o-mini*": price}))
    reply = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    # prompt 100 (10 cached) at $1/M, cached at $0.5/M, completion 7 at $2/M
    assert reply.headers["x-compaction-cost-usd"] == f"{(90 + 5 + 14) / 1e6:.6f}"
    unpriced = await app.client.post(
        "/v1/chat/completions", json=chat("my-local-llama"), headers=bearer(KEY_A)
    )
    assert "x-compaction-cost-usd" not in unpriced.headers


async def test_admin_usage_needs_the_admin_token(make_app: Any) -> None:
    app = await make_app(admin_settings())
    assert (await app.client.get("/admin/usage")).status_code == 401
    wrong = await app.client.get("/admin/usage", headers=bearer(KEY_A))
    assert wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    bad = await app.client.get("/admin/usage", params={"since": "yesterday"}, headers=ADMIN)
    assert bad.status_code == 400


async def test_usage_is_shared_by_replicas_through_redis(
    make_app: Any, fake: Upstream, redis_prefix: str
) -> None:
    quota = {"backend": "redis", "key_prefix": redis_prefix}
    one, two = (
        await make_app(admin_settings(quota=quota)),
        await make_app(admin_settings(quota=quota)),
    )
    for app in (one, two):
        reply = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
        assert reply.status_code == 200
        await app.state.meter.join()
    row = (await one.client.get("/admin/usage", headers=ADMIN)).json()["data"][0]
    assert row["requests"] == 2
    assert row["prompt_tokens_forwarded"] == 300


# The tap on its own: every way of splitting a stream into chunks gives the same result.
STREAM = b"".join(
    sse_events("m", {"prompt_tokens": 5, "completion_tokens": 2}, usage_null=True)
).replace(b"\n\n", b"\r\n\r\n", 1)


async def relay_in(tap: StreamTap, data: bytes, cuts: list[int]) -> list[bytes]:
    async def chunks() -> AsyncIterator[bytes]:
        last = 0
        for cut in [*cuts, len(data)]:
            yield data[last:cut]
            last = cut

    return [chunk async for chunk in tap.relay(chunks())]


@pytest.mark.parametrize("cut", range(1, len(STREAM), 7))
async def test_tap_removes_exactly_the_usage_event_wherever_chunks_split(cut: int) -> None:
    hidden = StreamTap(hide_usage_event=True)
    out = await relay_in(hidden, STREAM, [cut, min(len(STREAM), cut + 50)])
    assert b"".join(out) == without_usage_event(STREAM)
    assert hidden.usage is not None and hidden.usage.prompt_tokens == 5
    shown = StreamTap(hide_usage_event=False)
    out = await relay_in(shown, STREAM, [cut])
    assert b"".join(out) == STREAM
    assert out[0] == STREAM[:cut]  # read-only: chunks pass as they come
    assert shown.usage is not None and shown.usage.completion_tokens == 2


def test_usage_of_a_gzipped_body_is_read_from_a_decoded_copy() -> None:
    body = json.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()
    usage = usage_of_body(gzip.compress(body), "gzip")
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (3, 4)
    assert usage_of_body(b"not json") is None
    assert usage_of_body(body, "br") is None


@pytest.mark.parametrize(
    "raw",
    [
        [],
        [(b"content-type", b"text/event-stream")],
        [(b"Content-Encoding", b"gzip")],
        [(b"content-encoding", b"gzip"), (b"x-other", b"1"), (b"CONTENT-ENCODING", b" br")],
        [(b"content-encoding", "\u00e9".encode())],
        [(b"content-encoding", b""), (b"content-encoding", b"gzip")],
    ],
)
def test_content_encoding_reads_as_headers_get_does(raw: list[tuple[bytes, bytes]]) -> None:
    """What decides whether a reply's body is read or passed untouched: every value of every
    casing, joined, decoded as httpx decodes it; "" when there is none."""
    headers = httpx.Headers(raw)
    assert content_encoding(headers) == headers.get("content-encoding", "")


async def test_usage_of_other_billed_routes_is_recorded_too(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    upstream.post("/embeddings").respond(
        json={"data": [], "usage": {"prompt_tokens": 8, "total_tokens": 8}}
    )
    responses_usage = {
        "input_tokens": 20,
        "output_tokens": 5,
        "input_tokens_details": {"cached_tokens": 4},
    }
    upstream.post("/responses").respond(json={"id": "resp_1", "usage": responses_usage})
    upstream.get("/models").respond(json={"data": []})
    app = await make_app(admin_settings())
    for path, body in (
        ("/v1/embeddings", {"model": "text-embedding-3-small", "input": "x"}),
        ("/v1/responses", {"model": "gpt-4o-mini", "input": "hi"}),
    ):
        reply = await app.client.post(path, json=body, headers=bearer(KEY_A))
        assert reply.status_code == 200
    assert (await app.client.get("/v1/models", headers=bearer(KEY_A))).status_code == 200
    await app.state.meter.join()
    rows = (await app.client.get("/admin/usage", headers=ADMIN)).json()["data"]
    by_model = {row["model"]: row for row in rows}
    assert set(by_model) == {"text-embedding-3-small", "gpt-4o-mini"}
    embeddings, responses = by_model["text-embedding-3-small"], by_model["gpt-4o-mini"]
    assert (embeddings["prompt_tokens_forwarded"], embeddings["completion_tokens"]) == (8, 0)
    assert responses["prompt_tokens_forwarded"] == 20
    assert responses["cached_prompt_tokens"] == 4
    assert responses["completion_tokens"] == 5
    assert responses["estimated_requests"] == 0
    assert responses["cost_usd"] == pytest.approx((16 * 0.15 + 4 * 0.075 + 5 * 0.60) / 1e6)


def big_reply(content: str, usage: dict[str, Any], **after: Any) -> dict[str, Any]:
    """OpenAI's member order: choices, then usage, then the rest."""
    message = {"role": "assistant", "content": content}
    reply = {"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": message}]}
    return {**reply, "usage": usage, **after}


async def test_usage_of_a_reply_of_any_size_is_the_upstreams(
    make_app: Any, upstream: respx.MockRouter
) -> None:
    usage = {"prompt_tokens": 41, "completion_tokens": 123_456, "total_tokens": 123_497}
    # 1.2 MB, far over what is read whole; its content quotes a usage object as text.
    content = 'the "usage": {"prompt_tokens": 1, "completion_tokens": 2} field ' + "x" * 1_200_000
    reply = big_reply(content, usage, service_tier="default", system_fingerprint="fp_1")
    raw = json.dumps(reply).encode()
    upstream.post("/chat/completions").respond(
        stream=Chunked(raw, 65_000), headers={"content-type": "application/json"}
    )
    app = await make_app(admin_settings())
    got = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert got.content == raw  # relayed untouched
    zipped = gzip.compress(raw)
    upstream.post("/chat/completions").respond(
        stream=Chunked(zipped, 4_000),
        headers={"content-type": "application/json", "content-encoding": "gzip"},
    )
    got = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert got.status_code == 200
    await app.state.meter.join()
    row = (await app.client.get("/admin/usage", headers=ADMIN)).json()["data"][0]
    assert row["requests"] == 2
    assert row["estimated_requests"] == 0
    assert row["prompt_tokens_forwarded"] == 2 * 41
    assert row["completion_tokens"] == 2 * 123_456


def test_usage_read_from_the_end_is_the_top_level_one_or_none() -> None:
    from proxy.usage.tap import trailing_usage

    usage = {
        "prompt_tokens": 9,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    plain = json.dumps(big_reply("hi", usage, system_fingerprint="fp")).encode()
    assert trailing_usage(plain) == (9, 4, 2)
    assert usage_of_body(plain) == (9, 4, 2)
    # Content mentioning usage, even shaped like one, is inside a string: never read.
    quoted = big_reply('{"usage": {"prompt_tokens": 1, "completion_tokens": 1}}', usage)
    assert trailing_usage(json.dumps(quoted).encode()) == (9, 4, 2)
    # A nested "usage" after the top-level one: not proven top-level, the whole parse decides.
    nested = {
        **big_reply("hi", usage),
        "metadata": {"usage": {"prompt_tokens": 1, "completion_tokens": 1}},
    }
    raw = json.dumps(nested).encode()
    assert trailing_usage(raw) is None
    assert usage_of_body(raw) == (9, 4, 2)
    # A key that is not `usage` but ends in it (an escaped quote before it) is no key at all.
    assert (
        trailing_usage(b'{"a": "x\\"usage": {"prompt_tokens": 1, "completion_tokens": 1}}') is None
    )
    # Counts that are not non-negative integers are refused.
    for bad in (
        {"prompt_tokens": "9", "completion_tokens": 4},
        {"prompt_tokens": True, "completion_tokens": 4},
        {"prompt_tokens": -1, "completion_tokens": 4},
        {"completion_tokens": 4},
    ):
        assert usage_of_body(json.dumps(big_reply("hi", bad)).encode()) is None
    # Just the end of a reply is enough (what is kept of a big one).
    assert trailing_usage(plain[plain.index(b'"usage"') - 5 :]) == (9, 4, 2)


def test_usage_of_a_small_reply_read_whole_is_its_top_level_usage_or_none() -> None:
    """Read from its tail when that proves top-level, else parsed whole: the answer is what a
    whole parse finds (orjson's: counts past 64 bits read as floats, so refused), for replies
    shaped to fool a reader of the tail."""
    import orjson

    from proxy.usage.meter import whole_usage
    from proxy.usage.tap import ReportedUsage

    usage = {"prompt_tokens": 9, "completion_tokens": 4}
    usage["prompt_tokens_details"] = {"cached_tokens": 2}
    other = {"prompt_tokens": 1, "completion_tokens": 1}
    assert ReportedUsage.parse(other) == (1, 1, 0)
    bodies = [
        big_reply("hi", usage),
        big_reply("hi", usage, system_fingerprint="fp", service_tier="default"),
        big_reply('{"usage": {"prompt_tokens": 1, "completion_tokens": 1}}', usage),
        big_reply("hi", usage, metadata={"usage": other}),
        big_reply("hi", usage, logs=[{"usage": other}]),
        big_reply("hi", usage, kind="usage"),
        {"a": 'x"usage', "b": other},
        {'x"usage': other},
        {"usage": other, 'x\\"usage': 5},
        {"usage": usage, "usage2": other},
        big_reply("hi", {"prompt_tokens": "9", "completion_tokens": 4}),
        big_reply("hi", {"prompt_tokens": 2**70, "completion_tokens": 4}),
        {"id": "c", "usage": None},
        {"id": "c"},
        [{"usage": usage}],
    ]
    headers = httpx.Headers({"content-type": "application/json"})
    for data in bodies:
        for body in (json.dumps(data).encode(), json.dumps(data, separators=(",", ":")).encode()):
            whole = orjson.loads(body)
            expected = ReportedUsage.parse(whole.get("usage")) if type(whole) is dict else None
            assert whole_usage(body, headers) == expected, body
    # Not JSON as a whole, yet its end is a reply's end: read from there, as for big replies.
    nan = b'{"a": NaN, "usage": {"prompt_tokens": 3, "completion_tokens": 1}}'
    assert whole_usage(nan, headers) == (3, 1, 0)
    gzipped = gzip.compress(json.dumps(big_reply("hi", usage)).encode())
    assert whole_usage(gzipped, httpx.Headers({"content-encoding": "gzip"})) == (9, 4, 2)
    assert whole_usage(gzipped, headers) is None


# Whole replies in one chunk (a short reply arrives at once): the usage event is found from
# its key; streams shaped unlike OpenAI's must give what they give split byte by byte.
_USAGE_ONLY = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}'
_DELTA = b'data: {"choices":[{"delta":{"content":"hi"}}]}'
_DELTA_NULL = b'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}'
WHOLE_STREAMS = [
    _DELTA + b"\n\n" + _USAGE_ONLY + b"\n\ndata: [DONE]\n\n",
    _USAGE_ONLY + b"\n\ndata: [DONE]\n\n",
    _DELTA + b"\n\n\n" + _USAGE_ONLY + b"\n\n\ndata: [DONE]\n\n",
    _DELTA + b"\r\n\r\n" + _USAGE_ONLY + b"\r\n\r\ndata: [DONE]\n\n",
    _DELTA + b"\n\n" + _USAGE_ONLY + b"\r\rdata: [DONE]\n\n",
    _DELTA[:-1]
    + b',"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
    + _USAGE_ONLY
    + b"\n\ndata: [DONE]\n\n",
    b'data: {"choices":[{"delta":{"content":"\\"usage\\": {"}}]}\n\ndata: [DONE]\n\n',
    _DELTA + b"\n\n" + _USAGE_ONLY + b"\n\n",
    _DELTA + b"\n\n" + _USAGE_ONLY,
    # OpenAI's "usage":null in the chunks before the last, and shapes around it.
    _DELTA_NULL + b"\n\n",
    _DELTA_NULL + b"\n\n" + _DELTA_NULL + b"\n\n" + _USAGE_ONLY + b"\n\ndata: [DONE]\n\n",
    _USAGE_ONLY + b"\n\n" + _DELTA_NULL + b"\n\ndata: [DONE]\n\n",
    b'data: {"x":{"usage":{"prompt_tokens":1,"completion_tokens":1}},"choices":[],'
    b'"usage":null}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":1},"usage":null}\n\n',
    _DELTA_NULL.replace(b"null", b" null") + b"\n\n" + _USAGE_ONLY + b"\n\n",
    # The usage-only event's end read alone only when it is OpenAI's own shape.
    _DELTA + b"\n\n" + _USAGE_ONLY[:-1] + b',"obfuscation":"x"}\n\ndata: [DONE]\n\n',
    _DELTA + b"\n\n" + _USAGE_ONLY.replace(b":[],", b": [], ") + b"\n\ndata: [DONE]\n\n",
    b'data: {"x":' + _USAGE_ONLY[6:] + b',"choices":[]}\n\ndata: [DONE]\n\n',
    b'data: {"x":' + _USAGE_ONLY[6:] + b"}\n\n" + _USAGE_ONLY + b"\n\n",
    b'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":4,"completion_tokens":2}}\n\n',
]


def last_reported_usage(stream: bytes) -> ReportedUsage | None:
    """The top-level `usage` of the last complete event that has one, by the stdlib parser."""
    found = None
    for event in re.split(rb"\r\n\r\n|\n\n|\r\r", stream)[:-1]:
        lines = re.split(rb"\r\n|\r|\n", event)
        data = b"\n".join(ln[5:].removeprefix(b" ") for ln in lines if ln.startswith(b"data:"))
        try:
            payload = json.loads(data)
        except ValueError:
            continue
        usage = ReportedUsage.parse(payload.get("usage")) if type(payload) is dict else None
        found = usage or found
    return found


@pytest.mark.parametrize("stream", WHOLE_STREAMS)
async def test_tap_on_a_reply_in_one_chunk_matches_byte_by_byte(stream: bytes) -> None:
    for hide in (True, False):
        whole, split = StreamTap(hide_usage_event=hide), StreamTap(hide_usage_event=hide)
        out = b"".join(await relay_in(whole, stream, []))
        assert out == b"".join(await relay_in(split, stream, list(range(1, len(stream)))))
        assert whole.usage == split.usage == last_reported_usage(stream)
        if not hide:
            assert out == stream
    hidden = StreamTap(hide_usage_event=True)
    out = b"".join(await relay_in(hidden, WHOLE_STREAMS[0], []))
    assert out == _DELTA + b"\n\ndata: [DONE]\n\n"
    assert hidden.usage is not None and hidden.usage.prompt_tokens == 7


@pytest.mark.parametrize("per_chunk", [1, 3])
async def test_openai_usage_null_chunks_pass_untouched_and_the_usage_chunk_is_read(
    per_chunk: int,
) -> None:
    """With include_usage OpenAI sends `"usage":null` in every chunk and the counts in one
    last chunk: each chunk reaches the client as it came, only the usage chunk is removed
    (when the proxy asked for it), and the counts are read."""
    events = sse_events("m", {"prompt_tokens": 12, "completion_tokens": 2}, usage_null=True)
    chunks = [b"".join(events[i : i + per_chunk]) for i in range(0, len(events), per_chunk)]
    stream = b"".join(events)
    for hide in (True, False):
        tap = StreamTap(hide_usage_event=hide)
        out = [tap.feed(chunk) for chunk in chunks]
        assert tap.end() == b""
        assert b"".join(out) == (without_usage_event(stream) if hide else stream)
        # every chunk without the usage event is passed on as the very same bytes
        kept = [(o, c) for o, c in zip(out, chunks, strict=True) if b'"choices":[],' not in c]
        assert all(o is c for o, c in kept)
        assert tap.usage == (12, 2, 0)


async def test_tap_reads_usage_the_fast_parser_refuses_as_the_stdlib_does() -> None:
    # Counts past 64 bits (orjson would read them as floats) and a NaN elsewhere in the
    # event (orjson refuses it) are read as json reads them: the usage is exact, the
    # usage-only event is still removed.
    big = 2**70
    for usage_event in (
        b'data: {"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":3}}\n\n' % big,
        b'data: {"x":NaN,"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":3}}\n\n'
        % big,
    ):
        stream = _DELTA + b"\n\n" + usage_event + b"data: [DONE]\n\n"
        for cuts in ([], list(range(1, len(stream), 5))):
            hidden = StreamTap(hide_usage_event=True)
            out = b"".join(await relay_in(hidden, stream, cuts))
            assert out == _DELTA + b"\n\ndata: [DONE]\n\n"
            assert hidden.usage == (big, 3, 0)


async def test_a_stream_without_usage_is_estimated_from_its_events_in_any_chunks() -> None:
    stream = b"".join(sse_events("m", None, usage_null=False))
    for cuts in ([], [3], list(range(1, len(stream), 9))):
        tap = StreamTap(hide_usage_event=True)
        assert b"".join(await relay_in(tap, stream, cuts)) == stream
        assert tap.usage is None
        # "data:" split across chunks is not counted (an estimate): at most the 3 events
        assert tap.events <= 3 and (cuts != [] or tap.events == 3)


async def test_usage_on_either_side_of_midnight_goes_to_its_own_day() -> None:
    """The meter keeps the current UTC day's bounds; a reply an instant past midnight opens the
    next day's row, one an instant before stays in the day it ends."""
    from proxy.quota import MemoryLedger, UsageCounts
    from proxy.settings import Settings
    from proxy.usage.meter import Meter
    from proxy.usage.pricing import Pricing

    settings = Settings()
    ledger = MemoryLedger()
    midnight = 1_800_057_600.0  # a UTC midnight
    now = [midnight - 86400.5]
    meter = Meter(settings, ledger, Pricing(), clock=lambda: now[0])
    for at in (midnight - 86400.5, midnight - 0.25, midnight - 1e-6, midnight, midnight + 0.5):
        now[0] = at
        meter.add("k", "m", UsageCounts(requests=1, prompt_tokens_sent=int(at - midnight + 2)))
    await meter.join()
    rows = await ledger.usage(None, "2000-01-01", "2100-01-01")
    assert [(row.day, row.counts.requests) for row in rows] == [
        ("2027-01-14", 1),
        ("2027-01-15", 2),
        ("2027-01-16", 2),
    ]


async def test_many_replies_before_a_flush_sum_exactly_per_key_model_and_day() -> None:
    """However many replies arrive before the flusher runs, each key, model and day's row is
    their exact sum, field by field, and the batch holds one row per key, model and day."""
    from proxy.quota import MemoryLedger, UsageCounts
    from proxy.settings import Settings
    from proxy.usage.meter import Meter
    from proxy.usage.pricing import Pricing

    ledger = MemoryLedger()
    meter = Meter(Settings(), ledger, Pricing(), clock=lambda: 1_800_000_000.0)
    expected = {"a": UsageCounts(), "b": UsageCounts()}
    for i in range(1_000):
        key = "a" if i % 3 else "b"
        counts = UsageCounts(
            requests=1,
            prompt_tokens_sent=i,
            prompt_tokens_forwarded=i,
            cached_prompt_tokens=i % 7,
            completion_tokens=2 * i,
            summarizer_prompt_tokens=i % 5,
            summarizer_completion_tokens=1,
            tokens_saved=i % 11,
            cost_nano_usd=10 * i,
            estimated_requests=i % 2,
        )
        meter.add(key, "m", counts)
        expected[key] = UsageCounts(*(x + y for x, y in zip(expected[key], counts, strict=True)))
    assert len(meter._batch) == 2
    await meter.join()
    rows = await ledger.usage(None, "2000-01-01", "2100-01-01")
    assert {row.key: row.counts for row in rows} == expected
    assert expected["a"].requests == 666 and expected["b"].cost_nano_usd == sum(
        10 * i for i in range(0, 1_000, 3)
    )
