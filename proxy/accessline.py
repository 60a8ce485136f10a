"""The access line written directly: the bytes the logging path makes, at a fraction of its cost.

`logging` spends most of an access line on what the line never shows: the caller's frame,
a LogRecord with a dozen attributes (thread, process, file, function), the 16 fields copied
into it and read back out by name, and the time formatted from scratch. Here the fields are
read from the request's `Record` in their fixed order and rendered with the same rules as
`proxy.logs`' formatters (`text_value`, python-json-logger's encoder), with the same clock
readings `logging.LogRecord` takes (`clock`) and the formatted second reused while it lasts.

Used only when the logging configuration is the proxy's own (`proxy.logs` checks that on every
line); tests compare both paths byte for byte.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from pythonjsonlogger.json import JsonEncoder

from proxy.exchange import Record

# The access line's fields, in the order both formats write them.
FIELDS = (
    "method", "path", "route", "status", "model", "stream", "tokens_before", "tokens_after",
    "compaction", "compaction_reason", "cache", "upstream_status", "upstream_ttfb_ms",
    "duration_ms", "client", "key_id",
)  # fmt: skip

# What `JsonFormatter(json_ensure_ascii=False)` serializes with (json.dumps(cls=JsonEncoder)).
_JSON = JsonEncoder(ensure_ascii=False)


def field_values(record: Record) -> tuple[object, ...]:
    """The access line's field values, in FIELDS' order."""
    ttfb = record.upstream_ttfb_s
    duration = record.duration_s
    return (
        record.method,
        record.path,
        record.route,
        record.status,
        record.model,
        record.stream,
        record.tokens_before,
        record.tokens_after,
        record.compaction,
        record.compaction_reason,
        record.cache,
        record.upstream_status,
        None if ttfb is None else round(ttfb * 1000, 2),
        None if duration is None else round(duration * 1000, 2),
        record.client,
        record.key_id,
    )


def message(record: Record) -> str:
    """The line's message: the logging call's `"%s %s %s" % (method, path, status)`."""
    # %-formatting, as logging does: str() of each, never format().
    return "%s %s %s" % (record.method, record.path, record.status)  # noqa: UP031


if sys.version_info >= (3, 13):

    def clock() -> tuple[float, int]:
        """`LogRecord.created` and `int(LogRecord.msecs)`, read as this Python's LogRecord
        reads them (nanoseconds since 3.13)."""
        ns = time.time_ns()
        return ns / 1e9, (ns % 1_000_000_000) // 1_000_000

else:

    def clock() -> tuple[float, int]:
        """`LogRecord.created` and `int(LogRecord.msecs)`, read as this Python's LogRecord
        reads them."""
        ct = time.time()
        return ct, int((ct - int(ct)) * 1000)


def text_value(value: object) -> str:
    """A text field's value: booleans lower-case, a value with a space, `=`, a quote or a
    newline (or an empty one) as a JSON string, anything else as `str()` gives it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if not text or " " in text or "=" in text or '"' in text or "\n" in text:
        return json.dumps(text, ensure_ascii=False)
    return text


class TextClock:
    """`Formatter.formatTime(record)` without a datefmt, the second's text kept while it lasts."""

    __slots__ = ("_converter", "_format", "_second", "_text")

    def __init__(self) -> None:
        self._second = -1
        self._text = ""
        self._converter: Callable[..., time.struct_time] | None = None
        self._format = ""

    def asctime(
        self,
        created: float,
        msecs: int,
        converter: Callable[..., time.struct_time],
        time_format: str,
        msec_format: str | None,
    ) -> str:
        second = int(created)
        if (
            second != self._second
            or converter is not self._converter
            or time_format is not self._format
        ):
            self._text = time.strftime(time_format, converter(created))
            self._second, self._converter, self._format = second, converter, time_format
        if msec_format:
            return msec_format % (self._text, msecs)
        return self._text


def text_line(
    head: str,
    record: Record,
    request_id: str | None,
) -> str:
    """`head` (`time LEVEL logger message`), then `request_id=`, then each field that is not
    None as `key=value`: what `TextFormatter.format` makes of the logging call's record."""
    parts = [head]
    if request_id is not None:
        parts.append("request_id=" + text_value(request_id))
    for key, value in zip(FIELDS, field_values(record), strict=True):
        if value is None:
            continue
        kind = type(value)
        if kind is int or kind is float:
            # str() of a plain number has no space, `=`, quote or newline and is never empty.
            parts.append(f"{key}={value!s}")
        else:
            parts.append(f"{key}={text_value(value)}")
    return " ".join(parts)


def json_line(
    level: str,
    logger: str,
    record: Record,
    request_id: str | None,
    created: float,
) -> str:
    """What the proxy's JsonFormatter makes of the logging call's record: level, logger,
    message, the fields (None as null), request_id, then time (ISO 8601, UTC)."""
    data: dict[str, Any] = {"level": level, "logger": logger, "message": message(record)}
    data.update(zip(FIELDS, field_values(record), strict=True))
    data["request_id"] = request_id
    data["time"] = datetime.fromtimestamp(created, tz=UTC).isoformat()
    return _JSON.encode(data)
