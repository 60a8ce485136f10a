"""`compaction-proxy`: serve the proxy, count tokens, fetch tokenizer files, replay sessions,
read the audit trail."""

from __future__ import annotations

import argparse
import contextlib
import logging.config
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from proxy import __version__
from proxy.serveflags import add_serve_flags, serve_overrides
from proxy.settings import ConfigError, Settings, load_settings

SERVE_HELP = """\
Start the proxy. Configuration comes from, lowest to highest precedence: built-in defaults,
the TOML file given with --config (see config/proxy.example.toml for every key), environment
variables COMPACTION_PROXY_<SECTION>__<KEY> (e.g. COMPACTION_PROXY_UPSTREAM__BASE_URL,
COMPACTION_PROXY_COMPACTION__BUDGET_TOKENS), and the flags below.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compaction-proxy",
        description="OpenAI-compatible reverse proxy that compacts long chat histories.",
    )
    parser.add_argument("--version", action="version", version=f"compaction-proxy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the proxy",
        description=SERVE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_flags(serve)
    serve.set_defaults(func=serve_command)

    from proxy.tokens import register_commands

    register_commands(commands)
    from proxy.usage.command import register_commands as register_usage

    register_usage(commands)
    from proxy.configcommand import register_commands as register_config

    register_config(commands)
    from proxy.demo import register_commands as register_demo

    register_demo(commands)
    from proxy.replay.command import register_commands as register_replay

    register_replay(commands)
    from proxy.audit.command import register_commands as register_audit

    register_audit(commands)
    from proxy.admin.command import register_commands as register_keys

    register_keys(commands)
    return parser


def serve_command(args: argparse.Namespace) -> int:
    import uvicorn

    from proxy.app import create_app
    from proxy.auth import check_exposure
    from proxy.connections import server_options
    from proxy.logs import log_config
    from proxy.tokens import TokenizerUnavailable

    settings = load_settings(args.config, serve_overrides(args))
    server = settings.server
    logging_config = log_config(server.log_level, server.log_format)
    logging.config.dictConfig(logging_config)
    options: dict[str, Any] = {
        "host": server.host,
        "port": server.port,
        "log_level": server.log_level,
        "log_config": logging_config,
        "access_log": False,  # the proxy writes its own access line, with more in it
        "server_header": False,
        # X-Forwarded-* rewriting of the client address: unused here, and a layer per request.
        "proxy_headers": False,
        "timeout_graceful_shutdown": server.drain_timeout_s,
        **uvicorn_speedups(),
        **server_options(server),  # slow-client timeouts and the connection limit
    }
    try:
        # With workers too: the tokenizer and the exposure check fail here, once.
        app = create_app(settings)
    except TokenizerUnavailable as exc:
        print(f"compaction-proxy: error: {exc}", file=sys.stderr)
        return 2
    problem = check_exposure(settings, app.state.proxy.gate.enabled)
    if problem is not None:
        raise ConfigError(problem)
    state = app.state.proxy
    if server.workers > 1 and state.gate.enabled and state.quotas.ledger.name == "memory":
        logging.getLogger("proxy.quota").warning(
            "quota.backend is memory with %d workers: each worker keeps its own quota "
            'counters and usage; use quota.backend = "redis" to share them',
            server.workers,
        )
    if server.workers == 1:
        uvicorn.run(app, **options)
        return 0
    del app  # each worker builds its own
    with worker_environment(settings):
        uvicorn.run("proxy.app:create_worker_app", factory=True, workers=server.workers, **options)
    return 0


@contextlib.contextmanager
def worker_environment(settings: Settings) -> Iterator[None]:
    """What worker processes inherit: the resolved settings, and a fresh directory for
    prometheus_client's multiprocess files (unless PROMETHEUS_MULTIPROC_DIR is set already),
    removed when the server stops."""
    from proxy.settings import WORKER_SETTINGS_ENV, settings_json

    os.environ[WORKER_SETTINGS_ENV] = settings_json(settings)
    made: str | None = None
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        made = tempfile.mkdtemp(prefix="compaction-proxy-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = made
    try:
        yield
    finally:
        os.environ.pop(WORKER_SETTINGS_ENV, None)
        if made is not None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            shutil.rmtree(made, ignore_errors=True)


def uvicorn_speedups() -> dict[str, Any]:
    """uvloop and httptools when installed (uvicorn[standard] brings them)."""
    kwargs: dict[str, Any] = {}
    try:
        import uvloop  # noqa: F401

        kwargs["loop"] = "uvloop"
    except ImportError:
        pass
    try:
        import httptools  # noqa: F401

        kwargs["http"] = "httptools"
    except ImportError:
        pass
    return kwargs


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except ConfigError as exc:
        print(f"compaction-proxy: error: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
