"""The audit trail: records of compactions written off the request path, read back by
`audit show` and `audit export`, and replayed; a broken or slow sink never changes a reply."""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxy.audit import AuditTrail
from proxy.audit.command import parse_since, sessions_of
from proxy.audit.sinks import RedisReader
from proxy.cli import main
from proxy.replay.session import Session, load
from proxy.settings import Settings
from proxy.testing import FakeOpenAI, make_app, make_settings
from tests.evaluation.replaying import replay, run_of, shipped

SECRET = "sk-proxy-" + "s3cr3t" * 6  # a proxy key: must appear in no record
DIGEST = hashlib.sha256(SECRET.encode()).hexdigest()
AUTH = {"content-type": "application/json", "authorization": f"Bearer {SECRET}"}


def audited_settings(folder: Path, **audit: Any) -> Settings:
    return make_settings(
        compaction={"budget_tokens": 6000},
        audit={"enabled": True, "sink": f"jsonl:{folder}", **audit},
        auth={"keys": [{"id": "team-a", "key_sha256": DIGEST}]},
    )


async def send_all(app: Any, session: Session, fake: FakeOpenAI) -> list[httpx.Response]:
    responses = []
    with fake.mock():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy.test") as client:
            for raw in session.lines:
                responses.append(await client.post("/v1/chat/completions", content=raw,
                                                   headers=AUTH))  # fmt: skip
    return responses


def cli(argv: list[str], capsys: pytest.CaptureFixture[bytes]) -> tuple[int, bytes, bytes]:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    captured = capsys.readouterr()
    return int(exit.value.code or 0), captured.out, captured.err


@pytest.fixture(scope="module")
def support() -> Session:
    [session] = shipped("support-chat")
    return session


async def test_records_round_trip_into_replay(
    tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes], support: Session
) -> None:
    folder = tmp_path / "audit"
    app = make_app(audited_settings(folder, record_passthrough=True))
    responses = await send_all(app, support, FakeOpenAI(summary_tokens=200))
    trail = app.state.proxy.audit
    trail.close()
    assert [r.status_code for r in responses] == [200] * support.turns
    ids = [r.headers["x-compaction-audit"] for r in responses]
    assert len(set(ids)) == support.turns and trail.written == support.turns

    code, out, err = cli(["audit", "export", "--sink", f"jsonl:{folder}"], capsysbinary)
    assert code == 0 and b"exported 1 session" in err
    exported = [json.loads(line) for line in out.splitlines()]
    assert exported == [json.loads(raw) for raw in support.lines]  # the requests as sent

    path = tmp_path / "exported.jsonl"
    path.write_bytes(out)
    settings = make_settings(compaction={"budget_tokens": 6000})
    replayed = await replay(load([str(path)]), settings, FakeOpenAI(summary_tokens=200))
    original = await replay([support], settings, FakeOpenAI(summary_tokens=200))
    for strategy, budget in (("none", None), ("simple", 8000)):
        a = run_of(replayed, "exported", strategy, budget)
        b = run_of(original, "support-chat", strategy, budget)
        for field in ("forwarded_tokens", "statuses", "summarizer", "cost", "recall"):
            assert a[field] == b[field]


async def test_a_record_shows_what_was_done_and_never_the_key(
    tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes], support: Session
) -> None:
    folder = tmp_path / "audit"
    app = make_app(audited_settings(folder))
    responses = await send_all(app, support, FakeOpenAI(summary_tokens=200))
    app.state.proxy.audit.close()
    audited = [r for r in responses if "x-compaction-audit" in r.headers]
    statuses = {r.headers["x-compaction-status"] for r in audited}
    assert audited and statuses <= {"compacted", "extended", "reused", "over_budget"}
    assert all("x-compaction-audit" not in r.headers for r in responses
               if r.headers["x-compaction-status"] == "passthrough")  # fmt: skip

    record_id = audited[0].headers["x-compaction-audit"]
    code, out, _ = cli(["audit", "show", record_id, "--sink", f"jsonl:{folder}"], capsysbinary)
    text = out.decode()
    assert code == 0
    assert f"record   {record_id}" in text and "key team-a" in text
    assert f"status   {audited[0].headers['x-compaction-status']}" in text
    assert "FAKE SUMMARY" in text and "compacted span:" in text and "forwarded:" in text

    code, out, _ = cli(["audit", "show", record_id, "--json", "--sink", f"jsonl:{folder}"],
                       capsysbinary)  # fmt: skip
    record = json.loads(out)
    assert record["tokens_before"] == int(audited[0].headers["x-compaction-tokens-before"])
    assert record["tokens_after"] == int(audited[0].headers["x-compaction-tokens-after"])
    assert record["summary"].startswith("<system>Previous context has been compacted")
    assert record["span"] and record["key_id"] == "team-a" and record["strategy"] == "hybrid"
    assert record["fingerprint"]
    for file in folder.iterdir():
        assert SECRET.encode() not in file.read_bytes()
        assert DIGEST.encode() not in file.read_bytes()

    code, out, err = cli(["audit", "show", "aud_0000000000000_000000000000", "--sink",
                          f"jsonl:{folder}"], capsysbinary)  # fmt: skip
    assert code == 1 and b"no record" in err


