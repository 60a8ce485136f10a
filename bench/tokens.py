"""Benchmark: what counting a 128k-token agent history costs, cold and warm.

    python bench/tokens.py [--tokens 128000] [--runs 7]

(a) raw tiktoken: encode every string the formula counts, nothing else;
(b) TokenCounter.count_request on a cold memo (goal: within 1.3x of a);
(c) the same history plus one new message, memo warm (goal: under 2% of a);
(d) acount_request on a cold memo (the uncached work runs in a pool thread);
(e) (a) run in a worker thread, the fair baseline for (d).
Each run gets a fresh copy of the body (as a new request's JSON would be), parsed outside
the timed region. The table shows medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from proxy.settings import Settings, TokenizerSettings
from proxy.tokens import TokenCounter
from proxy.tokens.chat import Media, message_tokens
from proxy.tokens.encodings import load_encoding, resolve_cache_dir
from proxy.tokens.images import GPT_4O

WORDS = tuple(
    " ".join(
        [
            "the of and to in is that for it as was with be by on not he this are or his from at",
            "which but have an they you were her she there been one all we their has would when",
            "if so no will more about can out up them some could time into only other new what",
            "like then its also these two may first after any should because most over such where",
            "through between system request response message history token budget summary server",
            "client model cache compaction latency stream buffer header upstream proxy error",
            "retry timeout config file function argument value result output input parse build",
            "test deploy commit branch merge",
        ]
    ).split(" ")
)
CJK = (
    "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子"
    "说产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机"
    "当使点从业本去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心"
    "トークンの数を数えるためにサーバーはメッセージを処理しますこれはテストです"
)


def prose(rng: random.Random, words: int) -> str:
    out: list[str] = []
    for i in range(words):
        word = rng.choice(WORDS)
        out.append(word.capitalize() if i == 0 or out[-1].endswith(".") else word)
        if rng.random() < 0.08:
            out[-1] += rng.choice([".", ",", ".", ";", ":"])
    return " ".join(out) + "."


def cjk(rng: random.Random, chars: int) -> str:
    text = "".join(rng.choice(CJK) for _ in range(chars))
    return "".join(c + ("。" if rng.random() < 0.05 else "") for c in text)


def ident(rng: random.Random) -> str:
    return "_".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))


def code(rng: random.Random, lines: int) -> str:
    out = ["import json", "from pathlib import Path", ""]
    depth = 0
    for _ in range(lines):
        pick = rng.random()
        pad = "    " * depth
        if pick < 0.15 or depth == 0:
            out.append(f"{pad}def {ident(rng)}({ident(rng)}: int, {ident(rng)}: str) -> dict:")
            depth = min(depth + 1, 3)
        elif pick < 0.45:
            out.append(f"{pad}{ident(rng)} = {ident(rng)}.get({rng.randint(0, 9999)!r}, [])")
        elif pick < 0.6:
            out.append(f'{pad}raise ValueError(f"{prose(rng, 6)} {{{ident(rng)}!r}}")')
        elif pick < 0.7:
            out.append(f"{pad}# {prose(rng, 10)}")
        elif pick < 0.85:
            out.append(f"{pad}return {{'{ident(rng)}': {ident(rng)}, 'n': {rng.random():.4f}}}")
            depth = max(depth - 1, 0)
        else:
            out.append(f"{pad}for {ident(rng)} in range({rng.randint(1, 500)}):")
            depth = min(depth + 1, 3)
    return "\n".join(out)


def log(rng: random.Random, lines: int) -> str:
    return "\n".join(
        f"2025-01-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:"
        f"{rng.randint(0, 59):02d}Z {rng.choice(['INFO', 'WARN', 'ERROR', 'DEBUG'])} "
        f"[{ident(rng)}] {prose(rng, 8)} id={rng.getrandbits(64):016x}"
        for _ in range(lines)
    )


def history(target_tokens: int, seed: int = 7) -> list[dict[str, Any]]:
    """An agent session: prose, CJK, tool calls reading code and logs, until `target_tokens`."""
    rng = random.Random(seed)
    counter = TokenCounter(Settings(tokenizer=TokenizerSettings()))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": prose(rng, 1200)},
        {"role": "user", "content": prose(rng, 80)},
    ]
    total = counter.count_messages("gpt-4o", messages)
    turn = 0
    while total < target_tokens:
        turn += 1
        call_id = f"call_{turn:05d}_{rng.getrandbits(48):012x}"
        tool = rng.choice(["read_file", "run_command", "search"])
        args = json.dumps({"path": f"src/{ident(rng)}.py", "limit": rng.randint(10, 400)})
        new: list[dict[str, Any]] = [
            {
                "role": "assistant",
                "content": prose(rng, rng.randint(10, 60)) if rng.random() < 0.5 else None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": tool, "arguments": args},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": call_id,
                "content": code(rng, rng.randint(20, 90))
                if tool == "read_file"
                else log(rng, rng.randint(5, 40)),
            },
        ]
        if turn % 4 == 0:
            new.append({"role": "assistant", "content": prose(rng, rng.randint(60, 250))})
            text = cjk(rng, rng.randint(40, 200)) if turn % 12 == 0 else prose(rng, 40)
            new.append({"role": "user", "content": text})
        messages.extend(new)
        total += sum(counter.count_message("gpt-4o", m) for m in new)
    counter.close()
    return messages


def texts_of(messages: list[dict[str, Any]]) -> list[str]:
    """Exactly the strings the formula tokenizes, for the raw baseline."""
    seen: list[str] = []

    def record(text: str) -> int:
        seen.append(text)
        return 0

    for message in messages:
        message_tokens(message, record, Media(GPT_4O, 765))
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128_000)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()

    messages = history(args.tokens)
    raw_body = json.dumps({"model": "gpt-4o", "messages": messages})
    settings = Settings()
    encoder = load_encoding("o200k_base", resolve_cache_dir(None))  # the counter's own encoder
    # Long-lived counters, as in the app: worker threads stay warm (tiktoken's regex caches
    # are per thread); "cold" means an empty memo.
    cold_counter, async_counter, warm_counter = (TokenCounter(settings) for _ in range(3))
    for counter in (cold_counter, async_counter, warm_counter):
        counter.load()
    tokens = warm_counter.count_request(json.loads(raw_body))
    chars = sum(len(t) for t in texts_of(messages))
    print(f"history: {len(messages)} messages, {chars:,} chars, {tokens:,} prompt tokens")

    def raw() -> float:
        texts = texts_of(json.loads(raw_body)["messages"])
        start = time.perf_counter()
        for text in texts:
            encoder.encode_ordinary(text)
        return time.perf_counter() - start

    def cold() -> float:
        cold_counter._memo.clear()
        body = json.loads(raw_body)
        start = time.perf_counter()
        cold_counter.count_request(body)
        return time.perf_counter() - start

    loop = asyncio.new_event_loop()
    thread = ThreadPoolExecutor(1)

    def raw_in_thread() -> float:
        return thread.submit(raw).result()

    def cold_async() -> float:
        async_counter._memo.clear()
        body = json.loads(raw_body)

        async def go() -> float:
            start = time.perf_counter()
            await async_counter.acount_request(body)
            return time.perf_counter() - start

        return loop.run_until_complete(go())

    turn = iter(range(10**9))
    new_text = prose(random.Random(1), 150)

    def warm() -> float:
        body = json.loads(raw_body)
        body["messages"].append({"role": "user", "content": f"{next(turn)}: {new_text}"})
        start = time.perf_counter()
        warm_counter.count_request(body)
        return time.perf_counter() - start

    cases: list[tuple[str, Callable[[], float], str]] = [
        ("(a) raw tiktoken encode", raw, ""),
        ("(b) count_request, cold", cold, "goal <= 1.30x"),
        ("(c) +1 message, warm", warm, "goal < 0.02x"),
        ("(d) acount_request, cold", cold_async, "compare with (e)"),
        ("(e) (a) in a worker thread", raw_in_thread, ""),
    ]
    samples: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for _ in range(args.runs):  # interleaved, so load from other processes hits all cases alike
        for name, run, _ in cases:
            samples[name].append(run())
    medians = {name: statistics.median(times) * 1000 for name, times in samples.items()}
    a = medians[cases[0][0]]
    print(f"{'case':<28}{'median ms':>10}{'vs (a)':>9}  goal")
    for name, _, goal in cases:
        print(f"{name:<28}{medians[name]:>10.2f}{medians[name] / a:>8.3f}x  {goal}")
    loop.close()
    thread.shutdown()
    for counter in (cold_counter, async_counter, warm_counter):
        counter.close()


if __name__ == "__main__":
    main()
