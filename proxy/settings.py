"""Configuration: defaults < TOML file < COMPACTION_PROXY_<SECTION>__<KEY> env vars < CLI flags.

One pydantic model per TOML section, so a bad value fails at start with the key's dotted path.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import difflib
import json
import os
import re
import tomllib
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from proxy.compaction.chat_format import DEFAULT_INJECTED
from proxy.redact import has_userinfo, redact_url


class Section(BaseModel):
    """A config section: unknown keys are errors, so typos surface at start."""

    model_config = ConfigDict(extra="forbid")


class ServerSettings(Section):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    # A 1M-token prompt is ~4 MB of text; JSON escaping and base64 images can multiply that.
    max_body_bytes: int = Field(64 * 1024 * 1024, gt=0)
    # Messages per chat request (400 over it). A 1M-token window filled with 20-token messages
    # is 50k; long agent sessions send a few thousand. 50k costs ~0.4 s of CPU to parse and count.
    max_messages: int = Field(50_000, gt=0)
    # Slow clients (see proxy/connections.py): whole headers within header_timeout_s, no gap
    # over body_timeout_s in a body (408), at most max_connections open (503 on accept).
    # Agents send headers in one packet; 30 s covers a stalled mobile link, not a stalled peer.
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    max_connections: int = Field(2048, gt=0)
    # A request's head (request line and headers) larger than this is refused with 431 before
    # it is parsed (see proxy/connections.py). OpenAI clients send ~1 KB; JWTs and cookies
    # fit many times over. h11 allows 16 KB, nginx 8 KB per line and 32 KB in all.
    max_header_bytes: int = Field(32 * 1024, ge=1024, le=1024 * 1024)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # "json": one JSON object per line (ours and uvicorn's alike), for log shippers.
    log_format: Literal["text", "json"] = "text"
    # How long /readyz keeps each dependency's answer (one probe per period, however polled).
    readiness_cache_s: float = Field(5.0, ge=0)
    # /readyz answers 503 only for a hard dependency (the upstream; the quota store when it
    # fails closed); a soft one (the summary store, a fail-open quota store) that is down is
    # reported with status "degraded" and a 200. true: every dependency is hard.
    readiness_strict: bool = False
    # At start, run the /readyz checks once (kept like any /readyz answer): the upstream probe
    # leaves a pooled connection open, so the first request does not open one. The start waits
    # for it at most this many seconds (then it goes on in the background); 0: no start probe.
    warm_probe_s: float = Field(0.0, ge=0, le=10)
    # No longer used (the upstream client opens a connection only for a request; see
    # warm_probe_s): still accepted, so existing configurations load.
    warm_connect_s: float = Field(1.0, ge=0, le=10)
    # Worker processes (uvicorn workers sharing the port). Each has its own memory store and
    # circuit breaker; cache.backend = "redis" shares summaries between them.
    workers: int = Field(1, ge=1, le=256)
    # On SIGTERM/SIGINT: stop accepting, let requests in flight (streams included) finish for
    # up to this many seconds, then close what is left.
    drain_timeout_s: float = Field(30.0, ge=0)
    # Name of the env var holding a token /metrics then asks for (Authorization: Bearer
    # <token>); unset: /metrics answers anyone who can connect.
    metrics_token_env: str | None = None


class UpstreamSettings(Section):
    base_url: str = "https://api.openai.com/v1"
    # When set, replaces the client's credential towards the upstream.
    api_key: SecretStr | None = None
    timeout_s: float = Field(600.0, gt=0)
    connect_timeout_s: float = Field(10.0, gt=0)
    max_connections: int = Field(1000, gt=0)
    max_keepalive_connections: int = Field(200, ge=0)
    keepalive_expiry_s: float = Field(30.0, gt=0)
    # An egress proxy for every upstream request (http://, https://, socks5://, socks5h://;
    # `user:password@` allowed, never printed). Unset: HTTP(S)_PROXY / ALL_PROXY / NO_PROXY
    # from the environment, as httpx reads them, unless proxy_from_env is false.
    proxy_url: SecretStr | None = None
    proxy_from_env: bool = True

    @field_validator("base_url")
    @classmethod
    def _check_base_url(cls, value: str) -> str:
        return check_base_url(value)

    @field_validator("proxy_url")
    @classmethod
    def _check_proxy_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().startswith(_PROXY_SCHEMES):
            raise ValueError("must start with http://, https://, socks5:// or socks5h://")
        return value


_PROXY_SCHEMES = ("http://", "https://", "socks5://", "socks5h://")


def check_base_url(value: str) -> str:
    """An upstream URL: http(s), and no `user:password@` (it would be printed in logs, and
    collide with the client's Authorization header)."""
    if not value.startswith(("http://", "https://")):
        raise ValueError("must start with http:// or https://")
    if has_userinfo(value):
        raise ValueError(
            "must not contain user:password@ (put the credential in upstream.api_key, or "
            "compaction.summarizer.api_key)"
        )
    return value.rstrip("/")


class TokenizerSettings(Section):
    # Where tiktoken's BPE files live; falls back to TIKTOKEN_CACHE_DIR, then tiktoken's default.
    cache_dir: str | None = None
    default_encoding: Literal["o200k_base", "cl100k_base"] = "o200k_base"
    # Encodings built at start; any other is built the first time a model needs it (in a
    # worker thread, ~0.1-0.3 s), its file only checked at start. Each costs ~20-40 MB of RSS.
    # Unset: default_encoding, the [models] overrides' and the summarizer model's encodings.
    preload: list[Literal["o200k_base", "cl100k_base"]] | None = None
    # "fail": refuse to start without the BPE files; "estimate": count ~4 chars/token and say so.
    on_missing: Literal["fail", "estimate"] = "fail"
    remote_image_tokens: int = Field(765, ge=0)
    # Token counts remembered (per message, per long text, per history prefix): a fixed table
    # of 16 bytes an entry, allocated at start (3.2 MB at the default).
    memo_max_entries: int = Field(200_000, ge=2)
    # Texts longer than this are tokenized in a worker thread, not on the event loop.
    offload_chars: int = Field(32_768, ge=0)
    # A request's count stops past this many prompt tokens and it is refused (400
    # context_length_exceeded): above every model's window (1M-2M), and ~0.3 s of tokenizing.
    max_request_tokens: int = Field(2_000_000, gt=0)
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
    # The API the summarizer is called on: "chat" (POST {base_url}/chat/completions) or
    # "responses" (POST {base_url}/responses, for upstreams that serve only that).
    api: Literal["chat", "responses"] = "chat"

    @field_validator("base_url")
    @classmethod
    def _check_base_url(cls, value: str | None) -> str | None:
        return None if value is None else check_base_url(value)


class CompactionModelSettings(Section):
    budget_tokens: int | None = Field(None, gt=0)


class MaskSettings(Section):
    # Tool results older than the last `keep_last` are replaced by a stub...
    keep_last: int = Field(5, ge=0)
    # ...in steps that each clear at least this many tokens (the prompt stays the same, and
    # the upstream's prompt cache valid, between steps).
    clear_at_least: int = Field(4_000, ge=0)
    # Tools whose results are never masked.
    exclude_tools: list[str] = []


class CompactionSettings(Section):
    enabled: bool = True
    budget_tokens: int = Field(100_000, gt=0)
    # "simple" | "structured" | "mask" | "hybrid" | "package.module:Name", or a list of them
    # applied in order while still over budget (see proxy/compaction/strategies.py).
    strategy: str | list[str] = "hybrid"
    # A `compact` strategy's fingerprint, by its name in `strategy` (else derived).
    fingerprints: dict[str, str] = {}
    mask: MaskSettings = MaskSettings()
    max_preserved_messages: int = Field(2, ge=0)
    # Share of the budget kept as recent messages verbatim after a compaction, of what
    # remains after the tools, the pinned messages, the task and the summary reserve (at
    # least max_preserved_messages of them); 0: only the max_preserved_messages (the
    # reference).
    keep_recent_ratio: float = Field(0.3, ge=0, lt=1)
    keep_last_user_message: bool = True
    # The first user message (the task) stays verbatim after the pinned messages...
    protect_task: bool = True
    # ...unless it alone is larger than this: then it is summarized like the rest.
    task_max_tokens: int = Field(4_000, gt=0)
    # With keep_last_user_message, older user messages (asks) a summary covers are forwarded
    # verbatim after it too, newest first, while all the carried asks total at most this
    # many tokens and a tenth of the budget (the latest is always carried); 0: only the latest.
    user_messages_max_tokens: int = Field(4_000, ge=0)
    # User messages an agent injects itself (not asks): never carried as "the latest ask".
    injected_user_patterns: list[str] = list(DEFAULT_INJECTED)
    summary_role: Literal["user", "system", "assistant"] = "user"
    summary_max_tokens: int = Field(2_000, gt=0)
    on_error: Literal["forward", "reject"] = "forward"
    custom_instruction: str = ""
    # Summaries made ahead of need (proxy/preparer.py): a request forwarded with at least this
    # share of its budget starts, in the background, the summary the compaction at the
    # budget will want; "off" never does.
    prepare_at: float | Literal["off"] = 0.8
    # ...for requests without a proxy key too (their summaries are billed to no key).
    prepare_keyless: bool = False
    # Preparations running at once per process; one more is dropped (never queued).
    prepare_max_concurrent: int = Field(16, gt=0)
    summarizer: SummarizerSettings = SummarizerSettings()
    models: dict[str, CompactionModelSettings] = {}

    @field_validator("strategy")
    @classmethod
    def _check_strategy(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not value:
            raise ValueError("give at least one strategy")
        return value

    @field_validator("prepare_at")
    @classmethod
    def _check_prepare_at(cls, value: float | str) -> float | str:
        if value != "off" and not 0 < float(value) < 1:
            raise ValueError("a share of the budget between 0 and 1 (e.g. 0.8), or 'off'")
        return value

    @field_validator("injected_user_patterns")
    @classmethod
    def _check_patterns(cls, value: list[str]) -> list[str]:
        for pattern in value:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {pattern!r} ({exc})") from None
        return value

    @property
    def prepare_share(self) -> float | None:
        """`prepare_at` as a number (None: off)."""
        return None if self.prepare_at == "off" else float(self.prepare_at)

    def budget_for(self, model: str) -> int:
        override = self.models.get(model)
        if override is not None and override.budget_tokens is not None:
            return override.budget_tokens
        return self.budget_tokens


class CacheSettings(Section):
    backend: Literal["memory", "redis", "none"] = "memory"
    scope: Literal["credential", "global"] = "credential"
    # Requests without a credential: "none" keeps their summaries out of the store (a shared
    # scope would let one key-less client learn what another sent); "shared" pools them.
    anonymous: Literal["none", "shared"] = "none"
    # A redis:// URL, a redis+cluster:// URL, or a list of cluster nodes (host:port or URLs).
    redis_url: str | list[str] = "redis://127.0.0.1:6379/0"
    key_prefix: str = "compaction-proxy:"
    ttl_s: int = Field(7 * 24 * 3600, gt=0)
    max_bytes: int = Field(64 * 1024 * 1024, gt=0)
    lock_ttl_s: float = Field(180.0, gt=0)
    # Recent chat bodies' parsed state (proxy/turnmemo.py), per scope, so a turn that resends
    # a history parses only its new messages; bytes held at most (0: off).
    turn_memo_bytes: int = Field(32 * 1024 * 1024, ge=0)


ENV_PREFIX = "COMPACTION_PROXY_"
KEY_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,63}$"


class LimitSettings(Section):
    """Quotas (unset: unlimited), of a key or of a team (then shared by all its keys)."""

    requests_per_minute: int | None = Field(None, gt=0)
    prompt_tokens_per_minute: int | None = Field(None, gt=0)
    prompt_tokens_per_day: int | None = Field(None, gt=0)
    spend_usd_per_day: float | None = Field(None, gt=0)
    spend_usd_per_month: float | None = Field(None, gt=0)


class PolicySettings(LimitSettings):
    """What a key may do: everything about a key but its material."""

    # The team the key belongs to: the team's quotas apply to all its keys together, and
    # usage and metrics carry it.
    team: str | None = Field(None, pattern=KEY_ID_PATTERN)
    # Env var holding this key's own upstream credential (else upstream.api_key).
    upstream_api_key_env: str | None = None
    allowed_models: list[str] = ["*"]
    budget_tokens: int | None = Field(None, gt=0)
    mode: Literal["auto", "off", "force"] | None = None
    strategy: str | None = None
    # The audit trail for this key's requests: true/false overrides [audit] enabled.
    audit: bool | None = None
    # Summaries made ahead of need for this key (when compaction.prepare_at is on).
    prepare: bool = True


class KeySettings(PolicySettings):
    """One proxy key: who it is, what it may use, how it is compacted, how much it may spend.

    Two entries with the same `id` and the same policy are one key with two secrets (a
    rotation: old and new overlap until the old entry goes, or `expires_at` passes)."""

    id: str = Field(pattern=KEY_ID_PATTERN)
    # The key itself: its sha256 hex digest, or the name of an env var holding it.
    key_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")
    key_env: str | None = None
    # After this moment (ISO 8601; UTC unless it says) the key is refused.
    expires_at: dt.datetime | None = None

    @model_validator(mode="after")
    def _one_key_source(self) -> KeySettings:
        if (self.key_sha256 is None) == (self.key_env is None):
            raise ValueError("set exactly one of key_sha256 and key_env")
        return self


class AuthSettings(Section):
    keys: list[KeySettings] = []
    # TOML or JSON file with more keys (same fields), re-read on change or SIGHUP.
    keys_file: str | None = None
    # How often the keys file's mtime is checked (seconds).
    reload_interval_s: float = Field(1.0, gt=0)
    # Serve a non-loopback address with upstream.api_key set and no keys (anyone may spend).
    allow_anonymous: bool = False
    # Team quotas, by team name (`team = "..."` on keys): shared by all the team's keys.
    teams: dict[str, LimitSettings] = {}
    # The key lifecycle API (POST /admin/keys ...): keys made through it live in Redis when
    # the quota backend is Redis, else in api_keys_file. On: every /v1 request needs a key.
    api_keys: bool = False
    # Where API-made keys live without Redis: a JSON file the proxy owns (hashes only).
    api_keys_file: str | None = None

    @field_validator("teams")
    @classmethod
    def _check_team_names(cls, value: dict[str, LimitSettings]) -> dict[str, LimitSettings]:
        for name in value:
            if re.match(KEY_ID_PATTERN, name) is None:
                raise ValueError(f"team name {name!r}: letters, digits and _.:@- only")
        return value


class AdminSettings(Section):
    # Name of the env var holding the admin token for /admin/*; unset: admin routes answer 401.
    token_env: str | None = None


class QuotaSettings(Section):
    # Where quota counters and usage live: "auto" = redis when cache.backend = "redis".
    backend: Literal["auto", "memory", "redis"] = "auto"
    # A redis:// URL, a redis+cluster:// URL, or a list of cluster nodes (host:port or URLs).
    # Unset: cache.redis_url.
    redis_url: str | list[str] | None = None
    key_prefix: str = Field("compaction-proxy:", pattern=r"^[^{}]*$")
    # Redis unreachable: "open" lets requests through unmetered, "closed" answers 503.
    on_redis_error: Literal["open", "closed"] = "open"
    socket_timeout_s: float = Field(0.25, gt=0)
    # Days of per-key usage kept.
    usage_retention_days: int = Field(400, gt=0)
    # Ask the upstream for stream_options.include_usage (and hide it again) to count streams.
    request_stream_usage: bool = True
    # Spend caps reserve each request's price before it goes upstream: its prompt, plus at
    # most this many completion tokens when the request sets no max_completion_tokens /
    # max_tokens / max_output_tokens. Settled with the upstream's usage when it ends.
    reserve_completion_tokens: int = Field(4096, ge=0)


class AuditSettings(Section):
    """The audit trail of compactions (proxy/audit): off unless enabled here or per key."""

    enabled: bool = False
    # Share of sessions recorded (decided per session, by its first messages, so a sampled
    # session is recorded whole).
    sample_rate: float = Field(1.0, ge=0, le=1)
    # "jsonl:DIR" (files in DIR) or "redis" (a stream at redis_url, key `stream_key`).
    sink: str = "jsonl:audit"
    # Also record requests that were not compacted (for `audit export` of whole sessions).
    record_passthrough: bool = False
    # Records waiting for the writer; past this, new ones are dropped (and counted).
    queue_size: int = Field(1000, gt=0)
    # jsonl: a file is closed past max_file_bytes; the oldest go past max_files.
    max_file_bytes: int = Field(64 * 1024 * 1024, gt=0)
    max_files: int = Field(20, gt=0)
    # redis: the stream keeps about max_len records, none older than ttl_s. Unset
    # redis_url: cache.redis_url.
    redis_url: str | None = None
    stream_key: str = "compaction-proxy:audit"
    max_len: int = Field(10_000, gt=0)
    ttl_s: int = Field(7 * 24 * 3600, gt=0)

    @field_validator("sink")
    @classmethod
    def _check_sink(cls, value: str) -> str:
        if value != "redis" and not (value.startswith("jsonl:") and value[6:].strip()):
            raise ValueError('expected "jsonl:DIR" or "redis"')
        return value


class PriceSettings(Section):
    """USD per 1M tokens."""

    input: float = Field(ge=0)
    cached_input: float | None = Field(None, ge=0)
    output: float = Field(ge=0)


class Settings(BaseSettings):
    """The whole configuration. Build with `load_settings()`; tests may construct it directly."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
    )

    server: ServerSettings = ServerSettings()
    upstream: UpstreamSettings = UpstreamSettings()
    tokenizer: TokenizerSettings = TokenizerSettings()
    models: dict[str, ModelSettings] = {}
    compaction: CompactionSettings = CompactionSettings()
    cache: CacheSettings = CacheSettings()
    auth: AuthSettings = AuthSettings()
    admin: AdminSettings = AdminSettings()
    quota: QuotaSettings = QuotaSettings()
    audit: AuditSettings = AuditSettings()
    # USD per 1M tokens by model glob; entries here override the shipped defaults (pricing.py).
    pricing: dict[str, PriceSettings] = {}


# Where `serve --workers N` leaves the resolved settings for its worker processes: in their
# environment (private to the user), never on a command line. Outside ENV_PREFIX on purpose.
WORKER_SETTINGS_ENV = "_COMPACTION_PROXY_WORKER_SETTINGS"


def settings_json(settings: Settings) -> str:
    """The settings as JSON with secrets in clear, for `settings_from_json` in a worker."""

    def reveal(value: object) -> object:
        if isinstance(value, SecretStr):
            return value.get_secret_value()
        raise TypeError(f"cannot serialize {type(value).__name__}")

    return json.dumps(settings.model_dump(), default=reveal)


def settings_from_json(text: str) -> Settings:
    return Settings.model_validate(json.loads(text))


class ConfigError(Exception):
    """A configuration problem, worded for one line on stderr."""


def format_validation_error(
    error: ValidationError, origin: str, environ: Mapping[str, str] | None = None
) -> str:
    """The first problem, one line: which key (or env var), what is wrong, what was given."""
    problems = error.errors()
    first = problems[0]
    loc = [str(part) for part in first["loc"]]
    key = ".".join(loc) or "(root)"
    variable = _env_name_for(loc, os.environ if environ is None else environ)
    where = f"{key} (from {variable})" if variable else key
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    if first["type"] == "extra_forbidden":
        return f"invalid config {origin}: unknown key {where}{_did_you_mean(loc)}{more}"
    given = _shown(loc, first.get("input"))
    return f"invalid config {origin}: {where}: {first['msg']}{given}{more}"


def _shown(loc: Sequence[str], value: object) -> str:
    """` (got 'x')` for a plain value; nothing for sections or anything that may be a secret."""
    if not isinstance(value, str | int | float) or any(
        word in part for part in loc for word in ("key", "token", "secret", "password")
    ):
        return ""
    if isinstance(value, str) and "://" in value:
        value = redact_url(value)
    text = repr(value)
    return f" (got {text[:80]}{'...' if len(text) > 80 else ''})"


def _fields_at(path: Sequence[str]) -> dict[str, Any] | None:
    """The fields of the section at `path` (free-form keys of a dict skipped), or None."""
    model: Any = Settings
    index = 0
    while index < len(path):
        fields = model.model_fields
        if path[index] not in fields:
            return None
        model, free_key = _section_type(fields[path[index]].annotation)
        if model is None:
            return None
        index += 2 if free_key else 1
    return dict(model.model_fields)


def _section_type(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """(the section model a field holds, whether a free-form key comes first: dict[str, M])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    if typing.get_origin(annotation) is dict:
        value = typing.get_args(annotation)[1]
        if isinstance(value, type) and issubclass(value, BaseModel):
            return value, True
    return None, False


def _is_structured(annotation: Any) -> bool:
    """A section, a dict or a list: set from an env var as JSON. A union that also takes a
    plain value (`str | list[str]`) takes the variable as text when it is not JSON."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return all(_is_structured(arg) for arg in args)
    if origin in (dict, list):
        return True
    return isinstance(annotation, type) and issubclass(annotation, (BaseModel, dict, list))


def _did_you_mean(loc: Sequence[str]) -> str:
    fields = _fields_at(loc[:-1])
    if not fields or not loc:
        return ""
    close = difflib.get_close_matches(loc[-1], list(fields), n=1)
    return f" (did you mean {'.'.join([*loc[:-1], close[0]])}?)" if close else ""


def _env_name_for(loc: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The env var that set `loc` (or a section holding it, set as JSON)."""
    for depth in range(len(loc), 0, -1):
        wanted = ENV_PREFIX + "__".join(loc[:depth]).upper()
        for name in environ:
            if name.upper() == wanted:
                return name
    return None


def check_environment(environ: Mapping[str, str], named: Collection[str] = ()) -> None:
    """Every COMPACTION_PROXY_* variable must name a key, and a structured one hold JSON.

    pydantic-settings skips variables that match no field, so without this a misspelt section
    (`COMPACTION_PROXY_SERVR__PORT`) would be silently ignored. A variable the configuration
    names as holding a secret (`named`: `admin.token_env = "COMPACTION_PROXY_ADMIN_TOKEN"`)
    is no typo, and is let be.
    """
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX) or name in named:
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        model: Any = Settings
        index = 0
        while True:
            fields = model.model_fields
            part = path[index]
            if part not in fields:
                close = difflib.get_close_matches(part, list(fields), n=1)
                hint = ""
                if close:
                    parts = name[len(ENV_PREFIX) :].split("__")
                    suggestion = "__".join([*parts[:index], close[0].upper()])
                    hint = f" (did you mean {ENV_PREFIX}{suggestion}?)"
                raise ConfigError(
                    f"invalid config: environment variable {name}: unknown key "
                    f"{'.'.join(path[: index + 1])}{hint}"
                )
            annotation = fields[part].annotation
            section, free_key = _section_type(annotation)
            index += 1
            if free_key:
                index += 1  # a free-form name (a model's), then its section's keys
            if index >= len(path):
                if (_is_structured(annotation) and not free_key) or index > len(path):
                    _check_json(name, environ[name])
                break
            if section is None:
                raise ConfigError(
                    f"invalid config: environment variable {name}: "
                    f"{'.'.join(path[:index])} is a value, not a section"
                )
            model = section


