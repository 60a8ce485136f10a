"""Logging: one formatter for every line (ours, uvicorn's, httpx's), text or JSON, request ids.

A line's structured fields are the `extra=` of its logging call: `log.info("compaction",
extra={"status": ...})`. The text formatter appends them as `key=value`; the JSON formatter
makes them keys of the object. Either way they are fields, never JSON inside a message.

JSON comes from python-json-logger rather than structlog: everything here (the proxy, uvicorn,
httpx) already logs through the standard library, and python-json-logger is just a
`logging.Formatter`, so one handler formats all of them and uvicorn's workers pick it up from
the same `log_config`. structlog would add a second logging API plus its stdlib bridge
(ProcessorFormatter) to end at the same place.

The request id comes from the current exchange (a contextvar), added by `RequestIdFilter`
on the handler, so every line a request causes carries it, the summarizer's included.
"""

from __future__ import annotations

import json
import logging
import logging.config
from typing import Any, Literal

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

from proxy.exchange import Record, current_record

LogFormat = Literal["text", "json"]

# LogRecord attributes that are not a line's own fields (uvicorn adds `color_message`).
_NOT_FIELDS = frozenset([*RESERVED_ATTRS, "taskName", "color_message", "request_id"])
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
_JSON_FORMAT = "%(levelname)s %(name)s %(message)s"
_JSON_RENAME = {"levelname": "level", "name": "logger"}

access_log = logging.getLogger("proxy.access")


class RequestIdFilter(logging.Filter):
    """Sets `record.request_id` from the request being served (None outside requests)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exchange = current_record()
        record.request_id = exchange.request_id if exchange is not None else None
        return True


class TextFormatter(logging.Formatter):
    """`time LEVEL logger message request_id=... key=value ...`."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        parts = [line]
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            parts.append(f"request_id={_text_value(request_id)}")
        for key, value in record.__dict__.items():
            if key not in _NOT_FIELDS and value is not None:
                parts.append(f"{key}={_text_value(value)}")
        return " ".join(parts)


def _text_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if not text or any(c in text for c in ' ="\n'):
        return json.dumps(text, ensure_ascii=False)
    return text


def json_formatter() -> logging.Formatter:
    """One JSON object per line: time (ISO 8601, UTC), level, logger, message, request_id, then
    the fields."""
    return JsonFormatter(
        _JSON_FORMAT,
        timestamp="time",
        rename_fields=_JSON_RENAME,
        reserved_attrs=sorted(_NOT_FIELDS - {"request_id"}),
        json_ensure_ascii=False,
    )


def formatter(log_format: LogFormat) -> logging.Formatter:
    return json_formatter() if log_format == "json" else TextFormatter()


def log_config(level: str, log_format: LogFormat) -> dict[str, Any]:
    """A `logging.config.dictConfig` for this process, also given to uvicorn (so its workers
    format their lines the same way): one stderr handler on the root logger, uvicorn's loggers
    propagating to it, httpx's per-request INFO line silenced."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": RequestIdFilter}},
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
            "uvicorn.error": {"handlers": [], "propagate": True},
            "uvicorn.access": {"handlers": [], "propagate": True},
            # One line per upstream request, naming the URL: the access line says it better.
            "httpx": {"level": "WARNING"},
        },
    }


class AccessLog:
    """An ExchangeSink: one INFO line per request when it is over. Never content, credentials
    or the query string (`path` is the path only)."""

    def started(self, record: Record) -> None:
        pass

    def responding(self, record: Record) -> None:
        pass

    def finished(self, record: Record) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        access_log.info(
            "%s %s %s",
            record.method,
            record.path,
            record.status,
            extra={
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
                "upstream_ttfb_ms": _ms(record.upstream_ttfb_s),
                "duration_ms": _ms(record.duration_s),
                "client": record.client,
                "key_id": record.key_id,
            },
        )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)