def with_key(settings: Settings, audit: bool) -> Settings:
    data = settings.model_dump()
    data["auth"]["keys"] = [{"id": "team-a", "key_sha256": DIGEST, "audit": audit}]
    return Settings.model_validate(data)


async def test_a_key_s_switch_overrides_the_audit_setting(tmp_path: Path, support: Session) -> None:
    folder = tmp_path / "audit"
    settings = audited_settings(folder, enabled=False)
    app = make_app(with_key(settings, audit=True))
    responses = await send_all(app, support, FakeOpenAI())
    app.state.proxy.audit.close()
    assert any("x-compaction-audit" in r.headers for r in responses)

    folder_off = tmp_path / "off"
    settings = audited_settings(folder_off)
    app = make_app(with_key(settings, audit=False))
    responses = await send_all(app, support, FakeOpenAI())
    assert not any("x-compaction-audit" in r.headers for r in responses)
    assert not folder_off.exists()


def comparable(response: httpx.Response) -> tuple[int, bytes, dict[str, str]]:
    unstable = ("x-compaction-audit", "x-compaction-overhead-ms")
    headers = {k: v for k, v in response.headers.items()
               if k.startswith("x-compaction") and k not in unstable}  # fmt: skip
    return response.status_code, response.content, headers


class BrokenSink:
    def write(self, record_id: str, line: bytes) -> None:
        raise ConnectionError("the audit store is down")

    def close(self) -> None:
        pass


async def test_a_broken_sink_changes_no_reply(tmp_path: Path, support: Session) -> None:
    plain = make_app(audited_settings(tmp_path / "unused", enabled=False))
    expected = await send_all(plain, support, FakeOpenAI(summary_tokens=200))

    app = make_app(audited_settings(tmp_path / "unused"))
    trail = AuditTrail(app.state.proxy.settings, sink=BrokenSink)
    app.state.proxy.audit = trail
    responses = await send_all(app, support, FakeOpenAI(summary_tokens=200))
    trail.close()
    assert [comparable(r) for r in responses] == [comparable(r) for r in expected]
    compacted = sum(1 for r in responses if r.headers["x-compaction-status"] != "passthrough")
    assert trail.dropped == {"queue_full": 0, "sink_error": compacted, "record_error": 0}
    assert trail.written == 0
    # Only the first record was promised before the sink was known to fail.
    assert sum(1 for r in responses if "x-compaction-audit" in r.headers) <= 1


async def test_drops_show_in_the_app_s_metrics(tmp_path: Path, support: Session) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")  # the jsonl sink cannot make its folder here
    app = make_app(audited_settings(blocked))
    responses = await send_all(app, support, FakeOpenAI())
    app.state.proxy.audit.close()
    assert all(r.status_code == 200 for r in responses)
    compacted = sum(1 for r in responses if r.headers["x-compaction-status"] != "passthrough")
    with FakeOpenAI().mock():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy.test") as c:
            scrape = (await c.get("/metrics")).text
    assert f'compaction_proxy_audit_dropped_total{{reason="sink_error"}} {compacted}.0' in scrape
    assert "compaction_proxy_audit_records_total 0.0" in scrape