def named_variables(sources: Sequence[object], environ: Mapping[str, str]) -> set[str]:
    """Names of env vars the configuration says hold something (`*_env` keys: token_env,
    key_env, upstream_api_key_env), from the file's and the flags' data and from
    COMPACTION_PROXY_* variables (`..._ENV` ones, and sections given as JSON)."""
    found: set[str] = set()

    def walk(value: object) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                if isinstance(key, str) and key.endswith("_env") and isinstance(item, str):
                    found.add(item)
                else:
                    walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    for source in sources:
        walk(source)
    for name, value in environ.items():
        if not name.upper().startswith(ENV_PREFIX):
            continue
        if name.upper().endswith("_ENV"):
            found.add(value)
        elif value.lstrip().startswith(("{", "[")):
            with contextlib.suppress(ValueError):  # check_environment says what is wrong
                walk(json.loads(value))
    return found


def _check_json(name: str, value: str) -> None:
    try:
        json.loads(value)
    except ValueError as exc:
        raise ConfigError(
            f"invalid config: environment variable {name}: not valid JSON ({exc})"
        ) from None


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

    check_environment(os.environ, named_variables([toml_data, cli_overrides], os.environ))
    try:
        loaded = _FromFile(**(cli_overrides or {}))
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, origin)) from None
    except SettingsError as exc:  # anything the environment check above did not foresee
        raise ConfigError(f"invalid config {origin}: {exc}") from None
    return Settings.model_construct(**dict(loaded))
