"""The access line: an ordinary `logging` record on `proxy.access`, formatted by the proxy's
text or JSON formatter. Whatever a client put in a field, a text line stays one line and
its fields read back; an operator's own logging configuration gets every line its way."""

from __future__ import annotations

import io
import json
import logging
import logging.config
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from proxy.logs import AccessLog, LogFormat, access_fields, access_log, log_config
from proxy.record import CURRENT_RECORD, Record

ODD = [" ", "", '"', "=", "\n", "a b", 'say "hi"', "k=v", "line\nbreak", "é", "日本語",
       "None", "true", "\\", "\t", "\x00", "\r", "\x1b[2J", "\x7f", "\x85", "\u2028",
       "\u2029", "\x0b\x0c\x1c\x1d\x1e", "emoji \U0001f600",
       "/v1/x\n2026-01-01 00:00:00,000 INFO proxy.access forged"]  # fmt: skip
texts = st.one_of(st.sampled_from(ODD), st.text(max_size=12))
maybe_texts = st.none() | texts
counts = st.none() | st.integers(min_value=-(2**63), max_value=2**63)
seconds = st.none() | st.floats(allow_nan=True, allow_infinity=True, width=64)
# The start of a record in the text format: `date time,ms LEVEL logger `.
RECORD_START = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \S+ ")


@st.composite
def records(draw: st.DrawFn) -> Record:
    return Record(
        request_id=draw(texts),
        method=draw(texts),
        path=draw(texts),
        client=draw(maybe_texts),
        started=0.0,
        route=draw(texts),
        status=draw(st.none() | st.integers(min_value=100, max_value=599)),
        model=draw(maybe_texts),
        stream=draw(st.none() | st.booleans()),
        tokens_before=draw(counts),
        tokens_after=draw(counts),
        compaction=draw(maybe_texts),
        compaction_reason=draw(maybe_texts),
        cache=draw(maybe_texts),
        upstream_status=draw(st.none() | st.integers(min_value=100, max_value=599)),
        upstream_ttfb_s=draw(seconds),
        duration_s=draw(seconds),
        key_id=draw(maybe_texts),
        team=draw(maybe_texts),
        limit=draw(maybe_texts),
    )


def served_record() -> Record:
    return Record(request_id="req_0123", method="POST", path="/v1/chat/completions",
                  client="127.0.0.1:50000", started=0.0, route="/v1/chat/completions",
                  status=200, model="gpt-4o-mini", stream=False, tokens_before=120,
                  tokens_after=80, compaction="compacted", cache="miss", upstream_status=200,
                  upstream_ttfb_s=0.00123, duration_s=0.0234567)  # fmt: skip


@contextmanager
def proxy_logging(log_format: LogFormat, level: str = "info") -> Iterator[io.StringIO]:
    """Logging as `serve` configures it, stderr captured; the loggers put back after."""
    stream = io.StringIO()
    names = ("", "proxy", "proxy.access", "httpx", "uvicorn", "uvicorn.error", "uvicorn.access")
    saved = [(lg, lg.level, lg.handlers[:], lg.propagate, lg.filters[:])
             for lg in map(logging.getLogger, names)]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "stderr", stream)
        try:
            logging.config.dictConfig(log_config(level, log_format))
            yield stream
        finally:
            for lg, lvl, handlers, propagate, filters in saved:
                lg.setLevel(lvl)
                lg.handlers[:] = handlers
                lg.propagate = propagate
                lg.filters[:] = filters


def finish(record: Record, current: Record | None = None) -> None:
    """The access log told that `record` is over, with `current` the request being served."""
    token = CURRENT_RECORD.set(current)
    try:
        AccessLog().finished(record)
    finally:
        CURRENT_RECORD.reset(token)


def read_fields(line: str) -> dict[str, object]:
    """`key=value ...` after the message, read back: a quoted value as the JSON string it
    is. The message is free text: fields are read from where `request_id=` (always first,
    never in the message of these records) begins."""
    fields: dict[str, object] = {}
    rest = line[line.index(" request_id=") + 1 :]
    decoder = json.JSONDecoder()
    while rest:
        key, _, rest = rest.partition("=")
        if rest.startswith('"'):
            value, end = decoder.raw_decode(rest)
            fields[key], rest = value, rest[end:].removeprefix(" ")
        else:
            value, _, rest = rest.partition(" ")
            fields[key] = value
    return fields


