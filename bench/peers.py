"""How much slower than no proxy, and than the peers? The published comparison, one command.

    python -m bench.peers [--repeats 3] [--duration 5] [--warmup 1] [--baseline PATH]

bench/overhead.py's matrix with targets direct (the bench upstream alone), relay (the bare
Starlette + httpx relay), proxy (this proxy, default settings), litellm (LiteLLM's proxy,
pinned release, its own venv created on first use, its own config: bench/litellm_peer.py)
and portkey (Portkey's open-source gateway, pinned, installed from npm into its own folder on
first use, routed by request headers: bench/portkey_peer.py; it waits 25 ms before a
stream's first event by design), plus `baseline` (this proxy from another source tree, e.g.
main before a change) with `--baseline PATH`. Small and ~30k-token bodies, streaming off and
on, concurrency 1 and 64, repeats interleaved across targets, medians (~20 min with the
defaults on 2 vCPUs; 5 s cells because LiteLLM at concurrency 64 takes 0.6-1.4 s per
request, and 64 streams served together end together). Every server gets CPU 0 to itself in
turn; upstream and load generator share CPU 1. Then the answer: per cell, what each proxy
adds to direct's p50 and how this proxy's req/s, CPU per request and RSS compare with the
peers'; and the floors: at concurrency 64 at least 10x LiteLLM's req/s and 2x Portkey's in
every cell, added p50 at concurrency 1 below Portkey's, RSS under load at most 150 MB.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import harness, litellm_peer, overhead, portkey_peer

FLOOR_VS_LITELLM = 10.0
FLOOR_VS_PORTKEY = 2.0
RSS_CEILING_MB = 150.0


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
    parser.add_argument("--portkey-version", default=portkey_peer.PINNED_VERSION)
    parser.add_argument("--portkey-dir", type=Path, default=None)
    parser.add_argument("--baseline", type=Path, default=None, help="see bench/overhead.py")
    args = parser.parse_args()
    targets = ["relay", *(["baseline"] if args.baseline else []), "proxy", "litellm", "portkey"]
    argv = [
        "--targets", *targets,
        "--concurrency", *map(str, args.concurrency), "--body", *args.body,
        "--stream", *args.stream, "--duration", str(args.duration),
        "--warmup", str(args.warmup), "--repeats", str(args.repeats),
        "--litellm-version", args.litellm_version, "--portkey-version", args.portkey_version,
    ]  # fmt: skip
    for flag, value in (
        ("--litellm-venv", args.litellm_venv),
        ("--portkey-dir", args.portkey_dir),
        ("--baseline", args.baseline),
    ):
        if value is not None:
            argv += [flag, str(value)]
    med = overhead.main(argv)
    ours = ["proxy", *(["baseline"] if args.baseline else [])]
    print("\nthe answer (medians of this run; added = p50 minus direct's p50 in the same cell):")
    header = ["target", "body", "stream", "conc", "added p50 ms", "litellm added p50 ms",
              "portkey added p50 ms", "req/s vs litellm", "req/s vs portkey", "req/s vs relay",
              "CPU us/req / litellm / portkey", "RSS MB / litellm / portkey"]  # fmt: skip
    rows = [
        row
        for label in ours
        for row in answer_rows(med, label, args.body, args.stream, args.concurrency)
    ]
    harness.print_table(header, rows)
    if 1 in args.concurrency and max(args.concurrency) > 1:
        print("\nfloors:")
        for label in ours:
            for line in floors(med, label, args.body, args.stream, max(args.concurrency)):
                print(f"  {label} {line}")


def answer_rows(
    med: dict[overhead.Cell, harness.Result],
    label: str,
    bodies: list[str],
    streams: list[str],
    concurrencies: list[int],
) -> list[list[str]]:
    """One row per cell: `label` (a proxy of ours) beside the peers, against direct."""
    rows = []
    for body in bodies:
        for stream in streams:
            for conc in concurrencies:
                direct, relay, mine, lite, portkey = (
                    med[(t, conc, body, stream)]
                    for t in ("direct", "relay", label, "litellm", "portkey")
                )
                rows.append([
                    label, body, stream, str(conc),
                    f"{mine.p50_ms - direct.p50_ms:+.2f}", f"{lite.p50_ms - direct.p50_ms:+.2f}",
                    f"{portkey.p50_ms - direct.p50_ms:+.2f}",
                    overhead.ratio(mine.rps, lite.rps), overhead.ratio(mine.rps, portkey.rps),
                    overhead.ratio(mine.rps, relay.rps),
                    f"{mine.cpu_us:.0f} / {lite.cpu_us:.0f} / {portkey.cpu_us:.0f}",
                    f"{mine.rss_mb:.0f} / {lite.rss_mb:.0f} / {portkey.rss_mb:.0f}",
                ])  # fmt: skip
    return rows


def floors(
    med: dict[overhead.Cell, harness.Result],
    label: str,
    bodies: list[str],
    streams: list[str],
    top: int,
) -> list[str]:
    """PASS/FAIL per floor and cell (see the module docstring)."""
    lines = []
    for body in bodies:
        for stream in streams:
            cell = f"body={body} stream={stream}"
            mine, lite, portkey = (
                med[(t, top, body, stream)] for t in (label, "litellm", "portkey")
            )
            vs_lite, vs_portkey = mine.rps / lite.rps, mine.rps / portkey.rps
            ok = vs_lite >= FLOOR_VS_LITELLM and vs_portkey >= FLOOR_VS_PORTKEY
            lines.append(f"{cell} c{top}: req/s {vs_lite:.1f}x litellm (>= 10x), "
                         f"{vs_portkey:.2f}x portkey (>= 2x): {_verdict(ok)}")  # fmt: skip
            direct1, mine1, portkey1 = (
                med[(t, 1, body, stream)] for t in ("direct", label, "portkey")
            )
            added, theirs = mine1.p50_ms - direct1.p50_ms, portkey1.p50_ms - direct1.p50_ms
            lines.append(f"{cell} c1: added p50 {added:.2f} ms vs portkey {theirs:.2f} ms: "
                         f"{_verdict(added < theirs)}")  # fmt: skip
            rss = max(med[(label, c, body, stream)].rss_mb for c in (1, top))
            lines.append(f"{cell}: RSS under load {rss:.0f} MB (<= {RSS_CEILING_MB:.0f}): "
                         f"{_verdict(rss <= RSS_CEILING_MB)}")  # fmt: skip
    return lines


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


if __name__ == "__main__":
    main()
