"""Configuration: defaults < TOML file < COMPACTION_PROXY_<SECTION>__<KEY> env vars < CLI flags.

One pydantic model per TOML section, so a bad value fails at start with the key's dotted path.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)


class Section(BaseModel):
    """A config section: unknown keys are errors, so typos surface at start."""

    model_config = ConfigDict(extra="forbid")


class ServerSettings(Section):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    # A 1M-token prompt is ~4 MB of text; JSON escaping and base64 images can multiply that.
    max_body_bytes: int = Field(64 * 1024 * 1024, gt=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"


class UpstreamSettings(Section):
    base_url: str = "https://api.openai.com/v1"
    # When set, replaces the client's credential towards the upstream.
    api_key: SecretStr | None = None
    timeout_s: float = Field(600.0, gt=0)
    connect_timeout_s: float = Field(10.0, gt=0)
    max_connections: int = Field(1000, gt=0)
    max_keepalive_connections: int = Field(200, ge=0)
    keepalive_expiry_s: float = Field(30.0, gt=0)

    @field_validator("base_url")
    @classmethod
    def _check_base_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")


class TokenizerSettings(Section):
    # Where tiktoken's BPE files live; falls back to TIKTOKEN_CACHE_DIR, then tiktoken's default.
    cache_dir: str | None = None
    default_encoding: Literal["o200k_base", "cl100k_base"] = "o200k_base"
    # "fail": refuse to start without the BPE files; "estimate": count ~4 chars/token and say so.
    on_missing: Literal["fail", "estimate"] = "fail"
    remote_image_tokens: int = Field(765, ge=0)
    memo_max_entries: int = Field(200_000, gt=0)
    # Texts longer than this are tokenized in a worker thread, not on the event loop.
    offload_chars: int = Field(32_768, ge=0)
    threads: int = Field(2, gt=0)


class ModelSettings(Section):
    encoding: Literal["o200k_base", "cl100k_base"] | None = None


class SummarizerSettings(Section):
    # Defaults: the upstream's base URL, the request's own model and the client's own credential.
    base_url: str | None = None
    model: str | None = None
    api_key: SecretStr | None = None
    timeout_s: float = Field(120.0, gt=0)
    retries: int = Field(2, ge=0, le=10)
    backoff_base_s: float = Field(0.5, ge=0)
    breaker_failures: int = Field(5, gt=0)
    breaker_cooldown_s: float = Field(30.0, ge=0)
    # The summarizer's own context window; longer compaction input is folded in chunks.
    context_tokens: int = Field(100_000, gt=1000)
    # Each message fed to the summarizer keeps at most this many tokens (head + tail).
    max_message_tokens: int = Field(4_000, gt=16)


class CompactionModelSettings(Section):
    budget_tokens: int | None = Field(None, gt=0)


class CompactionSettings(Section):
    enabled: bool = True
    budget_tokens: int = Field(100_000, gt=0)
    max_preserved_messages: int = Field(2, ge=0)
    keep_last_user_message: bool = True
    summary_role: Literal["user", "system", "assistant"] = "user"
    summary_max_tokens: int = Field(2_000, gt=0)
    on_error: Literal["forward", "reject"] = "forward"
    custom_instruction: str = ""
    summarizer: SummarizerSettings = SummarizerSettings()
    models: dict[str, CompactionModelSettings] = {}

    def budget_for(self, model: str) -> int:
        override = self.models.get(model)
        if override is not None and override.budget_tokens is not None:
            return override.budget_tokens
        return self.budget_tokens


class CacheSettings(Section):
    backend: Literal["memory", "redis", "none"] = "memory"
    scope: Literal["credential", "global"] = "credential"
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "compaction-proxy:"
    ttl_s: int = Field(7 * 24 * 3600, gt=0)
    max_bytes: int = Field(64 * 1024 * 1024, gt=0)
    lock_ttl_s: float = Field(180.0, gt=0)


class Settings(BaseSettings):
    """The whole configuration. Build with `load_settings()`; tests may construct it directly."""

    model_config = SettingsConfigDict(
        env_prefix="COMPACTION_PROXY_",
        env_nested_delimiter="__",
        extra="forbid",
    )

    server: ServerSettings = ServerSettings()
    upstream: UpstreamSettings = UpstreamSettings()
    tokenizer: TokenizerSettings = TokenizerSettings()
    models: dict[str, ModelSettings] = {}
    compaction: CompactionSettings = CompactionSettings()
    cache: CacheSettings = CacheSettings()


class ConfigError(Exception):
    """A configuration problem, worded for one line on stderr."""


def format_validation_error(error: ValidationError, origin: str) -> str:
    first = error.errors()[0]
    key = ".".join(str(part) for part in first["loc"]) or "(root)"
    return f"invalid config {origin}: {key}: {first['msg']} (got {first.get('input')!r})"


def load_settings(
    config_file: str | Path | None = None, cli_overrides: dict[str, Any] | None = None
) -> Settings:
    """Defaults < TOML file < environment < CLI flags. Raises ConfigError with one clear line."""
    origin = "(from defaults and environment)"
    toml_data: dict[str, Any] = {}
    if config_file is not None:
        path = Path(config_file)
        origin = f"(from {path} and environment)"
        try:
            toml_data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None

    class _FromFile(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, InitSettingsSource(settings_cls, toml_data))

    try:
        loaded = _FromFile(**(cli_overrides or {}))
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, origin)) from None
    return Settings.model_construct(**dict(loaded))