def shown(value: object) -> object:
    """A field's value as a text line shows it (read back by `read_fields`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@given(record=records())
@example(record=served_record())
def test_a_text_line_is_one_line_whatever_the_fields_hold_and_its_fields_read_back(
    record: Record,
) -> None:
    record.request_id = "req_1"  # the reader starts at request_id (see read_fields)
    with proxy_logging("text") as stream:
        finish(record, record)
    text = stream.getvalue()
    assert text.endswith("\n")
    line = text[:-1]
    assert line.splitlines() == [line]  # no line break of any kind (\r, \x85, \u2028...)
    assert not re.search("[\x00-\x1f\x7f-\x9f\u2028\u2029]", line)
    assert RECORD_START.match(line)
    expected = {"request_id": "req_1"} | {
        key: shown(value) for key, value in access_fields(record).items() if value is not None
    }
    assert read_fields(line) == expected


@given(record=records(), current_is_record=st.booleans())
def test_a_json_line_holds_every_field_as_the_record_has_it(
    record: Record, current_is_record: bool
) -> None:
    with proxy_logging("json") as stream:
        finish(record, record if current_is_record else None)
    text = stream.getvalue()
    assert text.endswith("\n") and "\n" not in text[:-1]
    line = json.loads(text)
    assert line.pop("level") == "INFO" and line.pop("logger") == "proxy.access"
    assert line.pop("message") == f"{record.method} {record.path} {record.status}"
    assert line.pop("request_id") == (record.request_id if current_is_record else None)
    assert isinstance(line.pop("time"), str)
    expected = json.loads(json.dumps(access_fields(record)))  # NaN and infinities as json has them
    assert line.keys() == expected.keys()
    assert json.dumps(line, sort_keys=True) == json.dumps(expected, sort_keys=True)


def test_a_served_text_line_reads_as_before() -> None:
    record = served_record()
    with proxy_logging("text") as stream, pytest.MonkeyPatch.context() as mp:
        mp.setattr(time, "time", lambda: 1_764_636_330.25)
        mp.setattr(time, "time_ns", lambda: 1_764_636_330_250_000_000)
        finish(record, record)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1_764_636_330))
    assert stream.getvalue() == (
        f"{stamp},250 INFO proxy.access POST /v1/chat/completions 200 request_id=req_0123 "
        "method=POST path=/v1/chat/completions route=/v1/chat/completions status=200 "
        "model=gpt-4o-mini stream=false tokens_before=120 tokens_after=80 "
        "compaction=compacted cache=miss upstream_status=200 upstream_ttfb_ms=1.23 "
        "duration_ms=23.46 client=127.0.0.1:50000\n"
    )


def test_a_forged_line_in_the_path_stays_in_its_own_line_escaped() -> None:
    record = served_record()
    record.path = "/v1/x\n2026-01-01 00:00:00,000 INFO proxy.access forged\r\x1b[2J"
    record.status = 401
    with proxy_logging("text") as stream:
        finish(record, record)
    (line,) = stream.getvalue().splitlines()
    assert " POST /v1/x\\n2026-01-01 00:00:00,000 INFO proxy.access forged\\r\\x1b[2J 401 " in line
    assert ' path="/v1/x\\n2026-01-01 00:00:00,000 INFO proxy.access forged\\r\\u001b[2J" ' in line
    assert read_fields(line)["path"] == record.path


def test_a_traceback_follows_on_indented_lines_its_message_escaped() -> None:
    with proxy_logging("text") as stream:
        try:
            raise ValueError("bad path /x\n2026-01-01 00:00:00,000 INFO proxy.access forged")
        except ValueError:
            logging.getLogger("proxy.app").exception("unhandled\nerror")
    first, *rest = stream.getvalue().splitlines()
    assert RECORD_START.match(first) and first.endswith("ERROR proxy.app unhandled\\nerror")
    assert rest and all(line.startswith("  ") for line in rest)
    assert rest[0] == "  Traceback (most recent call last):"
    assert rest[-2:] == [
        "  ValueError: bad path /x",
        "  2026-01-01 00:00:00,000 INFO proxy.access forged",
    ]


def test_level_above_info_writes_no_access_line() -> None:
    with proxy_logging("text", level="warning") as stream:
        finish(served_record())
    assert stream.getvalue() == ""


def test_a_disabled_access_logger_writes_nothing() -> None:
    with proxy_logging("json") as stream:
        access_log.disabled = True
        try:
            finish(served_record())
        finally:
            access_log.disabled = False
    assert stream.getvalue() == ""


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _finish(n: int) -> None:
    for i in range(n):
        record = served_record()
        record.status = 200 + i
        finish(record, record)


def test_a_handler_on_the_access_logger_gets_each_record_with_its_fields() -> None:
    with proxy_logging("text") as stream:
        mine = _Collect()
        access_log.addHandler(mine)
        try:
            _finish(3)
        finally:
            access_log.removeHandler(mine)
    assert [r.status for r in mine.records] == [200, 201, 202]  # type: ignore[attr-defined]
    assert all(r.request_id == "req_0123" for r in mine.records)  # type: ignore[attr-defined]
    assert all(r.duration_ms == 23.46 for r in mine.records)  # type: ignore[attr-defined]
    assert len(stream.getvalue().splitlines()) == 3


def test_an_operators_own_root_handler_and_formatter_get_the_lines_their_way() -> None:
    theirs = io.StringIO()
    with proxy_logging("text") as stream:
        handler = logging.StreamHandler(theirs)
        handler.setFormatter(logging.Formatter("%(levelname)s|%(message)s|%(status)s"))
        logging.root.handlers[:] = [handler]
        _finish(2)
    assert stream.getvalue() == ""
    assert theirs.getvalue() == (
        "INFO|POST /v1/chat/completions 200|200\nINFO|POST /v1/chat/completions 201|201\n"
    )


def test_a_filter_added_to_the_proxy_handler_sees_and_can_drop_each_line() -> None:
    seen: list[int] = []

    def drop_odd(record: logging.LogRecord) -> bool:
        seen.append(record.status)  # type: ignore[attr-defined]
        return bool(record.status % 2 == 0)  # type: ignore[attr-defined]

    with proxy_logging("text") as stream:
        logging.root.handlers[0].addFilter(drop_odd)
        _finish(4)
    assert seen == [200, 201, 202, 203]
    assert [line.split()[6] for line in stream.getvalue().splitlines()] == ["200", "202"]


def test_lines_from_other_loggers_keep_their_place() -> None:
    with proxy_logging("text") as stream:
        _finish(1)
        logging.getLogger("proxy.app").warning("between")
        _finish(1)
    lines = stream.getvalue().splitlines()
    assert [line.split(" ", 4)[4].split()[0] for line in lines] == [
        "POST", "between", "POST",
    ]  # fmt: skip
