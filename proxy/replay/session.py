"""Session files: JSON Lines, one chat-completions request body per line, in the order the
agent sent them. Each line is the whole request (model, tools, params, the history so far).

A file may be plain (`.jsonl`), gzip (`.jsonl.gz`) or xz (`.jsonl.xz`: xz finds each line in
the one before it, so a session takes a few percent of its plain size); `-` reads standard
input. Blank lines are skipped. A file may hold several sessions one after the other (what
`compaction-proxy audit export` writes): a line whose messages do not start with the
previous line's messages starts a new session (`NAME#2`, `NAME#3`, ...).
"""

from __future__ import annotations

import gzip
import json
import lzma
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

from proxy.errors import ProxyError
from proxy.validation import parse_chat_body


class SessionError(Exception):
    """A file that is not a session file, worded for one line (file and line number)."""


@dataclass
class Session:
    """One chain of requests. `lines` are the requests' bytes as recorded; `final` is the
    last request's messages (the whole history: every later line extends the one before)."""

    name: str
    source: str
    lines: list[bytes]
    model: str
    final: list[Any]
    tools: list[Any]
    first_line: int  # where it starts in its file (1-based)

    @property
    def turns(self) -> int:
        return len(self.lines)


def _open(path: str) -> IO[bytes]:
    if path == "-":
        return sys.stdin.buffer
    if path.endswith(".xz"):
        return lzma.open(path, "rb")
    if path.endswith(".gz"):
        return cast(IO[bytes], gzip.open(path, "rb"))
    return open(path, "rb")


def session_name(path: str) -> str:
    if path == "-":
        return "stdin"
    name = Path(path).name
    for suffix in (".xz", ".gz", ".jsonl", ".json", ".ndjson"):
        name = name.removesuffix(suffix)
    return name


def _request(raw: bytes, where: str) -> dict[str, Any]:
    """The line as the chat route parses it: the proxy's own 400s become one clear line."""
    try:
        json.loads(raw)
    except ValueError as exc:
        raise SessionError(f"{where}: not JSON ({exc}); expected one request per line") from None
    try:
        body = parse_chat_body(raw)
    except ProxyError as exc:
        raise SessionError(f"{where}: not a chat completions request: {exc.message}") from None
    if not isinstance(body.get("model"), str):
        raise SessionError(f"{where}: not a chat completions request: no `model`")
    return body


def read_sessions(path: str) -> Iterator[Session]:
    """The sessions of one file, checked line by line. Raises SessionError (bad input) or
    OSError (cannot read it)."""
    base = session_name(path)
    count = 0
    current: Session | None = None
    previous: list[Any] = []
    with _open(path) as file:
        try:
            for number, raw in enumerate(file, 1):
                if not raw.strip():
                    continue
                body = _request(raw, f"{path} line {number}")
                messages = body["messages"]
                extends = current is not None and messages[: len(previous)] == previous
                if current is None or not extends or len(messages) < len(previous):
                    if current is not None:
                        yield current
                    count += 1
                    name = base if count == 1 else f"{base}#{count}"
                    current = Session(name, path, [], body["model"], [], [], number)
                current.lines.append(raw.rstrip(b"\r\n"))
                current.final = messages
                current.tools = body.get("tools") or []
                previous = messages
        except (EOFError, lzma.LZMAError, gzip.BadGzipFile, UnicodeDecodeError) as exc:
            raise SessionError(f"{path}: cannot be read ({exc})") from None
    if current is None:
        raise SessionError(f"{path}: no requests in it")
    yield current


def load(paths: list[str]) -> list[Session]:
    """Every session of every file; raises SessionError naming the first bad line."""
    sessions: list[Session] = []
    for path in paths:
        try:
            sessions.extend(read_sessions(path))
        except OSError as exc:
            raise SessionError(f"{path}: {exc.strerror or exc}") from None
    names: dict[str, int] = {}
    for session in sessions:  # two files with one name: keep the names apart
        seen = names.get(session.name, 0)
        names[session.name] = seen + 1
        if seen:
            session.name = f"{session.name}~{seen + 1}"
    return sessions


def write_session(requests: list[dict[str, Any]], file: IO[bytes]) -> None:
    """Requests as session lines (compact JSON, UTF-8 as is)."""
    for body in requests:
        file.write(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")
