"""What the proxy adds: the same load sent direct, through the bare relay, through the proxy.

    python -m bench.overhead [--duration 2] [--repeats 2] [--servers uvloop asyncio]

Targets: `direct` (the fast upstream, bench/upstream.py), `relay` (bench/relay.py, plain
httpx: the baseline of this stack), `proxy` (proxy.app:create_app as users run it, upstream
pointed at the bench upstream; compaction on with the default budget, so the small and ~30k-
token bodies pass through after token counting), `keys-memory` / `keys-redis` (the same proxy
with a proxy key that has every quota set, high enough never to refuse, memory or Redis quota
backend: the quota check, usage accounting and stream usage tap on every request; compare with
`proxy`, same run; keys-redis talks to a private `redis-server` pinned to the load generator's
CPU, as the upstream is, so Redis never runs on the server's CPU and no one else's traffic
reaches it; `--redis shared` uses 127.0.0.1:6379 under a random prefix), `litellm` (LiteLLM's proxy,
pinned version, in its own venv, one worker, routed to the same upstream: bench/litellm_peer.py;
bench/peers.py runs the comparison), `portkey` (Portkey's gateway, pinned, from npm into its own
folder, routed by request headers: bench/portkey_peer.py), `baseline` (this proxy from another
source tree, `--baseline PATH`: a before/after in one run). Each is a server subprocess
pinned to CPU 0; upstream and load generator share CPU 1 (see bench/harness.py). Repeats are
interleaved across targets and the per-metric median is printed; added p50 = p50 - direct p50.
A server that dies mid-run (LiteLLM once segfaulted under this load) is started again; its
exit and the cell it died in are printed under the table, and its failed requests are errors.
`RSS MB` is the server's highest VmRSS sampled during the cell (max over repeats); a second
table gives each server's VmRSS at rest (listening, before any request), its peak under
load and its VmHWM at the end (start-up transients included), from /proc.

The keys goals' c1 line (added p50 against `proxy`) comes from a paired phase after the
table, when both ran with c1: `proxy` and the keys targets take turns of `--paired-slice`
seconds, one request at a time, `--paired-rounds` rounds (bench/loadgen.py's paired mode),
and the added p50 is the median over rounds of (keys p50 - proxy p50 of the same round),
printed with the quartiles of those differences. The same quantity as the table's cells,
but both sides of each difference are measured in the same second: the cells of one target
are seconds apart from the other's, and on a shared box their medians' difference moved by
+-0.2 ms between runs of the same code.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import secrets
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from bench import harness, litellm_peer, portkey_peer

# The load generator sends `Authorization: Bearer sk-bench`.
_BENCH_KEY = {
    "id": "bench",
    "key_sha256": hashlib.sha256(b"sk-bench").hexdigest(),
    "requests_per_minute": 10**9,
    "prompt_tokens_per_minute": 10**12,
    "prompt_tokens_per_day": 10**13,
    "spend_usd_per_day": 10.0**9,
    "spend_usd_per_month": 10.0**10,
}
_KEYS_ENV = {"COMPACTION_PROXY_AUTH__KEYS": json.dumps([_BENCH_KEY])}
KEY_TARGETS: dict[str, dict[str, str]] = {
    "keys-memory": _KEYS_ENV | {"COMPACTION_PROXY_QUOTA__BACKEND": "memory"},
    "keys-redis": _KEYS_ENV
    | {
        "COMPACTION_PROXY_QUOTA__BACKEND": "redis",
        "COMPACTION_PROXY_QUOTA__KEY_PREFIX": f"bench-{secrets.token_hex(4)}:",
    },
}


Cell = tuple[str, int, str, str]  # target label, concurrency, body, stream


def key_env(target: str, redis_url: str | None = None) -> dict[str, str]:
    """A target's own environment; keys-redis's quota Redis at `redis_url` when given
    (else the shared 127.0.0.1:6379, the settings' default)."""
    env = dict(KEY_TARGETS.get(target, {}))
    if target == "keys-redis" and redis_url is not None:
        env["COMPACTION_PROXY_QUOTA__REDIS_URL"] = redis_url
    return env


def main(argv: list[str] | None = None) -> dict[Cell, harness.Result]:
    """Run the matrix, print the table; returns the medians (for bench/peers.py)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--body", nargs="+", choices=["small", "30k"], default=["small", "30k"])
    parser.add_argument("--stream", nargs="+", choices=["no", "yes"], default=["no", "yes"])
    parser.add_argument("--servers", nargs="+", choices=["uvloop", "asyncio"], default=["uvloop"])
    parser.add_argument(
        "--targets",
        nargs="+",
        choices=["relay", "proxy", "baseline", *KEY_TARGETS, "litellm", "portkey"],
        default=["relay", "proxy"],
    )
    parser.add_argument(
        "--litellm-version", default=litellm_peer.PINNED_VERSION,
        help="the litellm[proxy] release for the `litellm` target (installed if missing)",
    )  # fmt: skip
    parser.add_argument(
        "--litellm-venv", type=Path, default=None,
        help="its venv (default: ~/.cache/compaction-proxy-bench/litellm-<version>)",
    )  # fmt: skip
    parser.add_argument(
        "--portkey-version", default=portkey_peer.PINNED_VERSION,
        help="the @portkey-ai/gateway release for the `portkey` target (installed if missing)",
    )  # fmt: skip
    parser.add_argument(
        "--portkey-dir", type=Path, default=None,
        help="its folder (default: ~/.cache/compaction-proxy-bench/portkey-<version>)",
    )  # fmt: skip
    parser.add_argument(
        "--baseline", type=Path, default=None,
        help="a source tree of this proxy (e.g. `git worktree add /tmp/base main`): the "
        "`baseline` target runs it, beside `proxy` from this tree",
    )  # fmt: skip
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--paired-rounds", type=int, default=15,
        help="keys goals at c1: rounds of paired turns (0: from the table's medians only)",
    )  # fmt: skip
    parser.add_argument("--paired-slice", type=float, default=0.3, help="seconds per turn")
    parser.add_argument(
        "--redis", choices=["private", "shared"], default="private",
        help="keys-redis's Redis: a private redis-server pinned beside the load generator "
        "(default; the shared 127.0.0.1:6379 when redis-server is not installed) or the shared one",
    )  # fmt: skip
    args = parser.parse_args(argv)
    litellm_venv = None
    if "litellm" in args.targets:
        venv = args.litellm_venv or litellm_peer.default_venv(args.litellm_version)
        litellm_venv = litellm_peer.ensure_venv(venv, args.litellm_version)
    portkey_dir = None
    if "portkey" in args.targets:
        folder = args.portkey_dir or portkey_peer.default_dir(args.portkey_version)
        portkey_dir = portkey_peer.ensure_installed(folder, args.portkey_version)
    if "baseline" in args.targets and args.baseline is None:
        parser.error("the baseline target needs --baseline PATH")

    harness.warn_without_tokenizer()
    env: dict[str, str] = {}
    apps = {"relay": "bench.relay:create_app", "proxy": "proxy.app:create_app"}
    results: dict[Cell, list[harness.Result]] = {}
    incidents: list[str] = []  # servers that died, cells the load generator failed
    with harness.upstream() as up_port, contextlib.ExitStack() as stack:
        redis_url = None
        if args.redis == "private" and "keys-redis" in args.targets:
            redis_url = stack.enter_context(harness.redis_server())
        up_url = f"http://127.0.0.1:{up_port}"
        env |= {"BENCH_UPSTREAM": up_url, "COMPACTION_PROXY_UPSTREAM__BASE_URL": f"{up_url}/v1"}
        env |= {"COMPACTION_PROXY_SERVER__LOG_LEVEL": "warning"}
        launch: dict[str, Callable[[], AbstractContextManager[harness.Server]]] = {}
        headers: dict[str, list[str]] = {}  # per target: routing headers on each request
        for kind in args.servers:
            for name in args.targets:
                label = name if args.servers == ["uvloop"] else f"{name}/{kind}"
                if name == "litellm":
                    if "litellm" in launch:
                        continue  # LiteLLM picks its own server: one row whatever --servers
                    assert litellm_venv is not None
                    conf = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "c.yaml"
                    litellm_peer.write_config(conf, f"{up_url}/v1")
                    launch["litellm"] = _launcher(
                        lambda port, v=litellm_venv, c=conf: litellm_peer.command(v, c, port),
                        env | litellm_peer.server_env(),
                    )
                    continue
                if name == "portkey":
                    if "portkey" in launch:
                        continue  # node, whatever --servers
                    assert portkey_dir is not None
                    launch["portkey"] = _launcher(
                        lambda port, d=portkey_dir: portkey_peer.command(d, port), env, quiet=True
                    )
                    headers["portkey"] = portkey_peer.request_headers(f"{up_url}/v1")
                    continue
                app = apps.get(name, apps["proxy"])
                tree = args.baseline.resolve() if name == "baseline" else harness.ROOT
                launch[label] = _launcher(
                    lambda port, a=app, k=kind: harness.uvicorn_cmd(a, port, k),
                    env | key_env(name, redis_url),
                    cwd=tree,
                )
        targets: dict[str, harness.Server | None] = {"direct": None}
        for label, start in launch.items():
            targets[label] = stack.enter_context(start())
        for repeat in range(1, args.repeats + 1):
            for body in args.body:
                for stream in args.stream:
                    for conc in args.concurrency:
                        for label in list(targets):
                            srv = targets[label]
                            where = f"{label} body={body} stream={stream} c{conc} repeat {repeat}"
                            port = up_port if srv is None else srv.port
                            r = _load(
                                incidents, where, port, conc, body, stream == "yes",
                                args.duration, args.warmup, None if srv is None else srv.pid,
                                headers.get(label, []),
                            )  # fmt: skip
                            results.setdefault((label, conc, body, stream), []).append(r)
                            status = None if srv is None else harness.exit_status(srv.pid)
                            if status is not None:
                                incidents.append(f"{where}: the server exited ({status}); "
                                                 f"{r.errors} errors; started again")  # fmt: skip
                                targets[label] = stack.enter_context(launch[label]())
        paired = _paired(targets, args, incidents)
        hwm = {label: harness.memory_mb(srv.pid)[1] for label, srv in targets.items() if srv}

    if litellm_venv is not None:
        print(f"\nversions: {_versions(litellm_venv, portkey_dir)}")
    print(
        f"\noverhead: {args.repeats} interleaved repeat(s) x {args.duration}s, medians; "
        f"pinned={harness.PINNED}/{harness.PIN} (server CPU {harness.SERVER_CPU}, "
        f"upstream+loadgen CPU "
        f"{harness.CLIENT_CPU}); servers={args.servers}"
    )
    header = ["target", "body", "stream", "conc", "req/s", "p50 ms", "p99 ms", "added p50 ms",
              "req/s vs relay", "CPU us/req", "RSS MB", "errors"]  # fmt: skip
    peer = "litellm" in targets
    if peer:
        header.insert(header.index("CPU us/req"), "req/s vs litellm")
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
                    row = [
                        label, body, stream, str(conc), f"{r.rps:,.0f}", f"{r.p50_ms:.2f}",
                        f"{r.p99_ms:.2f}",
                        "" if label == "direct" else f"{r.p50_ms - direct.p50_ms:+.2f}",
                        "" if relay is None or label == "direct" else ratio(r.rps, relay.rps),
                        "" if label == "direct" else f"{r.cpu_us:.0f}",
                        "" if label == "direct" else f"{r.rss_mb:.0f}", str(r.errors),
                    ]  # fmt: skip
                    if peer:
                        lite = med[("litellm", conc, body, stream)]
                        mine = label not in ("direct", "litellm", "portkey")
                        vs_lite = ratio(r.rps, lite.rps) if mine else ""
                        row.insert(header.index("req/s vs litellm"), vs_lite)
                    rows.append(row)
    harness.print_table(header, rows)
    for line in incidents:
        print(f"  ! {line}")
    _memory(med, targets, hwm, args)
    if "keys-redis" in targets and redis_url is None:  # a private server is gone already
        _drop_redis_keys(KEY_TARGETS["keys-redis"]["COMPACTION_PROXY_QUOTA__KEY_PREFIX"])
    if "proxy" in targets and any(t in targets for t in KEY_TARGETS):
        _key_goals(med, args, [t for t in KEY_TARGETS if t in targets], paired)
    if "proxy" in targets and "small" in args.body and 1 in args.concurrency:
        _goals(med, args)
    return med


Paired = dict[tuple[str, str, str], list[float]]  # (label, body, stream) -> p50 ms per round


def _paired(
    targets: dict[str, harness.Server | None], args: argparse.Namespace, incidents: list[str]
) -> Paired:
    """c1 p50s of `proxy` and the keys targets taking turns (harness.paired_c1), per round:
    the keys goals' c1 line pairs each keys turn with the `proxy` turn of its round."""
    labels = [t for t in ("proxy", *KEY_TARGETS) if targets.get(t) is not None]
    if args.paired_rounds <= 0 or 1 not in args.concurrency or "proxy" not in labels:
        return {}
    if len(labels) < 2:
        return {}
    ports = [targets[t].port for t in labels]  # type: ignore[union-attr]
    found: Paired = {}
    for body in args.body:
        for stream in args.stream:
            try:
                p50s = harness.paired_c1(ports, body, stream == "yes", args.paired_rounds,
                                         args.paired_slice, args.warmup)  # fmt: skip
            except (subprocess.SubprocessError, ValueError) as exc:
                incidents.append(f"paired c1 body={body} stream={stream}: the load generator "
                                 f"failed ({type(exc).__name__})")  # fmt: skip
                continue
            for label, port in zip(labels, ports, strict=True):
                found[(label, body, stream)] = p50s[port]
    return found


def _launcher(
    cmd_for_port: Callable[[int], list[str]],
    env: dict[str, str],
    *,
    cwd: Path = harness.ROOT,
    quiet: bool = False,
) -> Callable[[], AbstractContextManager[harness.Server]]:
    """Starts the server on a fresh port each call (a restart after a crash gets a new one)."""

    def start() -> AbstractContextManager[harness.Server]:
        port = harness.free_port()
        return harness.server(cmd_for_port(port), port, env, cwd=cwd, quiet=quiet)

    return start


def _load(
    incidents: list[str], where: str, port: int, conc: int, body: str, stream: bool,
    duration: float, warmup: float, pid: int | None, headers: list[str],
) -> harness.Result:  # fmt: skip
    """One cell; a load generator that fails or hangs is an incident, not the end of the run."""
    try:
        return harness.load(port, conc, body, stream, duration, warmup, pid, headers)
    except (subprocess.SubprocessError, ValueError) as exc:
        incidents.append(f"{where}: the load generator failed ({type(exc).__name__})")
        return harness.Result(0.0, float("nan"), float("nan"), 1)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"


def _versions(litellm_venv: Path, portkey_dir: Path | None = None) -> str:
    """What a re-run must match: both proxies' versions (ours with its commit), Python, box."""
    ours = importlib.metadata.version("compaction-proxy")
    commit = subprocess.run(
        ["git", "-C", str(harness.ROOT), "describe", "--always", "--dirty"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    lite = litellm_peer.installed_version(litellm_venv)
    portkey = "" if portkey_dir is None else portkey_peer.installed_version(portkey_dir)
    cpus = len(os.sched_getaffinity(0))
    return (
        f"compaction-proxy {ours} ({commit or 'no git'}), LiteLLM {lite}, "
        + (f"Portkey gateway {portkey} (node {_node_version()}), " if portkey else "")
        + f"Python {platform.python_version()}, {platform.machine()} x {cpus} CPUs, "
        f"{platform.system()} {platform.release()}"
    )


def _node_version() -> str:
    done = subprocess.run(["node", "--version"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "?"


def _memory(
    med: dict[tuple[str, int, str, str], harness.Result],
    targets: dict[str, harness.Server | None],
    hwm: dict[str, float],
    args: argparse.Namespace,
) -> None:
    """Each server's memory: at rest, under load (c=max), and the goals against the relay."""
    top = max(args.concurrency)
    print(f"\nmemory (MB, from /proc; under load = highest VmRSS sampled at c={top}):")
    header = ["target", "VmRSS at rest", "VmRSS under load", "VmHWM at end"]
    rows, loaded = [], {}
    for label, srv in targets.items():
        if srv is None:
            continue
        cells = [r.rss_mb for (t, c, _, _), r in med.items() if t == label and c == top]
        loaded[label] = max(cells, default=float("nan"))
        rows.append([label, f"{srv.rest_mb:.0f}", f"{loaded[label]:.0f}", f"{hwm[label]:.0f}"])
    harness.print_table(header, rows)
    proxy, relay = targets.get("proxy"), targets.get("relay")
    if proxy is None or relay is None:
        return
    print("\ngoals (memory):")
    print(f"  proxy VmRSS under c{top} load {loaded['proxy']:.0f} MB (goal <= 150 MB): "
          f"{'PASS' if loaded['proxy'] <= 150 else 'FAIL'}")  # fmt: skip
    ratio = proxy.rest_mb / relay.rest_mb
    print(f"  proxy/relay VmRSS at rest {proxy.rest_mb:.0f}/{relay.rest_mb:.0f} MB = "
          f"{ratio:.2f}x (goal <= 2x): {'PASS' if ratio <= 2 else 'FAIL'}")  # fmt: skip


def _key_goals(
    med: dict[tuple[str, int, str, str], harness.Result],
    args: argparse.Namespace,
    labels: list[str],
    paired: Paired,
) -> None:
    """Keys, quota and accounting against the same proxy without keys, same run.

    At c1 the added p50 is the median over rounds of (keys p50 - proxy p50) from the paired
    turns, when they ran: the table's cells are seconds apart, and on a shared box the
    difference of their medians moves by +-0.2 ms between runs of the same code; the turns
    put both sides of each difference in the same stretch of time. The quartiles of the
    per-round differences are printed with it, and the cells' difference beside it."""
    top = max(args.concurrency)
    print("\ngoals (keys vs proxy without keys):")
    for body in args.body:
        for stream in args.stream:
            base1, base_top = (med.get(("proxy", c, body, stream)) for c in (1, top))
            for label in labels:
                one, many = (med.get((label, c, body, stream)) for c in (1, top))
                if 1 in args.concurrency and base1 is not None and one is not None:
                    cells = one.p50_ms - base1.p50_ms
                    added, how = cells, "table medians"
                    rounds = paired.get((label, body, stream))
                    base_rounds = paired.get(("proxy", body, stream))
                    if rounds and base_rounds:
                        diffs = sorted(k - p for k, p in zip(rounds, base_rounds, strict=True))
                        added = statistics.median(diffs)
                        q1, _, q3 = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else (
                            added, added, added)  # fmt: skip
                        how = (f"median of {len(diffs)} paired rounds, quartiles "
                               f"{q1:+.2f}..{q3:+.2f}; table medians {cells:+.2f}")  # fmt: skip
                    print(f"  {label} body={body} stream={stream}: added p50 at c1 "
                          f"{added:+.2f} ms ({how}), CPU {one.cpu_us - base1.cpu_us:+.0f} us/req "
                          f"(goal <= 0.3 ms): {'PASS' if added <= 0.3 else 'FAIL'}")  # fmt: skip
                if top != 1 and base_top is not None and many is not None:
                    ratio = many.rps / base_top.rps
                    print(f"  {label} body={body} stream={stream}: req/s at c{top} "
                          f"{ratio:.2f}x (goal >= 0.90x): "
                          f"{'PASS' if ratio >= 0.9 else 'FAIL'}")  # fmt: skip


def _drop_redis_keys(prefix: str) -> None:
    """The bench's quota and usage keys on the shared Redis (never anyone else's)."""
    try:
        from redis import Redis

        client = Redis.from_url("redis://127.0.0.1:6379/0", socket_timeout=5)
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()
    except Exception as exc:  # a benchmark's cleanup must not hide its table
        print(f"(could not remove the bench's Redis keys {prefix}*: {type(exc).__name__})")


def _goals(med: dict[tuple[str, int, str, str], harness.Result], args: argparse.Namespace) -> None:
    """Small bodies against the bare relay, same run: added p50 at c1 at most 0.6x the relay's,
    req/s at the top concurrency at least 4x the relay's and never below our own c1."""
    top = max(args.concurrency)
    print("\ngoals (one process, small bodies, vs the bare relay in the same run):")
    for stream in args.stream:
        proxy1, direct1 = med[("proxy", 1, "small", stream)], med[("direct", 1, "small", stream)]
        added = proxy1.p50_ms - direct1.p50_ms
        relay1 = med.get(("relay", 1, "small", stream))
        if relay1 is not None:
            relay_added = relay1.p50_ms - direct1.p50_ms
            ratio = added / relay_added if relay_added > 0 else float("inf")
            print(f"  stream={stream}: added p50 at c1 {added:.2f} ms vs relay {relay_added:.2f} "
                  f"ms = {ratio:.2f}x (CPU {proxy1.cpu_us:.0f} vs {relay1.cpu_us:.0f} us/req; "
                  f"goal <= 0.6x): {'PASS' if ratio <= 0.6 else 'FAIL'}")  # fmt: skip
        proxy_top, relay_top = (
            med[("proxy", top, "small", stream)],
            med.get(("relay", top, "small", stream)),
        )
        if relay_top is not None and top != 1:
            ratio = proxy_top.rps / relay_top.rps
            print(f"  stream={stream}: proxy/relay req/s at c{top} {ratio:.2f}x (goal >= 4x): "
                  f"{'PASS' if ratio >= 4 else 'FAIL'}")  # fmt: skip
        if top != 1:
            own = proxy_top.rps / proxy1.rps
            print(f"  stream={stream}: proxy c{top}/c1 req/s {own:.2f}x (goal >= 1x): "
                  f"{'PASS' if own >= 1 else 'FAIL'}")  # fmt: skip


if __name__ == "__main__":
    main()
