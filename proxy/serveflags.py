"""The flags `serve` takes over the configuration, shared with `config show`, which prints
what `serve` would run with the same flags."""

from __future__ import annotations

import argparse
from typing import Any


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """--config and the settings a flag may override (flags win over file and environment)."""
    parser.add_argument("--config", metavar="PATH", help="TOML config file")
    parser.add_argument(
        "--upstream",
        metavar="URL",
        help="upstream base URL (upstream.base_url), e.g. https://api.openai.com/v1",
    )
    parser.add_argument("--host", help="address to bind (server.host, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to bind (server.port, default 8080)")
    parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="server.log_level (default info)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="server.workers: processes sharing the port (default 1; see README)",
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="server.log_format: text lines or one JSON object per line (default text)",
    )


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the flags given override, as a nested dict for load_settings."""
    overrides: dict[str, Any] = {}
    server = {
        key: value
        for key, value in (
            ("host", args.host),
            ("port", args.port),
            ("log_level", args.log_level),
            ("log_format", args.log_format),
            ("workers", args.workers),
        )
        if value is not None
    }
    if server:
        overrides["server"] = server
    if args.upstream is not None:
        overrides["upstream"] = {"base_url": args.upstream}
    return overrides
