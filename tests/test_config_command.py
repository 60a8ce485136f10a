"""Start-up and configuration traps: the example that ships, `config show`, the start-up
line, and an admin token variable named under the settings' own prefix."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import httpx
import pytest

from proxy.app import create_app
from proxy.cli import main
from proxy.settings import ConfigError, load_settings
from proxy.testing.app import load_offline_tokenizer

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "config" / "proxy.example.toml"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exited.value.code or 0), out, err


def test_the_example_that_ships_in_the_package_is_the_checkouts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(capsys, "config", "example")
    assert code == 0
    # One file: config/'s is a link to the package's, so readers of the repository and
    # installs see the same text.
    assert EXAMPLE.resolve() == (REPO / "proxy" / "proxy.example.toml").resolve()
    assert out == EXAMPLE.read_text(encoding="utf-8")


def uncommented_admin(text: str) -> str:
    line = '# token_env = "PROXY_ADMIN_TOKEN"'
    assert line in text, "the example's admin section changed"
    return text.replace(line, line[2:])


async def test_the_examples_admin_token_works_once_uncommented(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text(uncommented_admin(EXAMPLE.read_text(encoding="utf-8")))
    monkeypatch.setenv("PROXY_ADMIN_TOKEN", "admin-from-the-example")
    settings = load_settings(config, {"upstream": {"base_url": "http://upstream.test/v1"}})
    assert settings.admin.token_env == "PROXY_ADMIN_TOKEN"
    load_offline_tokenizer()
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        refused = await client.get("/admin/keys", headers={"authorization": "Bearer wrong"})
        listed = await client.get(
            "/admin/keys", headers={"authorization": "Bearer admin-from-the-example"}
        )
    assert refused.status_code == 401
    assert listed.status_code == 200, listed.text
    await app.state.proxy.upstream.client.aclose()


@pytest.mark.parametrize("where", ["file", "environment"])
def test_a_token_variable_under_the_settings_prefix_is_accepted_when_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # The example used to say `token_env = "COMPACTION_PROXY_ADMIN_TOKEN"`, and the start
    # refused that variable as a misspelt setting.
    monkeypatch.setenv("COMPACTION_PROXY_ADMIN_TOKEN", "admin-secret")
    config = tmp_path / "proxy.toml"
    if where == "file":
        config.write_text('[admin]\ntoken_env = "COMPACTION_PROXY_ADMIN_TOKEN"\n')
    else:
        config.write_text("")
        monkeypatch.setenv("COMPACTION_PROXY_ADMIN__TOKEN_ENV", "COMPACTION_PROXY_ADMIN_TOKEN")
    assert load_settings(config).admin.token_env == "COMPACTION_PROXY_ADMIN_TOKEN"


def test_an_unnamed_variable_under_the_prefix_is_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COMPACTION_PROXY_ADMIN_TOKEN", "admin-secret")
    config = tmp_path / "proxy.toml"
    config.write_text('[admin]\ntoken_env = "PROXY_ADMIN_TOKEN"\n')
    with pytest.raises(ConfigError, match="COMPACTION_PROXY_ADMIN_TOKEN: unknown key"):
        load_settings(config)


SECRETS = {
    "upstream_key": "sk-upstream-SECRET1",
    "summarizer_key": "sk-summarizer-SECRET2",
    "proxy_password": "egress-SECRET3",
    "redis_password": "redis-SECRET4",
    "quota_password": "quota-SECRET5",
    "team_key": "pk-team-SECRET6",
    "admin_token": "admin-SECRET7",
    "query_key": "query-SECRET8",
}


def test_config_show_prints_the_resolved_config_without_a_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    s = SECRETS
    digest = hashlib.sha256(s["team_key"].encode()).hexdigest()
    config = tmp_path / "proxy.toml"
    config.write_text(
        f"""
