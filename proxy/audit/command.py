"""`compaction-proxy audit show ID` and `compaction-proxy audit export > sessions.jsonl`.

`export` writes what `compaction-proxy replay` reads: the recorded requests as the clients
sent them, grouped into sessions by their request chains (a request whose messages start
with all of an earlier request's messages, under the same key and model, continues that
request's session), each session's requests in order, one session after another.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Iterable
from datetime import datetime
from typing import IO, Any

import orjson

from proxy.audit.record import forwarded_messages, original_request
from proxy.audit.sinks import open_reader
from proxy.replay.identifiers import message_text
from proxy.replay.session import write_session
from proxy.settings import ConfigError, Settings, load_settings

_RELATIVE = re.compile(r"^(\d+)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def register_commands(commands: Any) -> None:
    audit = commands.add_parser("audit", help="read the audit trail (show, export)")
    verbs = audit.add_subparsers(dest="verb", required=True, metavar="VERB")
    show = verbs.add_parser("show", help="print one record readably")
    show.add_argument("id", metavar="ID", help="the record's id (x-compaction-audit)")
    show.add_argument("--json", action="store_true", help="print the record as JSON")
    show.add_argument("--full", action="store_true", help="print messages whole")
    export = verbs.add_parser(
        "export", help="write the recorded sessions as replay's input (JSON Lines) to stdout"
    )
    export.add_argument(
        "--since",
        metavar="T",
        help="records from T on: 2025-01-31, 2025-01-31T12:00:00Z, or 2h / 7d ago",
    )
    export.add_argument("--key", metavar="K", help="only this proxy key id's requests")
    for parser in (show, export):
        parser.add_argument("--config", metavar="FILE", help="the server's TOML config")
        parser.add_argument(
            "--sink", metavar="S", help='where to read: "jsonl:DIR" or "redis" (default audit.sink)'
        )
    show.set_defaults(func=show_command)
    export.set_defaults(func=export_command)


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {"audit": {"sink": args.sink}} if args.sink else None
    return load_settings(args.config, overrides)


def parse_since(text: str, now: float | None = None) -> float:
    relative = _RELATIVE.match(text.strip())
    if relative:
        ago = int(relative.group(1)) * _UNITS[relative.group(2)]
        return (time.time() if now is None else now) - ago
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(
            f"--since: {text!r} is neither a date/time (2025-01-31T12:00:00Z) nor 2h / 7d"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.now().astimezone().tzinfo)
    return moment.timestamp()


def _unreadable(settings: Settings, exc: Exception) -> int:
    print(f"compaction-proxy audit: error: cannot read {settings.audit.sink}: "
          f"{type(exc).__name__}: {exc}", file=sys.stderr)  # fmt: skip
    return 2


def _read_errors() -> tuple[type[Exception], ...]:
    try:
        from redis.exceptions import RedisError
    except ImportError:
        return (OSError,)
    return (OSError, RedisError)


def show_command(args: argparse.Namespace) -> int:
    settings = _settings(args)
    try:
        record = open_reader(settings).find(args.id)
    except _read_errors() as exc:
        return _unreadable(settings, exc)
    if record is None:
        print(f"compaction-proxy audit: no record {args.id!r} in {settings.audit.sink}",
              file=sys.stderr)  # fmt: skip
        return 1
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n")
    else:
        sys.stdout.write(describe(record, full=args.full))
    return 0


def _line(message: Any, full: bool) -> str:
    role = message.get("role", "?") if isinstance(message, dict) else "?"
    text = " ".join(message_text(message).split())
    if not full and len(text) > 160:
        text = text[:157] + "..."
    return f"{role:<9} {text}"


def describe(record: dict[str, Any], *, full: bool = False) -> str:
    """One record as text: what was done, the span, the summary, what was forwarded."""
    messages = record.get("messages", [])
    usage = record.get("summarizer_usage") or {}
    span = record.get("span") or []
    out = [
        f"record   {record.get('id')}  {record.get('time')}",
        f"request  {record.get('request_id')}  key {record.get('key_id') or '-'}  "
        f"model {record.get('model')}",
        f"strategy {record.get('strategy')}  fingerprint {record.get('fingerprint') or '-'}  "
        f"budget {record.get('budget')}",
        f"status   {record.get('status')}  reason {record.get('reason') or '-'}  "
        f"cache {record.get('cache') or '-'}",
        f"tokens   {record.get('tokens_before')} -> {record.get('tokens_after')}  "
        f"summarizer {usage.get('input_tokens', 0)} in / {usage.get('output_tokens', 0)} out",
        "",
        f"compacted span: {len(span)} of {len(messages)} messages",
    ]
    out += [f"  #{i:<4} {_line(messages[i], full)}" for i in span if i < len(messages)]
    out += ["", "summary:"]
    summary = record.get("summary")
    out += ["  " + line for line in (summary or "(none)").splitlines()]
    forwarded = record.get("forwarded") or []
    out += ["", f"forwarded: {len(forwarded)} messages"]
    for part, message in zip(forwarded, forwarded_messages(record), strict=True):
        where = f"#{part['index']}" if "index" in part else "new"
        out.append(f"  {where:<5} {_line(message, full)}")
    return "\n".join(out) + "\n"


def _digest(message: Any) -> bytes:
    try:
        return orjson.dumps(message)
    except TypeError:
        return repr(message).encode()


def sessions_of(records: Iterable[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Records grouped into request chains (see the module docstring), oldest first."""
    chains: list[list[dict[str, Any]]] = []
    ends: dict[tuple[Any, Any, int], int] = {}  # (key, model, prefix hash) -> chain
    last_end: dict[int, tuple[Any, Any, int]] = {}
    for record in sorted(records, key=lambda r: r.get("ts", 0)):
        request = original_request(record)
        messages = request["messages"]
        key, model = record.get("key_id"), request.get("model")
        prefixes = []
        rolling = 0
        for message in messages:
            rolling = hash((rolling, _digest(message)))
            prefixes.append(rolling)
        chain = None
        for prefix in reversed(prefixes):
            chain = ends.get((key, model, prefix))
            if chain is not None:
                break
        if chain is None:
            chain = len(chains)
            chains.append([])
        else:
            ends.pop(last_end[chain], None)
        chains[chain].append(request)
        if prefixes:
            end = (key, model, prefixes[-1])
            ends[end] = chain
            last_end[chain] = end
    return chains


def export(records: Iterable[dict[str, Any]], out: IO[bytes]) -> int:
    """Write the sessions; how many."""
    chains = sessions_of(records)
    for chain in chains:
        write_session(chain, out)
    return len(chains)


def export_command(args: argparse.Namespace) -> int:
    settings = _settings(args)
    since = parse_since(args.since) if args.since else None
    records = open_reader(settings).records(since)
    if args.key:
        records = (r for r in records if r.get("key_id") == args.key)
    try:
        count = export(records, sys.stdout.buffer)
    except _read_errors() as exc:
        return _unreadable(settings, exc)
    sys.stdout.buffer.flush()
    print(f"compaction-proxy audit: exported {count} session(s)", file=sys.stderr)
    return 0
