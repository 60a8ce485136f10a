"""What the per-request record, access line and metrics cost: `compaction-proxy serve` as
operators run it, at log level warning (no access line), info/text and info/json.

    python -m bench.access_log [--repeats 3] [--duration 2] [--concurrency 1 64]

Each target is a `compaction-proxy serve` subprocess (stderr to /dev/null: the lines are
formatted and written, as to a pipe or file) pinned to the server CPU, against the fast bench
upstream; repeats are interleaved across targets and per-metric medians printed. `CPU us/req`
is the steady figure on a shared box (see bench/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys

from bench import harness

TARGETS = {
    "warning": ["--log-level", "warning"],
    "info/text": ["--log-level", "info", "--log-format", "text"],
    "info/json": ["--log-level", "info", "--log-format", "json"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    results: dict[tuple[str, bool, int], list[harness.Result]] = {}
    with harness.upstream() as up_port, contextlib.ExitStack() as stack:
        env = {"COMPACTION_PROXY_UPSTREAM__BASE_URL": f"http://127.0.0.1:{up_port}/v1"}
        servers: dict[str, harness.Server] = {}
        for label, flags in TARGETS.items():
            port = harness.free_port()
            serve = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port), *flags]
            cmd = ["sh", "-c", f"exec {shlex.join(serve)} 2>/dev/null"]
            servers[label] = stack.enter_context(harness.server(cmd, port, env))
        for _ in range(args.repeats):
            for stream in (False, True):
                for conc in args.concurrency:
                    for label, srv in servers.items():
                        r = harness.load(
                            srv.port, conc, "small", stream, args.duration, args.warmup, srv.pid
                        )
                        results.setdefault((label, stream, conc), []).append(r)

    print(f"\naccess_log: {args.repeats} interleaved repeat(s) x {args.duration}s, medians")
    header = ["logging", "stream", "conc", "req/s", "p50 ms", "p50 vs warning", "CPU us/req",
              "CPU vs warning", "errors"]  # fmt: skip
    rows = []
    for stream in (False, True):
        for conc in args.concurrency:
            base = harness.median_result(results[("warning", stream, conc)])
            for label in TARGETS:
                r = harness.median_result(results[(label, stream, conc)])
                rows.append([
                    label, "yes" if stream else "no", str(conc), f"{r.rps:,.0f}",
                    f"{r.p50_ms:.2f}", f"{r.p50_ms - base.p50_ms:+.3f}", f"{r.cpu_us:.0f}",
                    f"{r.cpu_us / base.cpu_us:.2f}x", str(r.errors),
                ])  # fmt: skip
    harness.print_table(header, rows)


if __name__ == "__main__":
    main()