[server]
port = 7001
[upstream]
base_url = "https://api.example.com/v1?key={s["query_key"]}"
api_key = "{s["upstream_key"]}"
proxy_url = "http://egress:{s["proxy_password"]}@egress.internal:3128"
[compaction]
budget_tokens = 5000
[compaction.summarizer]
api_key = "{s["summarizer_key"]}"
[cache]
backend = "redis"
redis_url = "redis://:{s["redis_password"]}@redis.internal:6379/0"
[quota]
redis_url = ["redis://:{s["quota_password"]}@node1:6379", "node2:6379"]
[admin]
token_env = "PROXY_ADMIN_TOKEN"
[[auth.keys]]
id = "team-a"
key_sha256 = "{digest}"
[[auth.keys]]
id = "team-b"
key_env = "PROXY_KEY_TEAM_B"
"""
    )
    monkeypatch.setenv("PROXY_ADMIN_TOKEN", s["admin_token"])
    monkeypatch.setenv("COMPACTION_PROXY_COMPACTION__BUDGET_TOKENS", "6000")  # env over file
    code, out, err = run_cli(capsys, "config", "show", "--config", str(config), "--port", "7002")
    assert code == 0, err
    for secret in [*s.values(), digest]:
        assert secret not in out and secret not in err, secret
    shown = json.loads(out)
    assert shown["server"]["port"] == 7002  # flags over file
    assert shown["compaction"]["budget_tokens"] == 6000  # environment over file
    assert shown["compaction"]["strategy"] == "hybrid"  # defaults
    assert shown["upstream"]["base_url"] == "https://api.example.com/v1?key=***"
    assert shown["upstream"]["api_key"] == "***"
    assert shown["upstream"]["proxy_url"] == "http://***@egress.internal:3128"
    assert shown["cache"]["redis_url"] == "redis://***@redis.internal:6379/0"
    assert shown["quota"]["redis_url"] == ["redis://***@node1:6379", "node2:6379"]
    assert shown["auth"]["keys"][0]["key_sha256"] == "***"
    assert shown["auth"]["keys"][1]["key_env"] == "PROXY_KEY_TEAM_B"  # a name, not a secret
    assert "PROXY_ADMIN_TOKEN (set)" in err and "PROXY_KEY_TEAM_B (not set)" in err


def test_config_show_refuses_a_bad_config_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text("[server]\nprot = 1\n")
    code, out, err = run_cli(capsys, "config", "show", "--config", str(config))
    assert code == 2 and out == ""
    assert "unknown key server.prot (did you mean server.port?)" in err


async def test_the_start_up_line_says_what_is_active_and_no_secret(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEAM_A_KEY", "pk-team-SECRET")
    settings = load_settings(
        cli_overrides={
            "upstream": {"base_url": "http://upstream.test/v1", "api_key": "sk-up-SECRET"},
            "compaction": {"budget_tokens": 4321, "strategy": "structured"},
            "cache": {"backend": "memory"},
            "quota": {"backend": "memory"},
            "auth": {"keys": [{"id": "team-a", "key_env": "TEAM_A_KEY"}]},
            "admin": {"token_env": "PROXY_ADMIN_TOKEN"},
        }
    )
    load_offline_tokenizer()
    app = create_app(settings, transport=httpx.MockTransport(lambda r: httpx.Response(200)))
    caplog.set_level(logging.INFO, logger="proxy.app")
    async with app.router.lifespan_context(app):
        pass
    [line] = [r for r in caplog.records if r.getMessage().startswith("proxying to")]
    assert line.getMessage() == "proxying to http://upstream.test/v1"
    fields = {key: getattr(line, key, None) for key in (
        "budget_tokens", "strategy", "keys", "store", "quota", "upstream_api_key", "admin",
    )}  # fmt: skip
    assert fields == {
        "budget_tokens": 4321,
        "strategy": "structured",
        "keys": 1,
        "store": "memory",
        "quota": "memory",
        "upstream_api_key": "set",
        "admin": "on (PROXY_ADMIN_TOKEN)",
    }
    assert "SECRET" not in json.dumps(vars(line), default=str)


def test_the_start_up_fields_name_redis_without_its_password() -> None:
    from proxy.startup import startup_fields

    settings = load_settings(
        cli_overrides={
            "cache": {"backend": "redis", "redis_url": "redis://:pw-SECRET@redis:6379/0"},
            "quota": {"on_redis_error": "closed"},
        }
    )
    fields = startup_fields(settings)
    assert fields["store"] == "redis" and fields["quota"] == "redis"
    assert fields["store_url"] == fields["quota_url"] == "redis://***@redis:6379/0"
    assert fields["quota_on_redis_error"] == "closed"
    assert "SECRET" not in json.dumps(fields)
