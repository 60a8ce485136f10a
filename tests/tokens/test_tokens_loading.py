"""Loading the BPE files: cache, the offline package, failure messages, estimate mode."""

from __future__ import annotations

import gzip
import hashlib
import os
from pathlib import Path

import httpx
import pytest
import tiktoken

from proxy.settings import Settings
from proxy.tokens import TokenCounter, TokenizerUnavailable, encodings
from proxy.tokens.encodings import SPECS

SAMPLE = "Tokenizers: ünïcödé, 漢字, emoji 👍, code `x = f(y)**2`, <|endoftext|> as text."


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Downloads fail (and are recorded) instead of touching the network."""
    tried: list[str] = []

    def refuse(spec: encodings.EncodingSpec) -> bytes:
        tried.append(spec.name)
        raise httpx.ConnectError("network disabled in tests")

    monkeypatch.setattr(encodings, "download", refuse)
    return tried


@pytest.fixture
def unbuilt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the encodings built so far in this process, so loading really happens."""
    monkeypatch.setattr(encodings, "_BUILT", {})


def counter_for(cache_dir: Path, **tokenizer: object) -> TokenCounter:
    return TokenCounter(
        Settings.model_validate({"tokenizer": {"cache_dir": str(cache_dir), **tokenizer}})
    )


@pytest.mark.parametrize("name", list(SPECS))
def test_specs_match_tiktoken(name: encodings.EncodingName) -> None:
    reference = tiktoken.get_encoding(name)
    spec = SPECS[name]
    assert spec.pat_str == reference._pat_str
    assert spec.special_tokens == reference._special_tokens
    assert spec.cache_file == hashlib.sha1(spec.url.encode()).hexdigest()


def test_shared_cache_uses_tiktoken_file_names() -> None:
    cache = encodings.resolve_cache_dir(None)
    assert cache is not None
    for spec in SPECS.values():
        assert hashlib.sha256((cache / spec.cache_file).read_bytes()).hexdigest() == spec.sha256


def test_cache_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "env"))
    assert encodings.resolve_cache_dir(str(tmp_path / "cfg")) == tmp_path / "cfg"
    assert encodings.resolve_cache_dir(None) == tmp_path / "env"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    assert encodings.resolve_cache_dir(None) is None  # tiktoken's "no cache"
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR")
    monkeypatch.setenv("DATA_GYM_CACHE_DIR", str(tmp_path / "gym"))
    assert encodings.resolve_cache_dir(None) == tmp_path / "gym"


@pytest.mark.usefixtures("unbuilt")
def test_offline_package_route(tmp_path: Path, no_network: list[str]) -> None:
    counter = counter_for(tmp_path)
    counter.load()
    assert not counter.estimated
    assert no_network == []
    for name in SPECS:
        reference = tiktoken.get_encoding(name)
        model = "gpt-4o" if name == "o200k_base" else "gpt-4"
        assert counter.count_text(model, SAMPLE) == len(reference.encode_ordinary(SAMPLE))
    counter.close()


def test_package_bytes_are_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "fakepkg"
    (fake / "data").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "data" / "o200k_base.tiktoken.gz").write_bytes(gzip.compress(b"dGVzdA== 0\n"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(encodings, "OFFLINE_PACKAGE", "fakepkg")
    with pytest.raises(ValueError, match="sha256"):
        encodings.read_package(SPECS["o200k_base"])


@pytest.mark.usefixtures("unbuilt")
def test_a_corrupt_cache_file_is_skipped(tmp_path: Path, no_network: list[str]) -> None:
    spec = SPECS["cl100k_base"]
    (tmp_path / spec.cache_file).write_bytes(b"corrupt")
    data, source = encodings.fetch(spec, tmp_path, ("cache", "package", "tiktoken"))
    assert source == "package"
    assert hashlib.sha256(data).hexdigest() == spec.sha256


@pytest.mark.usefixtures("unbuilt")
def test_downloads_are_verified_and_cached(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = SPECS["cl100k_base"]
    shared = encodings.resolve_cache_dir(None)
    assert shared is not None
    payload = {"body": (shared / spec.cache_file).read_bytes()}

    def handler(request: httpx.Request) -> httpx.Response:
        assert str(request.url) == spec.url
        return httpx.Response(200, content=payload["body"])

    transport = httpx.MockTransport(handler)
    monkeypatch.setattr(httpx, "get", lambda url, **_: httpx.Client(transport=transport).get(url))
    data, source = encodings.fetch(spec, tmp_path, ("cache", "tiktoken"))
    assert source == "tiktoken"
    assert (tmp_path / spec.cache_file).read_bytes() == data
    payload["body"] = b"tampered"
    with pytest.raises(encodings.EncodingUnavailable, match="sha256"):
        encodings.fetch(spec, tmp_path / "other", ("tiktoken",))


@pytest.mark.usefixtures("unbuilt")
def test_missing_files_fail_with_a_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_network: list[str]
) -> None:
    monkeypatch.setattr(encodings, "OFFLINE_PACKAGE", "no_such_package_for_tests")
    counter = counter_for(tmp_path)
    with pytest.raises(TokenizerUnavailable) as failure:
        counter.load()
    message = str(failure.value)
    assert "compaction-proxy tokenizer download" in message
    assert "pip install 'compaction-proxy[offline]'" in message
    assert 'tokenizer.on_missing = "estimate"' in message
    assert str(tmp_path) in message
    for spec in SPECS.values():
        assert spec.cache_file in message
    assert "network disabled in tests" in message
    assert sorted(no_network) == sorted(SPECS)
    # a request path that skipped load() gets the same answer, not a crash inside counting
    with pytest.raises(TokenizerUnavailable):
        counter.count_text("gpt-4o", "hello")


@pytest.mark.usefixtures("unbuilt")
def test_estimate_mode(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_network: list[str]
) -> None:
    monkeypatch.setattr(encodings, "OFFLINE_PACKAGE", "no_such_package_for_tests")
    counter = counter_for(tmp_path, on_missing="estimate")
    counter.load()
    assert counter.estimated
    assert counter.estimated_for("gpt-4o")
    assert counter.count_text("gpt-4o", "abcdefgh") == 2
    assert counter.count_text("gpt-4o", "abcdefghi") == 3
    assert counter.count_text("gpt-4o", "漢字") == 2  # 6 UTF-8 bytes
    body = {"model": "gpt-4", "messages": [{"role": "user", "content": "abcd" * 10}]}
    assert counter.count_request(body) == 3 + 1 + 10 + 3
    counter.close()


@pytest.mark.usefixtures("unbuilt")
def test_estimate_mode_with_one_encoding_present(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_network: list[str]
) -> None:
    monkeypatch.setattr(encodings, "OFFLINE_PACKAGE", "no_such_package_for_tests")
    spec = SPECS["o200k_base"]
    shared = encodings.resolve_cache_dir(None)
    assert shared is not None
    (tmp_path / spec.cache_file).write_bytes((shared / spec.cache_file).read_bytes())
    counter = counter_for(tmp_path, on_missing="estimate")
    counter.load()
    assert counter.estimated
    assert not counter.estimated_for("gpt-4o")
    assert counter.estimated_for("gpt-4")
    assert counter.count_text("gpt-4o", SAMPLE) == len(
        tiktoken.get_encoding("o200k_base").encode_ordinary(SAMPLE)
    )


def test_constructor_loads_nothing(tmp_path: Path, no_network: list[str]) -> None:
    counter = counter_for(tmp_path / "does-not-exist")
    assert not counter.estimated
    assert not os.path.exists(tmp_path / "does-not-exist")
    counter.close()
