"""How much slower than no proxy, and than LiteLLM? The published comparison, one command.

    python -m bench.peers [--repeats 3] [--duration 5] [--warmup 1] [--litellm-venv PATH]

bench/overhead.py's matrix with targets direct (the bench upstream alone), relay (the bare
Starlette + httpx relay), proxy (this proxy, default settings) and litellm (LiteLLM's proxy,
pinned release, its own venv created on first use, its own config: bench/litellm_peer.py),
small and ~30k-token bodies, streaming off and on, concurrency 1 and 64, repeats interleaved
across targets, medians (~15 min with the defaults on 2 vCPUs; 5 s cells because LiteLLM
at concurrency 64 takes 0.6-1.4 s per request, and 64 streams served together end together).
Every server gets CPU 0 to itself in turn; upstream and load generator share CPU 1. Then
the answer: per cell, what each proxy adds to direct's p50 and how this proxy's req/s, CPU
per request and RSS compare with LiteLLM's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import harness, litellm_peer, overhead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--body", nargs="+", choices=["small", "30k"], default=["small", "30k"])
    parser.add_argument("--stream", nargs="+", choices=["no", "yes"], default=["no", "yes"])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--litellm-version", default=litellm_peer.PINNED_VERSION)
    parser.add_argument("--litellm-venv", type=Path, default=None)
    args = parser.parse_args()
    argv = [
        "--targets", "relay", "proxy", "litellm",
        "--concurrency", *map(str, args.concurrency), "--body", *args.body,
        "--stream", *args.stream, "--duration", str(args.duration),
        "--warmup", str(args.warmup), "--repeats", str(args.repeats),
        "--litellm-version", args.litellm_version,
    ]  # fmt: skip
    if args.litellm_venv is not None:
        argv += ["--litellm-venv", str(args.litellm_venv)]
    med = overhead.main(argv)
    print("\nthe answer (medians of this run; added = p50 minus direct's p50 in the same cell):")
    header = ["body", "stream", "conc", "proxy added p50 ms", "litellm added p50 ms",
              "relay added p50 ms", "proxy req/s vs litellm", "proxy req/s vs relay",
              "CPU us/req proxy / litellm", "RSS MB proxy / litellm"]  # fmt: skip
    harness.print_table(header, answer_rows(med, args.body, args.stream, args.concurrency))


def answer_rows(
    med: dict[overhead.Cell, harness.Result],
    bodies: list[str],
    streams: list[str],
    concurrencies: list[int],
) -> list[list[str]]:
    """One row per cell: proxy and LiteLLM side by side against direct and the relay."""
    rows = []
    for body in bodies:
        for stream in streams:
            for conc in concurrencies:
                direct, relay, proxy, lite = (
                    med[(t, conc, body, stream)] for t in ("direct", "relay", "proxy", "litellm")
                )
                rows.append([
                    body, stream, str(conc),
                    f"{proxy.p50_ms - direct.p50_ms:+.2f}", f"{lite.p50_ms - direct.p50_ms:+.2f}",
                    f"{relay.p50_ms - direct.p50_ms:+.2f}",
                    overhead.ratio(proxy.rps, lite.rps), overhead.ratio(proxy.rps, relay.rps),
                    f"{proxy.cpu_us:.0f} / {lite.cpu_us:.0f}",
                    f"{proxy.rss_mb:.0f} / {lite.rss_mb:.0f}",
                ])  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
