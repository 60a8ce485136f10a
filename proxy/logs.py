"""Logging: one formatter for every line (ours, uvicorn's, httpx's), text or JSON, request ids.

A line's structured fields are the `extra=` of its logging call: `log.info("compaction",
extra={"status": ...})`. The text formatter appends them as `key=value`; the JSON formatter
makes them keys of the object. Either way they are fields, never JSON inside a message. The
access line is such a call too (`AccessLog`), on the `proxy.access` logger: an operator's own
handlers, filters and formatters see it like any other record.

JSON comes from python-json-logger rather than structlog: everything here (the proxy, uvicorn,
httpx) already logs through the standard library, and python-json-logger is just a
`logging.Formatter`, so one handler formats all of them and uvicorn's workers pick it up from
the same `log_config`. structlog would add a second logging API plus its stdlib bridge
(ProcessorFormatter) to end at the same place.

Text lines are one line per record whatever the client sent: a path, a header or a model name
may hold a line break or a terminal escape, and written as is it would start a forged line.
The text formatter escapes every control character in the message and in every field, and
indents a traceback's lines, so each line that starts at the first column starts a record.
JSON escapes them by itself.

The request id comes from the current exchange (a contextvar), added by `RequestIdFilter`
on the handler, so every line a request causes carries it, the summarizer's included.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Literal

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

from proxy.record import Record, current_record
from proxy.upstream import UpstreamBrokeOff

LogFormat = Literal["text", "json"]

# LogRecord attributes that are not a line's own fields (uvicorn adds `color_message`).
_NOT_FIELDS = frozenset([*RESERVED_ATTRS, "taskName", "color_message", "request_id"])
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
_JSON_FORMAT = "%(levelname)s %(name)s %(message)s"
_JSON_RENAME = {"levelname": "level", "name": "logger"}

# C0, DEL, C1, and the Unicode line and paragraph separators: whatever a terminal or a log
# reader may take for a line break or a command.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# What makes a field value quoted: a control character, any whitespace, `=`, `"`, or nothing.
_NEEDS_QUOTES = re.compile('[\\s="\x00-\x1f\x7f-\x9f\u2028\u2029]')
_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

access_log = logging.getLogger("proxy.access")


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED_ESCAPES.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _json_escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def escape_controls(text: str) -> str:
    """`text` with each control character written as a Python-style escape (`\\n`, `\\x1b`,
    `\\u2028`), so it cannot end a line or steer a terminal."""
    return text if _CONTROL.search(text) is None else _CONTROL.sub(_escape, text)


def text_value(value: object) -> str:
    """A text field's value: booleans lower-case; a value that is empty or holds whitespace,
    `=`, a quote or a control character as a JSON string (every control character escaped,
    so it reads back with `json.loads`); anything else as `str()` gives it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if text and _NEEDS_QUOTES.search(text) is None:
        return text
    # json.dumps escapes C0, quotes and backslashes; DEL, C1 and U+2028/9 are left to us.
    return _CONTROL.sub(_json_escape, json.dumps(text, ensure_ascii=False))


def _indented(text: str) -> str:
    """A traceback or stack as continuation lines: each indented, its control characters
    escaped (an exception's message may quote client input)."""
    return "\n".join("  " + escape_controls(line) for line in text.splitlines())


class RequestIdFilter(logging.Filter):
    """Sets `record.request_id` from the request being served (None outside requests)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exchange = current_record()
        record.request_id = exchange.request_id if exchange is not None else None
        return True


class TextFormatter(logging.Formatter):
    """`time LEVEL logger message request_id=... key=value ...`, one line per record (a
    traceback follows on indented lines)."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        # logging.Formatter.format, with the head and fields escaped and the tail indented.
        record.message = record.getMessage()
        record.asctime = self.formatTime(record, self.datefmt)
        parts = [escape_controls(self.formatMessage(record))]
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            parts.append(f"request_id={text_value(request_id)}")
        for key, value in record.__dict__.items():  # keys are names code chose (`extra=`)
            if key not in _NOT_FIELDS and value is not None:
                parts.append(f"{key}={text_value(value)}")
        line = " ".join(parts)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line += "\n" + _indented(record.exc_text)
        if record.stack_info:
            line += "\n" + _indented(self.formatStack(record.stack_info))
        return line


class ProxyJsonFormatter(JsonFormatter):
    """One JSON object per line: level, logger, message, the fields, request_id, and time
    (ISO 8601, UTC)."""

    def __init__(self) -> None:
        super().__init__(
            _JSON_FORMAT,
            timestamp="time",
            rename_fields=_JSON_RENAME,
            reserved_attrs=sorted(_NOT_FIELDS - {"request_id"}),
            json_ensure_ascii=False,
        )


def formatter(log_format: LogFormat) -> logging.Formatter:
    return ProxyJsonFormatter() if log_format == "json" else TextFormatter()


class BrokeOffReported(logging.Filter):
    """Drops the server's "Exception in ASGI application" report, traceback and all, for an
    upstream that broke off mid-reply. That failure is logged where it happens, as one
    WARNING line (proxy.upstream); the exception is raised only because raising is how an
    ASGI app makes the server abort the client's connection, and it is no error of ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, UpstreamBrokeOff)


def log_config(level: str, log_format: LogFormat) -> dict[str, Any]:
    """A `logging.config.dictConfig` for this process, also given to uvicorn (so its workers
    format their lines the same way): one stderr handler on the root logger, uvicorn's loggers
    propagating to it, httpx's per-request INFO line silenced."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {
            "request_id": {"()": RequestIdFilter},
            "broke_off_reported": {"()": BrokeOffReported},
        },
        "formatters": {"proxy": {"()": formatter, "log_format": log_format}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": "proxy",
                "filters": ["request_id"],
            }
        },
        "root": {"level": level.upper(), "handlers": ["stderr"]},
        "loggers": {
            "uvicorn": {"handlers": [], "propagate": True},
            "uvicorn.error": {
                "handlers": [],
                "propagate": True,
                "filters": ["broke_off_reported"],
            },
            "uvicorn.access": {"handlers": [], "propagate": True},
            # One line per upstream request, naming the URL: the access line says it better.
            "httpx": {"level": "WARNING"},
        },
    }


def access_fields(record: Record) -> dict[str, object]:
    """The access line's fields, in the order both formats write them."""
    ttfb, duration = record.upstream_ttfb_s, record.duration_s
    return {
        "method": record.method,
        "path": record.path,
        "route": record.route,
        "status": record.status,
        "model": record.model,
        "stream": record.stream,
        "tokens_before": record.tokens_before,
        "tokens_after": record.tokens_after,
        "compaction": record.compaction,
        "compaction_reason": record.compaction_reason,
        "cache": record.cache,
        "upstream_status": record.upstream_status,
        "upstream_ttfb_ms": None if ttfb is None else round(ttfb * 1000, 2),
        "duration_ms": None if duration is None else round(duration * 1000, 2),
        "client": record.client,
        "key_id": record.key_id,
        "team": record.team,
        "limit": record.limit,  # the quota limit that refused it (429)
    }


class AccessLog:
    """An ExchangeSink: one INFO line per request when it is over, on `proxy.access`. Never
    content, credentials or the query string (`path` is the path only)."""

    def started(self, record: Record) -> None:
        pass

    def responding(self, record: Record) -> None:
        pass

    def finished(self, record: Record) -> None:
        if access_log.isEnabledFor(logging.INFO):
            access_log.info(
                "%s %s %s",
                record.method,
                record.path,
                record.status,
                extra=access_fields(record),
            )
