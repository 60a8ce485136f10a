"""What the proxy adds: the same load sent direct, through the bare relay, through the proxy.

    python -m bench.overhead [--duration 2] [--repeats 2] [--servers uvloop asyncio]

Targets: `direct` (the fast upstream, bench/upstream.py), `relay` (bench/relay.py, plain
httpx: the baseline of this stack), `proxy` (proxy.app:create_app as users run it, upstream
pointed at the bench upstream; compaction on with the default budget, so the small and ~30k-
token bodies pass through after token counting). Each is a uvicorn subprocess pinned to CPU 0;
upstream and load generator share CPU 1 (see bench/harness.py). Repeats are interleaved
across targets and the per-metric median is printed; added p50 = p50 - direct p50.
"""

from __future__ import annotations

import argparse
import contextlib
import os

from bench import harness

TIKTOKEN_CACHE = harness.ROOT.parent / "shared" / "tiktoken-cache"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--body", nargs="+", choices=["small", "30k"], default=["small", "30k"])
    parser.add_argument("--stream", nargs="+", choices=["no", "yes"], default=["no", "yes"])
    parser.add_argument("--servers", nargs="+", choices=["uvloop", "asyncio"], default=["uvloop"])
    parser.add_argument(
        "--targets", nargs="+", choices=["relay", "proxy"], default=["relay", "proxy"]
    )
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    env: dict[str, str] = {}
    if "TIKTOKEN_CACHE_DIR" not in os.environ and TIKTOKEN_CACHE.is_dir():
        env["TIKTOKEN_CACHE_DIR"] = str(TIKTOKEN_CACHE)
    apps = {"relay": "bench.relay:create_app", "proxy": "proxy.app:create_app"}
    results: dict[tuple[str, int, str, str], list[harness.Result]] = {}
    with harness.upstream() as up_port, contextlib.ExitStack() as stack:
        up_url = f"http://127.0.0.1:{up_port}"
        env |= {"BENCH_UPSTREAM": up_url, "COMPACTION_PROXY_UPSTREAM__BASE_URL": f"{up_url}/v1"}
        env |= {"COMPACTION_PROXY_SERVER__LOG_LEVEL": "warning"}
        targets: dict[str, harness.Server | None] = {"direct": None}
        for kind in args.servers:
            for name in args.targets:
                port = harness.free_port()
                label = name if args.servers == ["uvloop"] else f"{name}/{kind}"
                cmd = harness.uvicorn_cmd(apps[name], port, kind)
                targets[label] = stack.enter_context(harness.server(cmd, port, env))
        for _ in range(args.repeats):
            for body in args.body:
                for stream in args.stream:
                    for conc in args.concurrency:
                        for label, srv in targets.items():
                            port = up_port if srv is None else srv.port
                            r = harness.load(
                                port, conc, body, stream == "yes", args.duration, args.warmup,
                                None if srv is None else srv.pid,
                            )  # fmt: skip
                            results.setdefault((label, conc, body, stream), []).append(r)

    print(
        f"\noverhead: {args.repeats} interleaved repeat(s) x {args.duration}s, medians; "
        f"pinned={harness.PINNED}/{harness.PIN} (server CPU {harness.SERVER_CPU}, "
        f"upstream+loadgen CPU "
        f"{harness.CLIENT_CPU}); servers={args.servers}"
    )
    header = ["target", "body", "stream", "conc", "req/s", "p50 ms", "p99 ms", "added p50 ms",
              "req/s vs relay", "CPU us/req", "errors"]  # fmt: skip
    rows = []
    med = {key: harness.median_result(rs) for key, rs in results.items()}
    for body in args.body:
        for stream in args.stream:
            for conc in args.concurrency:
                direct = med[("direct", conc, body, stream)]
                for label in targets:
                    r = med[(label, conc, body, stream)]
                    relay_label = "relay" + label[len(label.split("/")[0]) :]
                    relay = med.get((relay_label, conc, body, stream))
                    rows.append([
                        label, body, stream, str(conc), f"{r.rps:,.0f}", f"{r.p50_ms:.2f}",
                        f"{r.p99_ms:.2f}",
                        "" if label == "direct" else f"{r.p50_ms - direct.p50_ms:+.2f}",
                        "" if relay is None or label == "direct" else f"{r.rps / relay.rps:.2f}x",
                        "" if label == "direct" else f"{r.cpu_us:.0f}", str(r.errors),
                    ])  # fmt: skip
    harness.print_table(header, rows)
    if "proxy" in targets and "small" in args.body and 1 in args.concurrency:
        _goals(med, args)


def _goals(med: dict[tuple[str, int, str, str], harness.Result], args: argparse.Namespace) -> None:
    top = max(args.concurrency)
    print("\ngoals (one process, small bodies):")
    for stream in args.stream:
        proxy1, direct1 = med[("proxy", 1, "small", stream)], med[("direct", 1, "small", stream)]
        added = proxy1.p50_ms - direct1.p50_ms
        print(f"  stream={stream}: added p50 at c1 {added:.2f} ms (goal < 1 ms): "
              f"{'PASS' if added < 1 else 'FAIL'}")  # fmt: skip
        proxy_top, relay_top = (
            med[("proxy", top, "small", stream)],
            med.get(("relay", top, "small", stream)),
        )
        if relay_top is not None:
            ratio = proxy_top.rps / relay_top.rps
            print(f"  stream={stream}: proxy/relay req/s at c{top} {ratio:.2f}x (goal >= 2.5x): "
                  f"{'PASS' if ratio >= 2.5 else 'FAIL'}")  # fmt: skip
        own = proxy_top.rps / proxy1.rps
        print(f"  stream={stream}: proxy c{top}/c1 req/s {own:.2f}x (goal >= 1x): "
              f"{'PASS' if own >= 1 else 'FAIL'}")  # fmt: skip


if __name__ == "__main__":
    main()
