"""The access line as the proxy writes it directly is, byte for byte, the line the logging call
makes; and any logging configuration other than the proxy's own gets every line through
logging, as before."""

from __future__ import annotations

import io
import logging
import logging.config
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from proxy import logs
from proxy.exchange import Record, _current
from proxy.logs import AccessLog, LogFormat, access_log, log_config

ODD = [" ", "", '"', "=", "\n", "a b", 'say "hi"', "k=v", "line\nbreak", "é", "日本語",
       "None", "true", "\\", "\t", "\x00", "\u2028", "emoji \U0001f600"]  # fmt: skip
texts = st.one_of(st.sampled_from(ODD), st.text(max_size=12))
maybe_texts = st.none() | texts
counts = st.none() | st.integers(min_value=-(2**63), max_value=2**63)
seconds = st.none() | st.floats(allow_nan=True, allow_infinity=True, width=64)


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


@contextmanager
def frozen_clock(now: float) -> Iterator[None]:
    """`time.time()` (and `time.time_ns()`) read `now`, for LogRecord and the direct path."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(time, "time", lambda: now)
        mp.setattr(time, "time_ns", lambda: int(now * 1e9))
        yield


class _Pass(logging.Filter):
    """Lets everything through: on `proxy.access` it only makes the configuration not the
    proxy's own."""


def both_lines(stream: io.StringIO, record: Record, current: Record | None) -> tuple[str, str]:
    """The line written directly, then the line the logging call writes, for `record`."""
    token = _current.set(current)
    try:
        assert logs._direct_handler() is not None
        start = stream.tell()
        AccessLog().finished(record)
        direct = stream.getvalue()[start:]
        access_log.addFilter(_Pass())
        try:
            assert logs._direct_handler() is None
            start = stream.tell()
            AccessLog().finished(record)
            logged = stream.getvalue()[start:]
        finally:
            access_log.filters.clear()
    finally:
        _current.reset(token)
    return direct, logged


now = st.one_of(
    st.floats(min_value=0, max_value=4_102_444_800, allow_nan=False),
    st.integers(min_value=0, max_value=4_102_444_800).map(lambda s: s + 0.9995),
    st.integers(min_value=0, max_value=4_102_444_800).map(float),
)


@pytest.mark.parametrize("log_format", ["text", "json"])
@given(record=records(), at=now, current_is_record=st.booleans())
@example(record=served_record(), at=1_764_636_330.123456, current_is_record=True)
@example(record=served_record(), at=1_764_636_330.9999999, current_is_record=False)
def test_direct_line_is_the_logged_line_byte_for_byte(
    log_format: LogFormat, record: Record, at: float, current_is_record: bool
) -> None:
    with proxy_logging(log_format) as stream, frozen_clock(at):
        direct, logged = both_lines(stream, record, record if current_is_record else None)
    assert direct == logged
    assert direct.endswith("\n")


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_consecutive_lines_in_one_second_and_the_next_keep_their_times(
    log_format: LogFormat,
) -> None:
    """The direct path reuses a second's formatted time: never into the next second."""
    record = served_record()
    for at in (1_764_636_330.001, 1_764_636_330.999, 1_764_636_331.0, 1_764_636_331.5):
        with proxy_logging(log_format) as stream, frozen_clock(at):
            direct, logged = both_lines(stream, record, record)
        assert direct == logged


def test_a_served_text_line_reads_as_before() -> None:
    record = served_record()
    with proxy_logging("text") as stream, frozen_clock(1_764_636_330.25):
        token = _current.set(record)
        try:
            AccessLog().finished(record)
        finally:
            _current.reset(token)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1_764_636_330))
    assert stream.getvalue() == (
        f"{stamp},250 INFO proxy.access POST /v1/chat/completions 200 request_id=req_0123 "
        "method=POST path=/v1/chat/completions route=/v1/chat/completions status=200 "
        "model=gpt-4o-mini stream=false tokens_before=120 tokens_after=80 "
        "compaction=compacted cache=miss upstream_status=200 upstream_ttfb_ms=1.23 "
        "duration_ms=23.46 client=127.0.0.1:50000\n"
    )


def test_level_above_info_writes_no_access_line() -> None:
    with proxy_logging("text", level="warning") as stream:
        AccessLog().finished(served_record())
    assert stream.getvalue() == ""


