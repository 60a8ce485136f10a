"""Where audit records go, and how they are read back.

- `jsonl:DIR`: one JSON object per line in `DIR/audit-<UTC time>-<pid>-<n>.jsonl`; a file is
  closed once past `max_file_bytes` and the oldest files go once there are more than
  `max_files` (across the processes writing to DIR).
- `redis`: a stream (`stream_key`) at `audit.redis_url` (else `cache.redis_url`); each XADD
  trims it to about `max_len` entries, entries older than `ttl_s` are trimmed too, and the
  key expires `ttl_s` after the last write.

Sinks are written from the trail's writer thread only (blocking calls are fine there).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import orjson

from proxy.audit.record import id_time
from proxy.settings import ConfigError, Settings

FILE_GLOB = "audit-*.jsonl"
SOCKET_TIMEOUT_S = 2.0
FIND_WINDOW_MS = 10 * 60 * 1000  # a record is written within minutes of its id's time
_CHUNK = 200


class Sink(Protocol):
    def write(self, record_id: str, line: bytes) -> None: ...

    def close(self) -> None: ...


class Reader(Protocol):
    def records(self, since: float | None = None) -> Iterator[dict[str, Any]]: ...

    def find(self, record_id: str) -> dict[str, Any] | None: ...


class JsonlSink:
    def __init__(self, folder: Path, max_file_bytes: int, max_files: int) -> None:
        self.folder = folder
        self.max_file_bytes = max_file_bytes
        self.max_files = max_files
        self._file: Any = None
        self._size = 0
        self._made = 0

    def write(self, record_id: str, line: bytes) -> None:
        if self._file is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._made += 1
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
            path = self.folder / f"audit-{stamp}-{os.getpid()}-{self._made:04d}.jsonl"
            self._file = open(path, "ab")  # noqa: SIM115 (kept open across writes)
            self._size = 0
            self._prune()
        self._file.write(line + b"\n")
        self._file.flush()
        self._size += len(line) + 1
        if self._size >= self.max_file_bytes:
            self.close()

    def _prune(self) -> None:
        files = sorted(self.folder.glob(FILE_GLOB))
        for old in files[: max(0, len(files) - self.max_files)]:
            old.unlink(missing_ok=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class JsonlReader:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def records(self, since: float | None = None) -> Iterator[dict[str, Any]]:
        for path in sorted(self.folder.glob(FILE_GLOB)):
            with open(path, "rb") as file:
                for line in file:
                    if not line.strip():
                        continue
                    try:
                        record = orjson.loads(line)
                    except orjson.JSONDecodeError:
                        continue  # a line cut short by a crash
                    if since is None or record.get("ts", 0) >= since:
                        yield record

    def find(self, record_id: str) -> dict[str, Any] | None:
        needle = record_id.encode()
        for path in sorted(self.folder.glob(FILE_GLOB), reverse=True):
            with open(path, "rb") as file:
                for line in file:
                    if needle in line:
                        record = orjson.loads(line)
                        if record.get("id") == record_id:
                            return record  # type: ignore[no-any-return]
        return None


class RedisSink:
    def __init__(self, url: str, key: str, max_len: int, ttl_s: int) -> None:
        import redis

        self.client = redis.Redis.from_url(
            url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S
        )
        self.key = key
        self.max_len = max_len
        self.ttl_s = ttl_s

    def write(self, record_id: str, line: bytes) -> None:
        oldest = int(time.time() * 1000) - self.ttl_s * 1000
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(self.key, {"id": record_id, "record": line}, maxlen=self.max_len,
                  approximate=True)  # fmt: skip
        pipe.xtrim(self.key, minid=str(max(oldest, 0)), approximate=True)
        pipe.expire(self.key, self.ttl_s)
        pipe.execute()

    def close(self) -> None:
        self.client.close()


class RedisReader:
    def __init__(self, url: str, key: str) -> None:
        import redis

        self.client = redis.Redis.from_url(
            url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S
        )
        self.key = key

    def _range(self, start: str, end: str) -> Iterator[dict[str, Any]]:
        while True:
            entries: list[Any] = (
                self.client.xrange(self.key, min=start, max=end, count=_CHUNK) or []
            )
            for _, fields in entries:
                yield orjson.loads(fields[b"record"])
            if len(entries) < _CHUNK:
                return
            start = "(" + bytes(entries[-1][0]).decode()

    def records(self, since: float | None = None) -> Iterator[dict[str, Any]]:
        start = "-" if since is None else str(int(since * 1000))
        for record in self._range(start, "+"):
            if since is None or record.get("ts", 0) >= since:
                yield record

    def find(self, record_id: str) -> dict[str, Any] | None:
        made = id_time(record_id)
        start, end = "-", "+"
        if made is not None:
            ms = int(made * 1000)
            start, end = str(max(ms - FIND_WINDOW_MS, 0)), str(ms + FIND_WINDOW_MS)
        for record in self._range(start, end):
            if record.get("id") == record_id:
                return record
        return None


def redis_url_of(settings: Settings) -> str:
    url = settings.audit.redis_url or settings.cache.redis_url
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(
            "audit.redis_url: the audit stream needs one redis:// (or rediss://) URL; "
            "set audit.redis_url"
        )
    return url


def open_sink(settings: Settings) -> Sink:
    config = settings.audit
    if config.sink == "redis":
        return RedisSink(redis_url_of(settings), config.stream_key, config.max_len, config.ttl_s)
    return JsonlSink(Path(config.sink[len("jsonl:") :]), config.max_file_bytes, config.max_files)


def open_reader(settings: Settings) -> Reader:
    config = settings.audit
    if config.sink == "redis":
        return RedisReader(redis_url_of(settings), config.stream_key)
    return JsonlReader(Path(config.sink[len("jsonl:") :]))
