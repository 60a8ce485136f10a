"""uvicorn's response header-name check, memoised (proxy.headercheck): the same verdicts."""

from __future__ import annotations

import re

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.types import Receive, Scope, Send

from proxy import headercheck
from proxy.headercheck import MemoPattern

# uvicorn's own pattern, as its httptools server has it.
NAME_RE = re.compile(headercheck._PATTERN)


def test_every_byte_gets_the_patterns_verdict() -> None:
    memo = MemoPattern(NAME_RE)
    for byte in range(256):
        name = b"x-" + bytes([byte]) + b"-name"
        expected = NAME_RE.search(name) is not None
        assert memo.search(name) is expected
        assert memo.search(name) is expected  # answered from the memo the second time


@given(st.lists(st.binary(max_size=48), max_size=40))
def test_names_get_the_patterns_verdict_also_past_the_memos_bound(names: list[bytes]) -> None:
    memo = MemoPattern(NAME_RE)
    for name in names * 2:
        assert memo.search(name) is (NAME_RE.search(name) is not None)


def test_the_memo_is_bounded_and_answers_past_it() -> None:
    memo = MemoPattern(NAME_RE)
    for i in range(headercheck.MAX_NAMES + 50):
        assert memo.search(b"x-name-%d" % i) is False
    assert memo.search(b"bad name") is True
    verdicts = memo.search.__self__  # type: ignore[attr-defined]
    assert len(verdicts) == headercheck.MAX_NAMES
    assert memo.pattern is NAME_RE and memo.flags == NAME_RE.flags  # the rest is the pattern's


def test_the_memo_goes_in_only_for_a_uvicorn_it_was_checked_against() -> None:
    """On a checked uvicorn the memo stands in for `HEADER_RE`; on any other release it is
    left as uvicorn has it (after an upgrade: read its httptools `send`, check it still uses
    `HEADER_RE.search(name)` only as a truth test, then add the version to TESTED_UVICORN)."""
    import uvicorn
    from uvicorn.protocols.http import httptools_impl

    if uvicorn.__version__ not in headercheck.TESTED_UVICORN:
        before = httptools_impl.HEADER_RE
        assert not headercheck.install()
        assert httptools_impl.HEADER_RE is before
        return
    assert headercheck.install()
    assert isinstance(httptools_impl.HEADER_RE, MemoPattern)
    assert headercheck.install()  # once is enough; again changes nothing
    assert isinstance(httptools_impl.HEADER_RE.pattern, re.Pattern)


@pytest.mark.integration
def test_a_served_reply_still_has_its_header_names_checked() -> None:
    """Served by uvicorn's httptools server with the memo in place: good names go out as
    sent, a bad one is still refused by the server (the connection closed, nothing of the
    reply sent), each time."""
    from tests.integration.harness import ServerThread

    headercheck.install()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        name = b"bad name" if scope["path"] == "/bad" else b"x-compaction-ratelimit-limit-tokens"
        await send({"type": "http.response.start", "status": 200, "headers": [(name, b"7")]})
        await send({"type": "http.response.body", "body": b"ok"})

    server = ServerThread(app, "headercheck", lifespan="off", http="httptools").start()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            for _ in range(2):
                good = client.get("/good")
                assert good.status_code == 200
                assert good.headers["x-compaction-ratelimit-limit-tokens"] == "7"
            for _ in range(2):
                with pytest.raises(httpx.RemoteProtocolError):
                    client.get("/bad")
            assert client.get("/good").status_code == 200
    finally:
        server.stop()