def test_a_disabled_access_logger_writes_nothing() -> None:
    with proxy_logging("json") as stream:
        access_log.disabled = True
        try:
            AccessLog().finished(served_record())
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
        token = _current.set(record)
        try:
            AccessLog().finished(record)
        finally:
            _current.reset(token)


def test_a_handler_on_the_access_logger_gets_every_line_and_the_root_still_does() -> None:
    with proxy_logging("text") as stream:
        mine = _Collect()
        access_log.addHandler(mine)
        _finish(3)
    assert [r.status for r in mine.records] == [200, 201, 202]  # type: ignore[attr-defined]
    assert all(r.request_id == "req_0123" for r in mine.records)  # type: ignore[attr-defined]
    assert len(stream.getvalue().splitlines()) == 3


def test_no_propagation_keeps_lines_off_the_proxy_stderr() -> None:
    with proxy_logging("text") as stream:
        mine = _Collect()
        access_log.addHandler(mine)
        access_log.propagate = False
        _finish(2)
    assert len(mine.records) == 2 and stream.getvalue() == ""


def test_a_handler_on_the_parent_logger_gets_every_line() -> None:
    with proxy_logging("json") as stream:
        mine = _Collect()
        logging.getLogger("proxy").addHandler(mine)
        _finish(2)
    assert len(mine.records) == 2 and len(stream.getvalue().splitlines()) == 2


def test_an_operators_own_root_handler_and_stream_get_the_lines_their_way() -> None:
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


def test_a_formatter_set_on_the_proxy_handler_is_used() -> None:
    with proxy_logging("json") as stream:
        logging.root.handlers[0].setFormatter(logging.Formatter("%(name)s %(message)s"))
        _finish(1)
    assert stream.getvalue() == "proxy.access POST /v1/chat/completions 200\n"


def test_a_converter_set_on_the_formatter_class_is_honoured() -> None:
    """`Formatter.converter = time.gmtime`, as logging's docs suggest for UTC times."""
    record = served_record()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(logging.Formatter, "converter", time.gmtime)
        with proxy_logging("text") as stream, frozen_clock(1_764_636_330.5):
            direct, logged = both_lines(stream, record, record)
    assert direct == logged
    assert direct.startswith("2025-12-02 00:45:30,500 INFO proxy.access ")


def test_another_log_record_factory_gets_every_line() -> None:
    made: list[str] = []
    default = logging.getLogRecordFactory()

    def factory(*args: object, **kwargs: object) -> logging.LogRecord:
        record = default(*args, **kwargs)  # type: ignore[arg-type]
        made.append(record.name)
        return record

    with proxy_logging("text") as stream:
        logging.setLogRecordFactory(factory)
        try:
            _finish(2)
        finally:
            logging.setLogRecordFactory(default)
    assert made == ["proxy.access", "proxy.access"]
    assert len(stream.getvalue().splitlines()) == 2


def test_a_stream_set_on_the_proxy_handler_gets_the_lines() -> None:
    other = io.StringIO()
    with proxy_logging("text") as stream:
        handler = logging.root.handlers[0]
        assert isinstance(handler, logging.StreamHandler)
        handler.setStream(other)
        _finish(2)
    assert stream.getvalue() == "" and len(other.getvalue().splitlines()) == 2


def test_lines_from_other_loggers_keep_their_place() -> None:
    with proxy_logging("text") as stream:
        _finish(1)
        logging.getLogger("proxy.app").warning("between")
        _finish(1)
    lines = stream.getvalue().splitlines()
    assert [line.split(" ", 4)[4].split()[0] for line in lines] == [
        "POST", "between", "POST",
    ]  # fmt: skip


class _Broken(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError("stderr is gone")


def test_a_failing_stream_is_reported_as_logging_reports_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`handleError`: a `--- Logging error ---` report, and the request goes on."""
    with proxy_logging("text"):
        handler = logging.root.handlers[0]
        assert isinstance(handler, logging.StreamHandler)
        handler.setStream(_Broken())
        reports = io.StringIO()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sys, "stderr", reports)
            _finish(1)
    report = reports.getvalue()
    assert "--- Logging error ---" in report and "stderr is gone" in report
    assert "Message: '%s %s %s'" in report and "'POST', '/v1/chat/completions', 200" in report
