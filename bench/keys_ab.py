"""Keys against no keys, paired: the issue's keys goals in CPU terms, on a shared box.

    git archive <base-commit> | tar -x -C /tmp/base
    python -m bench.keys_ab . [/tmp/base ...] --rounds 6

Each tree runs three servers side by side (bench/overhead.py's `proxy`, `keys-memory` and
`keys-redis`, uvicorn pinned to the server CPU, one bench upstream), and the load generator
goes round all of them every cell, so each keys cell has a `proxy` cell of the same tree
next to it in time (keys-redis on a private `redis-server` pinned beside the load generator,
as in bench/overhead.py). Printed per tree and concurrency: median server CPU us/req of `proxy`,
and for each keys target the median of the per-round keys/proxy CPU ratios and differences,
p50 difference and req/s ratio (the goals: +0.3 ms p50 at c1, >= 0.90x req/s at c64).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
from pathlib import Path

from bench import harness
from bench.ab import _start
from bench.overhead import KEY_TARGETS, _drop_redis_keys, key_env

TARGETS = ("proxy", "keys-memory", "keys-redis")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("trees", nargs="+", type=Path, help="source trees (first: this one)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--stream", choices=["no", "yes"], default="no")
    parser.add_argument("--duration", type=float, default=2.0)
    args = parser.parse_args()
    env = {"COMPACTION_PROXY_SERVER__LOG_LEVEL": "warning"}
    harness.warn_without_tokenizer()
    results: dict[tuple[str, str, int], list[harness.Result]] = {}
    trees = [str(tree.resolve()) for tree in args.trees]
    with harness.upstream() as up_port, harness.redis_server() as redis_url:
        env["COMPACTION_PROXY_UPSTREAM__BASE_URL"] = f"http://127.0.0.1:{up_port}/v1"
        servers: dict[tuple[str, str], tuple[subprocess.Popen[bytes], int]] = {}
        try:
            for tree in trees:
                for target in TARGETS:
                    port = harness.free_port()
                    target_env = env | key_env(target, redis_url)
                    servers[(tree, target)] = (_start(Path(tree), port, target_env), port)
            for _ in range(args.rounds):
                for conc in args.concurrency:
                    for (tree, target), (proc, port) in servers.items():
                        r = harness.load(
                            port, conc, "small", args.stream == "yes", args.duration, 0.5, proc.pid
                        )
                        results.setdefault((tree, target, conc), []).append(r)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(10)
            if redis_url is None:  # the shared Redis: only the bench's own keys go
                _drop_redis_keys(KEY_TARGETS["keys-redis"]["COMPACTION_PROXY_QUOTA__KEY_PREFIX"])
    med = statistics.median
    for conc in args.concurrency:
        for tree in trees:
            base = results[(tree, "proxy", conc)]
            parts = [f"c{conc} {tree}: proxy CPU {med(r.cpu_us for r in base):.0f} us/req"]
            for target in TARGETS[1:]:
                keys = results[(tree, target, conc)]
                pairs = list(zip(base, keys, strict=True))
                parts.append(
                    f"{target} CPU x{med(k.cpu_us / p.cpu_us for p, k in pairs):.3f} "
                    f"({med(k.cpu_us - p.cpu_us for p, k in pairs):+.0f} us), "
                    f"p50 {med(k.p50_ms - p.p50_ms for p, k in pairs):+.2f} ms, "
                    f"req/s x{med(k.rps / p.rps for p, k in pairs):.2f}"
                )
            print("; ".join(parts))


if __name__ == "__main__":
    main()
