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

import logging
import logging.config
from typing import Any, Literal, TextIO

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

from proxy import accessline
from proxy.accessline import text_value
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
            parts.append(f"request_id={text_value(request_id)}")
        for key, value in record.__dict__.items():
            if key not in _NOT_FIELDS and value is not None:
                parts.append(f"{key}={text_value(value)}")
        return " ".join(parts)


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


def json_formatter() -> logging.Formatter:
    return ProxyJsonFormatter()


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
                "class": "proxy.logs.ProxyStreamHandler",
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


class ProxyStreamHandler(logging.StreamHandler[TextIO]):
    """The stderr handler of `log_config`: a StreamHandler the access line may also write to
    directly, under the same lock, with the same flush after every line."""

    def write_line(self, line: str, record: Record, request_id: str | None) -> None:
        """What `handle` then `emit` do once the line is formatted."""
        self.acquire()
        try:
            self.stream.write(line + self.terminator)
            self.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(_log_record(record, request_id))
        finally:
            self.release()


_TEXT_CLOCK = accessline.TextClock()


class AccessLog:
    """An ExchangeSink: one INFO line per request when it is over. Never content, credentials
    or the query string (`path` is the path only).

    With the proxy's own `log_config` in force (nothing added to or taken from it since), the
    line is rendered here and written to its stderr handler directly (`accessline`): the same
    bytes, without the LogRecord. Any other configuration gets a logging call, as always."""

    def started(self, record: Record) -> None:
        pass

    def responding(self, record: Record) -> None:
        pass

    def finished(self, record: Record) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        handler = _direct_handler()
        if handler is None:
            _log(record)
            return
        formatter = handler.formatter
        exchange = current_record()
        request_id = exchange.request_id if exchange is not None else None
        created, msecs = accessline.clock()
        if type(formatter) is TextFormatter:
            asctime = _TEXT_CLOCK.asctime(
                created,
                msecs,
                formatter.converter,
                formatter.default_time_format,
                formatter.default_msec_format,
            )
            head = f"{asctime} {logging.getLevelName(logging.INFO)} {access_log.name} "
            line = accessline.text_line(head + accessline.message(record), record, request_id)
        else:
            line = accessline.json_line(
                logging.getLevelName(logging.INFO), access_log.name, record, request_id, created
            )
        handler.write_line(line, record, request_id)


def _direct_handler() -> ProxyStreamHandler | None:
    """The handler a logging call would reach, if writing to it directly makes the same line:
    `proxy.access` and the loggers between it and the root adding no handler and propagating,
    no filter on `proxy.access`, the stock LogRecord, and the root's only handler the one
    `log_config` made, with its request-id filter and one of its formatters, unchanged."""
    logger = access_log
    if logger.handlers or logger.filters or not logger.propagate:
        return None
    if logging.getLogRecordFactory() is not logging.LogRecord:
        return None
    root = logging.root
    node = logger.parent
    while node is not root:
        if node is None or node.handlers or not node.propagate:
            return None
        node = node.parent
    handlers = root.handlers
    if len(handlers) != 1:
        return None
    handler = handlers[0]
    if type(handler) is not ProxyStreamHandler or handler.level > logging.INFO:
        return None
    filters = handler.filters
    if len(filters) != 1 or type(filters[0]) is not RequestIdFilter:
        return None
    formatter = handler.formatter
    kind = type(formatter)
    if kind is TextFormatter:
        assert formatter is not None
        if formatter.datefmt is not None or formatter._fmt != _TEXT_FORMAT:
            return None
    elif kind is not ProxyJsonFormatter:
        return None
    return handler


def _log(record: Record) -> None:
    """The access line as a logging call, for any logging configuration."""
    access_log.info(
        "%s %s %s",
        record.method,
        record.path,
        record.status,
        extra=dict(zip(accessline.FIELDS, accessline.field_values(record), strict=True)),
    )


def _log_record(record: Record, request_id: str | None) -> logging.LogRecord:
    """The LogRecord the logging call would have made, for `handleError`'s report."""
    made = access_log.makeRecord(
        access_log.name,
        logging.INFO,
        __file__,
        0,
        "%s %s %s",
        (record.method, record.path, record.status),
        None,
        extra=dict(zip(accessline.FIELDS, accessline.field_values(record), strict=True)),
    )
    made.request_id = request_id
    return made
