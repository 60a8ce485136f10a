"""Configuration: file < environment < CLI, one clear line for a bad key, the example file valid."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import build_parser, main
from proxy.serveflags import serve_overrides
from proxy.settings import ConfigError, Settings, load_settings

EXAMPLE = Path(__file__).resolve().parents[1] / "config" / "proxy.example.toml"


def test_example_config_is_valid_and_equals_the_defaults() -> None:
    loaded = load_settings(EXAMPLE)
    assert loaded == Settings()
    # Every section and key of the model appears in the example file.
    data = tomllib.loads(EXAMPLE.read_text())
    for section in ("server", "upstream", "tokenizer", "compaction", "cache", "auth", "quota"):
        assert section in data


def test_example_documents_every_key() -> None:
    text = EXAMPLE.read_text()
    settings = Settings()
    sections = (
        *("server", "upstream", "tokenizer", "compaction", "cache", "auth", "admin", "quota"),
        "audit",
    )
    for section in sections:
        for key in type(getattr(settings, section)).model_fields:
            if key in ("models", "summarizer", "mask"):
                continue
            assert f"{key} =" in text, f"{section}.{key} missing from the example config"
    for sub in ("summarizer", "mask"):
        assert f"[compaction.{sub}]" in text
        for key in type(getattr(settings.compaction, sub)).model_fields:
            assert f"{key} =" in text, f"compaction.{sub}.{key} missing"


def test_precedence_file_env_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text(
        '[upstream]\nbase_url = "http://file/v1"\ntimeout_s = 5\n'
        "[server]\nport = 9000\n"
        '[compaction.models."gpt-4o-mini"]\nbudget_tokens = 500\n'
    )
    monkeypatch.setenv("COMPACTION_PROXY_UPSTREAM__TIMEOUT_S", "7")
    monkeypatch.setenv("COMPACTION_PROXY_SERVER__PORT", "9001")
    settings = load_settings(config, {"server": {"port": 9002}})
    assert settings.upstream.base_url == "http://file/v1"
    assert settings.upstream.timeout_s == 7
    assert settings.server.port == 9002
    assert settings.compaction.budget_for("gpt-4o-mini") == 500
    assert settings.compaction.budget_for("gpt-4o") == 100_000


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[server]\nport = -1\n", "server.port"),
        ('[upstream]\nbase_url = "ftp://x"\n', "upstream.base_url"),
        ('[compaction]\non_error = "explode"\n', "compaction.on_error"),
        ("[compaction]\nbudget_tokenz = 5\n", "compaction.budget_tokenz"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, toml: str, key: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_settings(config)
    assert key in str(info.value)
    assert "\n" not in str(info.value)


def test_cli_flags_map_to_settings() -> None:
    args = build_parser().parse_args(
        ["serve", "--upstream", "http://u/v1", "--port", "1234", "--host", "0.0.0.0"]
    )
    assert serve_overrides(args) == {
        "server": {"host": "0.0.0.0", "port": 1234},
        "upstream": {"base_url": "http://u/v1"},
    }


def test_serve_with_bad_config_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[upstream]\ntimeout_s = 'soon'\n")
    result = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "upstream.timeout_s" in lines[0]
    assert "Traceback" not in result.stderr


def test_help_documents_configuration() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    assert "COMPACTION_PROXY_" in result.stdout
    assert "--upstream" in result.stdout


@pytest.mark.parametrize(
    ("env", "toml", "expected"),
    [
        # Bad JSON in an env var for a section or a dict: named, no traceback.
        (
            {"COMPACTION_PROXY_COMPACTION__MODELS": "not json"},
            None,
            "environment variable COMPACTION_PROXY_COMPACTION__MODELS: not valid JSON",
        ),
        # A misspelt section or key in an env var: named, with the close match.
        (
            {"COMPACTION_PROXY_SERVR__PORT": "5"},
            None,
            "COMPACTION_PROXY_SERVR__PORT: unknown key servr "
            "(did you mean COMPACTION_PROXY_SERVER?)",
        ),
        (
            {"COMPACTION_PROXY_SERVER__PROT": "5"},
            None,
            "unknown key server.prot (did you mean COMPACTION_PROXY_SERVER__PORT?)",
        ),
        ({"COMPACTION_PROXY_NOTHING_LIKE_IT": "1"}, None, "unknown key nothing_like_it"),
        # A bad value in an env var: the key and the variable it came from.
        (
            {"COMPACTION_PROXY_SERVER__PORT": "eighty"},
            None,
            "server.port (from COMPACTION_PROXY_SERVER__PORT): Input should be a valid integer",
        ),
        # An unknown section or key in the TOML file.
        (
            {},
            "[servr]\nport = 5\n",
            "unknown key servr (did you mean server?)",
        ),
        (
            {},
            "[compaction.summarizer]\nmodle = 'x'\n",
            "unknown key compaction.summarizer.modle (did you mean compaction.summarizer.model?)",
        ),
        ({}, "[server]\nport = 'x'\n", "server.port: Input should be a valid integer"),
    ],
)
def test_every_config_error_is_one_line_and_exit_2(
    preserved_logging: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: dict[str, str],
    toml: str | None,
    expected: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = ["serve"]
    if toml is not None:
        config = tmp_path / "proxy.toml"
        config.write_text(toml)
        argv += ["--config", str(config)]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("compaction-proxy: error: invalid config")
    assert expected in lines[0]
    assert captured.out == ""


def test_config_errors_never_echo_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPACTION_PROXY_UPSTREAM", '{"api_key": "sk-live-123", "timeout_s": [1]')
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "sk-live-123" not in str(info.value)
    monkeypatch.setenv("COMPACTION_PROXY_UPSTREAM", '{"api_key": ["sk-live-123"]}')
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "upstream.api_key" in str(info.value) and "sk-live-123" not in str(info.value)


def test_serve_hands_workers_their_settings_through_the_environment(
    monkeypatch: pytest.MonkeyPatch, preserved_logging: None
) -> None:
    import uvicorn

    from proxy.settings import WORKER_SETTINGS_ENV, settings_from_json

    seen: dict[str, Any] = {}

    def run(app: object, **options: Any) -> None:
        directory = os.environ["PROMETHEUS_MULTIPROC_DIR"]
        seen.update(
            app=app,
            options=options,
            settings=settings_from_json(os.environ[WORKER_SETTINGS_ENV]),
            metrics_dir=directory,
            metrics_dir_existed=os.path.isdir(directory),
        )

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setattr(uvicorn, "run", run)
    monkeypatch.setenv("COMPACTION_PROXY_UPSTREAM__API_KEY", "sk-upstream-secret")
    monkeypatch.setenv("COMPACTION_PROXY_SERVER__DRAIN_TIMEOUT_S", "7.5")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--workers", "3", "--port", "9123"])
    assert exit_info.value.code == 0
    assert seen["app"] == "proxy.app:create_worker_app"
    options = seen["options"]
    assert options["factory"] is True and options["workers"] == 3
    assert options["timeout_graceful_shutdown"] == 7.5
    assert options["port"] == 9123
    assert "sk-upstream-secret" not in repr(options)  # never on a command line
    settings = seen["settings"]
    assert settings.upstream.api_key.get_secret_value() == "sk-upstream-secret"
    assert settings.server.workers == 3 and settings.server.port == 9123
    assert seen["metrics_dir_existed"]
    # Gone once the server has stopped.
    assert not os.path.exists(seen["metrics_dir"])
    assert WORKER_SETTINGS_ENV not in os.environ
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ


def test_one_worker_serves_in_process_with_the_drain_timeout(
    monkeypatch: pytest.MonkeyPatch, preserved_logging: None
) -> None:
    import uvicorn
    from starlette.applications import Starlette

    seen: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: seen.update(app=app, **options))
    with pytest.raises(SystemExit):
        main(["serve", "--log-format", "json"])
    assert isinstance(seen["app"], Starlette)
    assert seen["timeout_graceful_shutdown"] == 30.0
    assert "workers" not in seen and seen["access_log"] is False
    formatter = seen["log_config"]["formatters"]["proxy"]
    assert formatter["log_format"] == "json"


def test_a_key_taking_text_or_a_list_reads_text_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COMPACTION_PROXY_CACHE__REDIS_URL", "redis://redis:6379/0")
    assert load_settings().cache.redis_url == "redis://redis:6379/0"
    monkeypatch.setenv("COMPACTION_PROXY_CACHE__REDIS_URL", '["redis://a:1", "redis://b:2"]')
    assert load_settings().cache.redis_url == ["redis://a:1", "redis://b:2"]
    monkeypatch.setenv("COMPACTION_PROXY_UPSTREAM__API_KEY", "sk-not-json")  # SecretStr | None
    assert load_settings().upstream.api_key is not None
