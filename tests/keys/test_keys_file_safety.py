"""The keys file: both spellings, wrong shapes refused with one line, a bad or empty file
never applied, and changes picked up without traffic and before the next request is judged."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import respx

from proxy.auth.keys_file import read_keys_file
from proxy.settings import ConfigError
from tests.conftest import make_settings
from tests.keys.conftest import KEY_A, KEY_B, App, bearer, chat, key_entry, sha
from tests.upstream_fakes import REPLY

pytestmark = pytest.mark.usefixtures("upstream")


def toml_key(key_id: str, key: str, table: str = "keys", **extra: Any) -> str:
    lines = [f"[[{table}]]", f'id = "{key_id}"', f'key_sha256 = "{sha(key)}"']
    lines += [f"{name} = {json.dumps(value)}" for name, value in extra.items()]
    return "\n".join(lines) + "\n"


def replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomic, as a deploy tool would


async def status(app: App, key: str) -> int:
    reply = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(key))
    return reply.status_code


@pytest.mark.parametrize("table", ["keys", "auth.keys"])
def test_both_spellings_are_read_with_their_teams(tmp_path: Path, table: str) -> None:
    path = tmp_path / "keys.toml"
    teams = "teams" if table == "keys" else "auth.teams"
    path.write_text(
        toml_key("a", KEY_A, table, team="platform")
        + f"[{teams}.platform]\nrequests_per_minute = 5\n"
    )
    read = read_keys_file(path)
    assert [(k.id, k.team) for k in read.keys] == [("a", "platform")]
    assert read.teams["platform"].requests_per_minute == 5


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            toml_key("a", KEY_A) + toml_key("b", KEY_B, "auth.keys"),
            "both [[keys]] and [[auth.keys]]",
        ),
        ("[auth]\nkeys_file = 'x'\n", "auth.keys_file belongs in the proxy's config"),
        ("[[key]]\nid = 'a'\n", "unknown key 'key'"),
        ("", "holds no keys"),
        ("keys = []\n", "holds no keys"),
        ("[[keys]]\nid = 'a'\nkey_sha256 = 'not-hex'\n", "keys.0.key_sha256"),
        ("[[keys\n", "does not parse"),
    ],
)
def test_a_wrong_file_is_refused_with_one_clear_line(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        read_keys_file(path)
    assert says in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_json_file_may_be_a_list_or_either_table(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    for data in (
        [key_entry("a", KEY_A)],
        {"keys": [key_entry("a", KEY_A)]},
        {"auth": {"keys": [key_entry("a", KEY_A)]}},
    ):
        path.write_text(json.dumps(data))
        assert [k.id for k in read_keys_file(path).keys] == ["a"]


@pytest.mark.parametrize(
    "broken", ["[[keys\n", "", "[[keys]]\nid = 'a'\nkey_sha256 = 'not-hex'\n", "[[key]]\n"]
)
async def test_a_broken_or_empty_file_is_not_applied_warned_and_counted(
    make_app: Any,
    upstream: respx.MockRouter,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    broken: str,
) -> None:
    upstream.post("/chat/completions").respond(json=REPLY)
    path = tmp_path / "keys.toml"
    path.write_text(toml_key("a", KEY_A))
    app = await make_app(make_settings(auth={"keys_file": str(path), "reload_interval_s": 0.05}))
    source = app.state.gate.source
    with caplog.at_level(logging.WARNING, logger="proxy.auth"):
        replace(path, broken)
        await _poll(lambda: source.reload_failures["file"] == 1)
    assert await status(app, KEY_A) == 200  # the previous keys stay
    [warning] = [r for r in caplog.records if r.name == "proxy.auth"]
    assert warning.levelno == logging.WARNING and "keeping the previous keys" in warning.message
    metrics = (await app.client.get("/metrics")).text
    assert 'compaction_proxy_keys_reload_failures_total{source="file"} 1.0' in metrics
    assert 'compaction_proxy_keys{origin="file"} 1.0' in metrics


def test_a_file_without_keys_stops_the_start(tmp_path: Path) -> None:
    from proxy.app import create_app

    path = tmp_path / "keys.toml"
    path.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="holds no keys"):
        create_app(make_settings(auth={"keys_file": str(path)}))


async def _poll(condition: Any, limit_s: float = 10.0) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < limit_s, "condition never held"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


async def test_a_revoked_key_is_refused_by_two_quiet_replicas_within_the_interval(
    make_app: Any, upstream: respx.MockRouter, tmp_path: Path
) -> None:
    """No request while the file changes: each replica's watcher applies it by itself,
    within reload_interval_s (+ 1 s of slack for a loaded machine)."""
    route = upstream.post("/chat/completions").respond(json=REPLY)
    path = tmp_path / "keys.toml"
    path.write_text(toml_key("a", KEY_A) + toml_key("b", KEY_B))
    interval = 0.2
    settings = make_settings(auth={"keys_file": str(path), "reload_interval_s": interval})
    replicas = [await make_app(settings), await make_app(settings)]
    for replica in replicas:
        assert await status(replica, KEY_A) == 200
    replace(path, toml_key("b", KEY_B))
    changed = time.monotonic()
    for replica in replicas:  # polled through the source: no request sent meanwhile
        source = replica.state.gate.source
        await _poll(lambda s=source: s.ring.find(KEY_A) is None)
    assert time.monotonic() - changed < interval + 1.0
    calls = route.call_count
    for replica in replicas:
        assert await status(replica, KEY_A) == 401
        assert await status(replica, KEY_B) == 200
    assert route.call_count == calls + 2


async def test_a_change_is_applied_before_the_request_that_finds_it_is_judged(
    upstream: respx.MockRouter, tmp_path: Path
) -> None:
    """Without a watcher running (a clock that stands still for it), the first request
    after the interval stats the file and is judged by the new keys, not let through."""
    from proxy.auth import Gate, KeySource
    from proxy.errors import ProxyError

    path = tmp_path / "keys.toml"
    path.write_text(toml_key("a", KEY_A))
    settings = make_settings(auth={"keys_file": str(path), "reload_interval_s": 30})
    now = [1000.0]
    source = KeySource(settings.auth, clock=lambda: now[0])
    gate = Gate(settings, source)
    source._watcher = asyncio.get_running_loop().create_future()  # no watcher: traffic only
    wire = [(b"authorization", f"Bearer {KEY_A}".encode())]
    assert gate.admit(wire).key_id == "a"
    replace(path, toml_key("b", KEY_B))
    assert gate.admit(wire).key_id == "a"  # not due yet: the interval has not passed
    now[0] += 30
    with pytest.raises(ProxyError) as refused:
        gate.admit(wire)
    assert refused.value.status == 401
    assert gate.admit([(b"authorization", f"Bearer {KEY_B}".encode())]).key_id == "b"


async def test_one_id_twice_with_one_policy_is_a_rotation_and_expires_at_ends_one(
    make_app: Any, upstream: respx.MockRouter, tmp_path: Path
) -> None:
    upstream.post("/chat/completions").respond(json=REPLY)
    path = tmp_path / "keys.toml"
    path.write_text(toml_key("a", KEY_A, expires_at="2020-01-01T00:00:00Z") + toml_key("a", KEY_B))
    app = await make_app(make_settings(auth={"keys_file": str(path)}))
    expired = await app.client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert expired.status_code == 401 and "expired" in expired.json()["error"]["message"]
    assert await status(app, KEY_B) == 200
    path.write_text(toml_key("a", KEY_A, team="x") + toml_key("a", KEY_B))
    with pytest.raises(ConfigError, match="differ in policy"):
        from proxy.app import create_app

        create_app(make_settings(auth={"keys_file": str(path)}))
