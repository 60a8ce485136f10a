"""Encodings built at start only when needed; the others on first use, exactly, off the loop."""

from __future__ import annotations

import asyncio
import pickle
import threading
from pathlib import Path

import pydantic
import pytest
import tiktoken

from proxy.settings import Settings
from proxy.tokens import TokenCounter, encodings, models
from tests.conftest import until

SAMPLE = "Tokenizers: ünïcödé, 漢字, emoji 👍, code `x = f(y)**2`, <|endoftext|> as text."
BODY_4 = {"model": "gpt-4", "messages": [{"role": "user", "content": SAMPLE}]}
BODY_4O = {"model": "gpt-4o", "messages": [{"role": "user", "content": SAMPLE}]}


@pytest.fixture
def unbuilt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the encodings built so far in this process, so building really happens."""
    monkeypatch.setattr(encodings, "_BUILT", {})


def counter_with(**tokenizer: object) -> TokenCounter:
    return TokenCounter(Settings.model_validate({"tokenizer": tokenizer}))


def expected(name: str) -> int:
    """The chat formula by hand for one user message: 3 + role + content, + 3 priming."""
    reference = tiktoken.get_encoding(name)
    return 3 + 1 + len(reference.encode_ordinary(SAMPLE)) + 3


@pytest.mark.usefixtures("unbuilt")
async def test_only_the_default_encoding_is_built_at_start() -> None:
    counter = counter_with()
    counter.load()
    assert counter.loaded == {"o200k_base"}
    assert not counter.estimated  # cl100k_base's file was checked, and is there
    assert await counter.acount_request(BODY_4O) == expected("o200k_base")
    assert counter.loaded == {"o200k_base"}
    # a model of the other family builds its encoding on first use, and counts exactly
    assert await counter.acount_request(BODY_4) == expected("cl100k_base")
    assert counter.loaded == {"o200k_base", "cl100k_base"}
    assert counter.count_text("gpt-3.5-turbo", SAMPLE) == len(
        tiktoken.get_encoding("cl100k_base").encode_ordinary(SAMPLE)
    )
    counter.close()


@pytest.mark.usefixtures("unbuilt")
async def test_building_on_first_use_does_not_block_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counter = counter_with()
    counter.load()
    started, release = threading.Event(), threading.Event()
    real_build = encodings.build

    def slow_build(spec: encodings.EncodingSpec, data: bytes) -> tiktoken.Encoding:
        started.set()
        assert release.wait(10), "the test never released the build"
        return real_build(spec, data)

    monkeypatch.setattr(encodings, "build", slow_build)
    first = asyncio.create_task(counter.acount_request(BODY_4))
    await until(started.is_set)
    # While cl100k_base is being built, the loop still serves an o200k_base request.
    assert await counter.acount_request(BODY_4O) == expected("o200k_base")
    assert not first.done()
    release.set()
    assert await first == expected("cl100k_base")
    counter.close()


@pytest.mark.usefixtures("unbuilt")
async def test_concurrent_first_uses_build_once(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = counter_with()
    counter.load()
    builds: list[str] = []
    real_build = encodings.build

    def counting_build(spec: encodings.EncodingSpec, data: bytes) -> tiktoken.Encoding:
        builds.append(spec.name)
        return real_build(spec, data)

    monkeypatch.setattr(encodings, "build", counting_build)
    counts = await asyncio.gather(*(counter.acount_request(BODY_4) for _ in range(4)))
    assert counts == [expected("cl100k_base")] * 4
    assert builds == ["cl100k_base"]
    counter.close()


@pytest.mark.usefixtures("unbuilt")
def test_preload_builds_what_it_names() -> None:
    counter = counter_with(preload=["o200k_base", "cl100k_base"])
    counter.load()
    assert counter.loaded == {"o200k_base", "cl100k_base"}
    counter.close()
    encodings._BUILT.clear()  # (one built already in this process is taken, being free)
    counter = counter_with(default_encoding="cl100k_base", preload=["cl100k_base"])
    counter.load()
    assert counter.loaded == {"cl100k_base"}
    assert counter.count_text("gpt-4o", SAMPLE) == len(
        tiktoken.get_encoding("o200k_base").encode_ordinary(SAMPLE)
    )
    counter.close()


def test_preload_defaults_to_what_the_configuration_names() -> None:
    assert models.preload_encodings(Settings()) == {"o200k_base"}
    cl100k = Settings.model_validate({"tokenizer": {"default_encoding": "cl100k_base"}})
    assert models.preload_encodings(cl100k) == {"cl100k_base"}
    override = Settings.model_validate({"models": {"my-model": {"encoding": "cl100k_base"}}})
    assert models.preload_encodings(override) == {"o200k_base", "cl100k_base"}
    summarizer = Settings.model_validate({"compaction": {"summarizer": {"model": "gpt-4"}}})
    assert models.preload_encodings(summarizer) == {"o200k_base", "cl100k_base"}
    chosen = Settings.model_validate({"tokenizer": {"preload": ["cl100k_base"]}})
    assert models.preload_encodings(chosen) == {"cl100k_base"}


def test_preload_names_are_checked() -> None:
    with pytest.raises(pydantic.ValidationError, match="preload"):
        Settings.model_validate({"tokenizer": {"preload": ["p50k_base"]}})


@pytest.mark.usefixtures("unbuilt")
def test_built_encodings_count_like_tiktoken_without_its_python_ranks() -> None:
    cache = encodings.resolve_cache_dir(None)
    for name in encodings.SPECS:
        ours = encodings.load_encoding(name, cache)
        reference = tiktoken.get_encoding(name)
        assert ours._mergeable_ranks == {}  # the Rust core keeps its own copy
        assert ours.encode_ordinary(SAMPLE) == reference.encode_ordinary(SAMPLE)
        assert ours.n_vocab == reference.n_vocab
        with pytest.raises(TypeError, match="not picklable"):
            pickle.dumps(ours)


@pytest.mark.usefixtures("unbuilt")
def test_a_missing_file_of_an_unbuilt_encoding_still_fails_the_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(encodings, "OFFLINE_PACKAGE", "no_such_package_for_tests")

    def no_download(spec: encodings.EncodingSpec) -> bytes:
        raise OSError("network disabled in tests")

    monkeypatch.setattr(encodings, "download", no_download)
    spec = encodings.SPECS["o200k_base"]
    shared = encodings.resolve_cache_dir(None)
    assert shared is not None
    (tmp_path / spec.cache_file).write_bytes((shared / spec.cache_file).read_bytes())
    counter = counter_with(cache_dir=str(tmp_path), on_missing="estimate")
    counter.load()
    assert counter.loaded == {"o200k_base"}
    assert counter.estimated_for("gpt-4")  # found missing at start, not at first use
    counter.close()
