"""The proxy from two source trees, side by side: did a change make a request cheaper?

    git archive <base-commit> | tar -x -C /tmp/base
    python -m bench.ab /tmp/base . --rounds 4 --concurrency 1 64 --stream no yes

Both are `proxy.app:create_app` under uvicorn (as bench/overhead.py runs it, CPU 0), in
front of one bench upstream; the load generator alternates between them every cell, so
both see the same neighbours (`--keys`: both with one proxy key, memory quotas, as
bench/overhead.py's keys-memory). Printed per cell: median server CPU us/req of each, the
median of the per-round B/A CPU ratios (the steadiest number on a shared box), p50, req/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
from pathlib import Path

from bench import harness
from bench.overhead import KEY_TARGETS


def _start(src: Path, port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    cmd = harness.uvicorn_cmd("proxy.app:create_app", port, "uvloop")
    if harness.PINNED:
        cmd = ["taskset", "-c", harness.SERVER_CPU, *cmd]
    proc = subprocess.Popen(cmd, env={**os.environ, **env, "PYTHONPATH": str(src)}, cwd=src)
    harness._wait_listening(port, proc)
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("a", type=Path, help="source tree A (the baseline)")
    parser.add_argument("b", type=Path, help="source tree B (the change)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--stream", nargs="+", choices=["no", "yes"], default=["no"])
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument(
        "--keys", action="store_true", help="both with bench/overhead.py's keys-memory key"
    )
    args = parser.parse_args()
    env = {"COMPACTION_PROXY_SERVER__LOG_LEVEL": "warning"}
    if args.keys:
        env |= KEY_TARGETS["keys-memory"]
    harness.warn_without_tokenizer()
    results: dict[tuple[str, int, str], list[harness.Result]] = {}
    with harness.upstream() as up_port:
        env["COMPACTION_PROXY_UPSTREAM__BASE_URL"] = f"http://127.0.0.1:{up_port}/v1"
        servers: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
        try:
            for name, src in (("A", args.a.resolve()), ("B", args.b.resolve())):
                port = harness.free_port()
                servers[name] = (_start(src, port, env), port)
            for _ in range(args.rounds):
                for stream in args.stream:
                    for conc in args.concurrency:
                        for name, (proc, port) in servers.items():
                            r = harness.load(
                                port, conc, "small", stream == "yes", args.duration, 0.5, proc.pid
                            )
                            results.setdefault((stream, conc, name), []).append(r)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(10)
    for stream in args.stream:
        for conc in args.concurrency:
            a, b = results[(stream, conc, "A")], results[(stream, conc, "B")]
            paired = statistics.median(y.cpu_us / x.cpu_us for x, y in zip(a, b, strict=True))
            med = harness.median_result
            ra, rb = med(a), med(b)
            print(f"stream={stream} c={conc}: CPU us/req A {ra.cpu_us:.0f} B {rb.cpu_us:.0f} "
                  f"(paired B/A {paired:.3f}); p50 ms A {ra.p50_ms:.2f} B {rb.p50_ms:.2f}; "
                  f"req/s A {ra.rps:.0f} B {rb.rps:.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
