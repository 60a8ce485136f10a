"""`compaction-proxy config show|example`: the resolved configuration, and the example file.

`show` prints what `serve` would run with (defaults < file < environment < flags) as JSON,
section by section, with every secret replaced: credentials (`api_key`, `proxy_url`'s
`user:password@`), key digests, passwords and query values in URLs. Env vars the
configuration names (`token_env`, `key_env`, ...) are listed on stderr as set or not set;
their values are never read into the output.

`example` prints the example configuration that ships in the package (the same text as
config/proxy.example.toml in a checkout), so an installed proxy can start from it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import resources
from typing import Any

from pydantic import SecretStr

from proxy.redact import MASK, redact_url
from proxy.serveflags import add_serve_flags, serve_overrides
from proxy.settings import Settings, load_settings, named_variables

EXAMPLE_NAME = "proxy.example.toml"
# Keys whose values are secret whatever they look like (a digest lets a weak key be guessed).
_SECRET_KEYS = frozenset({"key_sha256", "api_key", "password", "token"})


def register_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    config = subparsers.add_parser(
        "config",
        help="print the resolved configuration (secrets redacted) or the example file",
        description="Inspect the configuration without starting the proxy.",
    )
    actions = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = actions.add_parser(
        "show",
        help="print the configuration serve would use, as JSON, secrets redacted",
        description=(
            "Print the configuration `serve` would use with the same --config, environment "
            "and flags (defaults < file < COMPACTION_PROXY_* variables < flags), as JSON. "
            "Secrets are shown as ***; env vars the configuration names are listed on stderr."
        ),
    )
    add_serve_flags(show)  # the same flags as serve, meaning the same
    show.set_defaults(func=show_command)
    example = actions.add_parser(
        "example",
        help="print the example configuration (every key, its default, what it does)",
        description="Print the example configuration: compaction-proxy config example > proxy.toml",
    )
    example.set_defaults(func=example_command)


def show_command(args: argparse.Namespace) -> int:
    settings = load_settings(args.config, serve_overrides(args))
    print(json.dumps(redacted(settings), indent=2))
    named = sorted(named_variables([settings.model_dump()], {}))
    if named:
        state = ", ".join(f"{n} ({'set' if os.environ.get(n) else 'not set'})" for n in named)
        print(f"env vars the configuration names: {state}", file=sys.stderr)
    return 0


def example_command(args: argparse.Namespace) -> int:
    sys.stdout.write(example_text())
    return 0


def example_text() -> str:
    """The example configuration shipped in the package."""
    return resources.files("proxy").joinpath(EXAMPLE_NAME).read_text(encoding="utf-8")


def redacted(settings: Settings) -> dict[str, Any]:
    """The settings as plain JSON values with every secret masked."""
    dumped = settings.model_dump()
    result = _redact(dumped, None)
    assert isinstance(result, dict)
    return result


def _redact(value: Any, key: str | None) -> Any:
    if isinstance(value, dict):
        return {name: _redact(item, str(name)) for name, item in value.items()}
    if isinstance(value, list | tuple):
        return [_redact(item, key) for item in value]
    if isinstance(value, SecretStr):
        secret = value.get_secret_value()
        # A URL keeps what tells it apart (scheme, host, path); a plain secret keeps nothing.
        return redact_url(secret) if "://" in secret else MASK
    if value is not None and key is not None and key in _SECRET_KEYS:
        return MASK
    if isinstance(value, str) and "://" in value:
        return redact_url(value)
    return value