class BlockedSink:
    """Blocks in its first write until released: a sink slower than any request."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.lines: list[bytes] = []

    def write(self, record_id: str, line: bytes) -> None:
        self.entered.set()
        assert self.release.wait(30)
        self.lines.append(line)

    def close(self) -> None:
        pass


async def test_a_slow_sink_never_holds_a_request(tmp_path: Path, support: Session) -> None:
    app = make_app(audited_settings(tmp_path / "unused", queue_size=2, record_passthrough=True))
    sink = BlockedSink()
    registry = CollectorRegistry()
    trail = AuditTrail(app.state.proxy.settings, registry, sink=lambda: sink)
    app.state.proxy.audit = trail
    first, rest = (
        Session(**{**support.__dict__, "lines": support.lines[:1]}),
        Session(**{**support.__dict__, "lines": support.lines[1:11]}),
    )
    fake = FakeOpenAI()
    answered = await send_all(app, first, fake)
    assert sink.entered.wait(10)  # the writer holds the first record, inside the sink
    answered += await send_all(app, rest, fake)
    # Every request was answered while the sink was still blocked: none waited for it.
    assert not sink.release.is_set()
    assert [r.status_code for r in answered] == [200] * 11
    assert trail.dropped == {
        "queue_full": 8,
        "sink_error": 0,
        "record_error": 0,
    }  # 1 in the sink, 2 queued
    dropped = registry.get_sample_value("compaction_proxy_audit_dropped_total",
                                        {"reason": "queue_full"})  # fmt: skip
    assert dropped == 8
    sink.release.set()
    trail.close()
    assert trail.written == len(sink.lines) == 3


def test_sessions_are_rebuilt_by_their_request_chains() -> None:
    def record(ts: float, key: str, messages: list[str]) -> dict[str, Any]:
        return {"ts": ts, "key_id": key, "request": {"model": "m"},
                "messages": [{"role": "user", "content": c} for c in messages]}  # fmt: skip

    records = [
        record(1, "a", ["task 1"]),
        record(2, "a", ["task 2"]),
        record(3, "a", ["task 1", "more"]),
        record(4, "b", ["task 1", "more", "again"]),  # another key: another session
        record(5, "a", ["task 2", "x", "y"]),
        record(6, "a", ["task 1", "more", "again"]),
    ]
    chains = sessions_of(reversed(records))  # any order in, time order out
    contents = [[[m["content"] for m in r["messages"]] for r in chain] for chain in chains]
    assert contents == [
        [["task 1"], ["task 1", "more"], ["task 1", "more", "again"]],
        [["task 2"], ["task 2", "x", "y"]],
        [["task 1", "more", "again"]],
    ]


def test_since_reads_dates_and_durations() -> None:
    assert parse_since("2h", now=10_000.0) == 10_000.0 - 7200
    assert parse_since("2025-01-31T12:00:00Z") == 1738324800.0
    with pytest.raises(Exception, match="neither a date"):
        parse_since("yesterday")


@pytest.fixture
def redis_stream() -> Iterator[tuple[str, str]]:
    redis = pytest.importorskip("redis")
    url = "redis://127.0.0.1:6379/0"
    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    key = f"compaction-proxy-test:audit:{secrets.token_hex(6)}"
    try:
        yield url, key
    finally:
        client.delete(key)
        client.close()


async def test_the_redis_sink_keeps_a_bounded_stream(
    tmp_path: Path,
    redis_stream: tuple[str, str],
    support: Session,
    capsysbinary: pytest.CaptureFixture[bytes],
) -> None:
    url, key = redis_stream
    settings = make_settings(
        compaction={"budget_tokens": 6000},
        audit={"enabled": True, "sink": "redis", "redis_url": url, "stream_key": key,
               "ttl_s": 3600, "record_passthrough": True},
    )  # fmt: skip
    app = make_app(settings)
    responses = await send_all(app, support, FakeOpenAI())
    app.state.proxy.audit.close()
    import redis

    client = redis.Redis.from_url(url)
    assert client.xlen(key) == support.turns
    assert 0 < client.ttl(key) <= 3600
    client.close()
    reader = RedisReader(url, key)
    record_id = responses[-1].headers["x-compaction-audit"]
    record = reader.find(record_id)
    assert record is not None and record["id"] == record_id
    assert len(list(reader.records())) == support.turns
    config = tmp_path / "proxy.toml"
    config.write_text(f'[audit]\nsink = "redis"\nredis_url = "{url}"\nstream_key = "{key}"\n')
    code, out, _ = cli(["audit", "export", "--config", str(config)], capsysbinary)
    assert code == 0
    assert [json.loads(line) for line in out.splitlines()] == [
        json.loads(raw) for raw in support.lines
    ]


async def test_a_record_that_cannot_be_taken_fails_no_request(
    tmp_path: Path, support: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(**fields: Any) -> Any:
        raise ValueError("cannot take this record")

    monkeypatch.setattr("proxy.audit.trail.pending", broken)
    app = make_app(audited_settings(tmp_path / "audit"))
    responses = await send_all(app, support, FakeOpenAI())
    trail = app.state.proxy.audit
    assert all(r.status_code == 200 and "x-compaction-audit" not in r.headers for r in responses)
    compacted = sum(1 for r in responses if r.headers["x-compaction-status"] != "passthrough")
    assert trail.dropped["record_error"] == compacted > 0
