"""Per-chunk CPU of the stream usage tap (proxy.usage.tap.StreamTap.feed), in process.

A streamed reply is relayed one socket read at a time; for a token-by-token stream that is
one SSE event per chunk, so the tap's cost per chunk is paid hundreds of times per reply.
Shapes (one event per chunk, as OpenAI streams them, then the usage event and [DONE]):

- `plain`: no `usage` key in the chunks (the upstream was not asked for usage);
- `usage-null`: `"usage":null` in every chunk, as OpenAI sends with
  `stream_options.include_usage`, which the proxy adds for keyed streams;
- `usage-null-batched`: the same events, four to a chunk (a slower reader's socket reads).

Each cell: ns per chunk, the fastest of `--repeats` passes over the whole stream (the
fastest, not the median: the machine is shared, and other processes only ever add), for the
tap hiding the usage event (the proxy asked for it) and only reading it (the client asked).
`--baseline PATH` loads another copy of tap.py (e.g. `git show main:proxy/usage/tap.py`)
and times it in the same process, passes alternating, with the ratio. The output is checked
to be the same for both. Run: `python -m bench.tap [--chunks 400] [--baseline PATH]`.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from types import ModuleType
from typing import Any

from proxy.usage import tap as current

_DELTA = (
    b'data: {"id":"chatcmpl-AbC123","object":"chat.completion.chunk","created":1733000000,'
    b'"model":"gpt-4o-mini-2024-07-18","system_fingerprint":"fp_0ba0d124f1","choices":'
    b'[{"index":0,"delta":{"content":" word%d"},"logprobs":null,"finish_reason":null}]%s}\n\n'
)
_USAGE = (
    b'data: {"id":"chatcmpl-AbC123","object":"chat.completion.chunk","created":1733000000,'
    b'"model":"gpt-4o-mini-2024-07-18","system_fingerprint":"fp_0ba0d124f1","choices":[],'
    b'"usage":{"prompt_tokens":1200,"completion_tokens":%d,"total_tokens":%d,'
    b'"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},'
    b'"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,'
    b'"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}\n\n'
)


def stream(chunks: int, *, usage_null: bool, per_chunk: int = 1) -> list[bytes]:
    extra = b',"usage":null' if usage_null else b""
    events = [_DELTA % (i, extra) for i in range(chunks)]
    if usage_null:
        events.append(_USAGE % (chunks, 1200 + chunks))
    events.append(b"data: [DONE]\n\n")
    return [b"".join(events[i : i + per_chunk]) for i in range(0, len(events), per_chunk)]


def one_pass(module: Any, chunks: list[bytes], hide: bool) -> tuple[int, bytes, Any]:
    tap = module.StreamTap(hide_usage_event=hide)
    feed = tap.feed
    out = []
    start = time.perf_counter_ns()
    for chunk in chunks:
        out.append(feed(chunk))
    out.append(tap.end())
    took = time.perf_counter_ns() - start
    return took, b"".join(out), tap.usage


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("baseline_tap", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--chunks", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--baseline", help="another tap.py to time beside this one")
    args = parser.parse_args()
    modules = {"this": current}
    if args.baseline:
        modules = {"baseline": load(args.baseline), "this": current}
    shapes = {
        "plain": stream(args.chunks, usage_null=False),
        "usage-null": stream(args.chunks, usage_null=True),
        "usage-null-batched": stream(args.chunks, usage_null=True, per_chunk=4),
    }
    print(f"ns per chunk, fastest of {args.repeats} passes over {args.chunks} events")
    header = f"{'shape':<20} {'mode':<10} {'chunks':>6}"
    ratio_head = "  ratio" if args.baseline else ""
    print(header + "".join(f" {name:>9}" for name in modules) + ratio_head)
    for name, chunks in shapes.items():
        for mode, hide in (("hide", True), ("read-only", False)):
            best = dict.fromkeys(modules, float("inf"))
            outputs = set()
            for _ in range(args.repeats):
                for label, module in modules.items():
                    took, out, usage = one_pass(module, chunks, hide)
                    best[label] = min(best[label], took / len(chunks))
                    outputs.add((out, tuple(usage) if usage else None))
            assert len(outputs) == 1, "the taps disagree"
            cells = "".join(f" {best[label]:>9.0f}" for label in modules)
            ratio = f"  {best['this'] / best['baseline']:.2f}x" if args.baseline else ""
            print(f"{name:<20} {mode:<10} {len(chunks):>6}{cells}{ratio}")


if __name__ == "__main__":
    main()
