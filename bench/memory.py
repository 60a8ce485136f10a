"""Where the proxy's memory goes, and what its first request costs after a start.

    python -m bench.memory                  # both parts below
    python -m bench.memory breakdown        # RSS step by step in one process
    python -X tracemalloc=1 -m bench.memory snapshot   # Python allocations after start, by package
    python -m bench.memory first [--starts 5] [--requests 50] [--gap 0] [--targets proxy relay]
    python -m bench.memory instructions [--targets proxy proxy-noconnect]   # under callgrind
    python -m bench.memory first|instructions --fresh   # information: a new message each time

`breakdown` builds the proxy in this process as `serve` does and prints VmRSS after each
step: the interpreter, each heavy import (the start-up's row names any of aiohttp and redis
that got imported: neither should be), the settings, each BPE encoding (tiktoken keeps
its tables in Rust, where tracemalloc cannot see them, so RSS deltas are the measure), the
app, its start-up warm-up, then the count memo filled to its configured cap (and, for
comparison, the cachetools LRUCache it replaced).
Each import is measured in import order, so a module shared with an earlier one is counted
there. `snapshot` is tracemalloc's view once the app is up: Python's own allocations by
package (imports' code and data included; the Rust BPE tables are not there).

`first` starts `compaction-proxy serve` `--starts` times (a fresh process each) against
bench/upstream.py and times request 1 against the median of requests 2..N on one keep-alive
connection, opened and accepted by the server before the clock starts (else the server's
accept of it is inside request 1's time only), for a small chat body, non-streaming and
streaming; `relay` (bench/relay.py) is the same for the bare relay, the floor of this stack,
and `proxy+probe` the proxy with `server.warm_probe_s` set (the upstream connection opened
at start; since the start opens an idle upstream connection by itself, `proxy-noconnect`
is the proxy with `server.warm_connect_s = 0`, as it was before). Goal: request 1 within 2x
of a warm one. Beside wall and server CPU it shows the server's run-queue wait (schedstat:
time its threads were runnable while their CPU ran something else) and wall less that wait:
on a shared box most of request 1's extra wall time is that wait, not the proxy's work.
`--gap S` sends every request S seconds after the last (request 1 S seconds after the
accept), so that warm requests, like request 1, come after idle time (cold caches, and the
scheduler's view of a process that slept). `--realtime` (root) puts the client, the
upstream and each server, once it listens, at SCHED_FIFO: then no other process's time slice
delays a request, and wall time is the three processes' own work (what an idle machine
shows); with this kernel's PREEMPT_NONE another process in a long system call still can.

`instructions` is the same comparison counted in instructions (valgrind's callgrind, every
thread of the server, from just before request 1): exact and repeatable on a busy box, where
CPU time moves with the neighbours (a warm server's request after 0.3 s idle already costs
1.5-2x a back-to-back one there: cold caches). One start per target (the counts repeat
within ~1%); the server starts in ~15 s under valgrind. Each window ends with the 0.3 s
idle before its dump, so request 1's window holds a whole idle and the warm mean a tenth of
one; "ratio less idle" takes one idle off both windows.

`--fresh` (information only, never the goal rows): each request's user message is new, of
the same size, so warm requests count a message too, as request 1 does; the goal rows
resend one body, whose counts warm requests find in the memo.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import http.client
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench import harness

HEAVY_IMPORTS = [
    "ssl", "httpx", "starlette", "uvicorn", "uvloop", "httptools", "pydantic",
    "pydantic_settings", "tiktoken", "prometheus_client", "cachetools",
    "proxy.settings", "proxy.tokens", "proxy.compactor", "proxy.app", "proxy.cli",
]  # fmt: skip


def _rss_mb() -> float:
    return harness.memory_mb(os.getpid())[0]


def breakdown(args: argparse.Namespace) -> None:
    rows: list[list[str]] = []
    last = _rss_mb()
    first = last

    def step(what: str, detail: str = "") -> None:
        nonlocal last
        gc.collect()
        now = _rss_mb()
        rows.append([what, f"{now:.1f}", f"{now - last:+.1f}", detail])
        last = now

    step("interpreter (python -c pass, + bench.harness)")
    for name in HEAVY_IMPORTS:
        started = time.perf_counter()
        importlib.import_module(name)
        step(f"import {name}", f"{(time.perf_counter() - started) * 1000:.0f} ms")

    import asyncio

    from proxy.settings import Settings
    from proxy.tokens import TokenCounter, encodings

    settings = Settings.model_validate(
        {"upstream": {"base_url": "http://127.0.0.1:9/v1"}, "tokenizer": args.tokenizer}
    )
    step("settings", "defaults + tokenizer " + json.dumps(args.tokenizer))
    cache = encodings.resolve_cache_dir(settings.tokenizer.cache_dir)
    for name in encodings.SPECS:
        started = time.perf_counter()
        encodings.load_encoding(name, cache)
        step(f"build {name} (Rust tables)", f"{(time.perf_counter() - started) * 1000:.0f} ms")
    encodings._BUILT.clear()  # the app below builds only what it needs, from scratch
    gc.collect()
    encodings.release_freed_memory()
    step("both encodings dropped again")

    from proxy.app import create_app

    started = time.perf_counter()
    app = create_app(settings)
    counter = app.state.proxy.counter
    loaded = ",".join(sorted(getattr(counter, "loaded", ())))
    step("create_app (builds the preloaded encodings)",
         f"{(time.perf_counter() - started) * 1000:.0f} ms; built: {loaded}")  # fmt: skip

    async def run_lifespan() -> None:
        async with app.router.lifespan_context(app):
            loaded = sorted(m for m in ("aiohttp", "redis") if m in sys.modules)
            step("lifespan start-up (warm-up)", f"imported of aiohttp, redis: {loaded}")

    asyncio.run(run_lifespan())

    assert isinstance(counter, TokenCounter)
    memo = counter._memo
    for i in range(memo.capacity):
        memo.put((i * 0x9E3779B97F4A7C15) % (1 << 63), 10 + i % 5000)
    step(f"count memo filled ({len(memo):,} of {memo.capacity:,} entries)",
         f"table of {16 * memo.capacity / 1048576:.1f} MB, allocated by create_app")  # fmt: skip
    memo.clear()

    from cachetools import LRUCache

    lru: LRUCache[int, int] = LRUCache(maxsize=memo.capacity)
    for i in range(memo.capacity):
        lru[(i * 0x9E3779B97F4A7C15) % (1 << 63)] = 10 + i % 5000
    step("(before) a cachetools LRUCache of as many counts")
    rows[-1][3] = f"{float(rows[-1][2]) * 1048576 / len(lru):.0f} B/entry"
    del lru
    _dropped("(before) LRUCache dropped", step)

    print(f"\nmemory breakdown (VmRSS MB, this process; started at {first:.1f} MB)")
    harness.print_table(["step", "VmRSS", "delta", "note"], rows)


def _dropped(what: str, step: Callable[[str], None]) -> None:
    gc.collect()
    from proxy.tokens import encodings

    encodings.release_freed_memory()
    step(what)


def snapshot(args: argparse.Namespace) -> None:
    """Run under `python -X tracemalloc=1`: Python's own allocations once the app is up, by
    package (BPE tables live in Rust and do not show here)."""
    import asyncio
    import tracemalloc

    from proxy.app import create_app
    from proxy.settings import Settings

    settings = Settings.model_validate(
        {"upstream": {"base_url": "http://127.0.0.1:9/v1"}, "tokenizer": args.tokenizer}
    )
    app = create_app(settings)

    async def run_lifespan() -> None:
        async with app.router.lifespan_context(app):
            pass

    asyncio.run(run_lifespan())
    gc.collect()
    snap = tracemalloc.take_snapshot()
    by_package: dict[str, list[float]] = {}
    for stat in snap.statistics("filename"):
        name = stat.traceback[0].filename
        if "site-packages/" in name:
            package = name.split("site-packages/", 1)[1].split("/", 1)[0]
        elif f"{harness.ROOT}/" in name:
            package = name.split(f"{harness.ROOT}/", 1)[1].split("/", 1)[0]
        elif name.startswith("<"):
            package = name  # <frozen importlib._bootstrap> and such: code objects of imports
        else:
            package = "stdlib:" + Path(name).stem
        totals = by_package.setdefault(package, [0.0, 0.0])
        totals[0] += stat.size / 1048576
        totals[1] += stat.count
    total = sum(size for size, _ in by_package.values())
    print(f"\ntracemalloc after start-up: {total:.1f} MB of Python allocations, by package")
    top = sorted(by_package.items(), key=lambda item: -item[1][0])[: args.top]
    harness.print_table(
        ["package", "MB", "blocks"],
        [[name, f"{size:.1f}", f"{count:,.0f}"] for name, (size, count) in top],
    )


# -- first request -------------------------------------------------------------------------

_FRESH_NOTE = (
    "INFORMATION ONLY (--fresh): every request's user message is new (same size), so warm "
    "requests count it too; the goal rows resend one body"
)
_BODY = {
    "model": "gpt-4o-mini",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Say hello."},
    ],
}


def _sched_ns(pid: int) -> tuple[int, int]:
    """(CPU time, run-queue wait) of every thread of `pid` so far, in ns, from schedstat
    (exact, unlike ticks). The wait is time a thread was runnable while the CPU ran
    something else: on a shared box, other processes' slices (and, with this kernel's
    PREEMPT_NONE, their long system calls) that the server has to sit out."""
    cpu = wait = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):  # a thread that just ended
            fields = (task / "schedstat").read_text().split()
            cpu, wait = cpu + int(fields[0]), wait + int(fields[1])
    return cpu, wait


def _server_has_accepted(pid: int, client_port: int) -> bool:
    """Whether the server `pid` holds the accepted end of the client's connection from
    `client_port` (a socket still in the listen backlog has no inode, nor a descriptor)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].rsplit(":", 1)[1], 16) == client_port and fields[9] in inodes:
            return True
    return False


def _connect(port: int, pid: int) -> http.client.HTTPConnection:
    """A connection the server has accepted already: request 1's clock then starts, like
    every later request's, on a connection the server is reading (without the wait, the
    server's accept of it ran inside request 1's time)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.connect()
    assert conn.sock is not None
    client_port = conn.sock.getsockname()[1]
    deadline = time.monotonic() + 10
    while not _server_has_accepted(pid, client_port):
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not accept the connection within 10 s")
        time.sleep(0.001)
    return conn


def _body(stream: bool, fresh: int | None = None) -> bytes:
    """The bench's chat body; with `fresh`, its user message is that number's own text of
    the same length ("Say 00042."), so the proxy has not counted it before."""
    body = {**_BODY, "stream": stream}
    if fresh is not None:
        user = {"role": "user", "content": f"Say {fresh % 100_000:05d}."}
        body["messages"] = [*_BODY["messages"][:-1], user]
    return json.dumps(body).encode()


def _timed_requests(
    port: int,
    pid: int | None,
    stream: bool,
    count: int,
    gap_s: float = 0.0,
    fresh: bool = False,
) -> list[tuple[float, float, float]]:
    """(wall ms, server CPU ms, server run-queue wait ms) of each request, each one sent
    `gap_s` after the last (request 1 `gap_s` after the server accepted the connection);
    CPU is steadier on a busy box. Without `pid` (the bench client warming itself up
    against the upstream) the server columns are 0. `fresh`: a new user message each time."""
    body = _body(stream)
    headers = {"content-type": "application/json", "authorization": "Bearer sk-bench"}
    if pid is None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    else:
        conn = _connect(port, pid)
    times = []
    try:
        for number in range(count):
            if fresh:
                body = _body(stream, number)
            if gap_s:
                time.sleep(gap_s)  # idle, as a server between clients' requests
            cpu, wait = _sched_ns(pid) if pid else (0, 0)
            started = time.perf_counter()
            conn.request("POST", "/v1/chat/completions", body, headers)
            response = conn.getresponse()
            response.read()
            wall = (time.perf_counter() - started) * 1000
            cpu_after, wait_after = _sched_ns(pid) if pid else (0, 0)
            times.append((wall, (cpu_after - cpu) / 1e6, (wait_after - wait) / 1e6))
            if response.status != 200:
                raise RuntimeError(f"status {response.status}")
    finally:
        conn.close()
    return times


def _first_cmd(target: str, port: int) -> list[str]:
    if target == "relay":
        return harness.uvicorn_cmd("bench.relay:create_app", port, "uvloop")
    cmd = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port)]
    if target == "proxy+probe":
        cmd = ["env", "COMPACTION_PROXY_SERVER__WARM_PROBE_S=1", *cmd]
    if target == "proxy-noconnect":
        cmd = ["env", "COMPACTION_PROXY_SERVER__WARM_CONNECT_S=0", *cmd]
    return cmd


def first_request(args: argparse.Namespace) -> None:
    env = {"COMPACTION_PROXY_SERVER__LOG_LEVEL": "warning"}
    kinds = [(target, stream) for target in args.targets for stream in (False, True)]
    runs: dict[tuple[str, bool], list[list[tuple[float, float, float]]]] = {k: [] for k in kinds}
    rest: dict[str, list[float]] = {target: [] for target in args.targets}
    upstream_pid: list[int] = []
    with harness.upstream(pids=upstream_pid) as up_port:
        env["COMPACTION_PROXY_UPSTREAM__BASE_URL"] = f"http://127.0.0.1:{up_port}/v1"
        env["BENCH_UPSTREAM"] = f"http://127.0.0.1:{up_port}"
        if args.realtime:
            harness.realtime(0)  # this client
            harness.realtime(upstream_pid[0])
        for stream in (False, True):  # the client's own first requests, not in any row
            _timed_requests(up_port, None, stream, 3)
        for start in range(args.starts):
            for target, stream in kinds:  # each kind's first request in its own process
                port = harness.free_port()
                with harness.server(_first_cmd(target, port), port, env) as srv:
                    rest[target].append(srv.rest_mb)
                    if args.realtime:  # once started: start-up runs as any process does
                        harness.realtime(srv.pid)
                    timed = _timed_requests(
                        port, srv.pid, stream, args.requests, args.gap, args.fresh
                    )
                    runs[(target, stream)].append(timed)
            print(f"  start {start + 1}/{args.starts} done", file=sys.stderr)
    spacing = f", each {args.gap:g} s after the last" if args.gap else " back to back"
    if args.realtime:
        spacing += "; client, upstream and each started server at SCHED_FIFO"
    if args.fresh:
        spacing += f"; {_FRESH_NOTE}"
    print(f"\nfirst request after start: {args.starts} fresh processes per row, request 1 vs "
          f"requests 2..{args.requests} on one keep-alive connection (accepted by the server "
          f"before the clock starts){spacing}; medians over starts of wall ms, server CPU ms "
          "and the server's run-queue wait ms (all threads, /proc schedstat); 'less wait' is "
          "wall minus that wait")  # fmt: skip

    rows, ratios = [], {}
    for target, stream in kinds:
        done = runs[(target, stream)]
        cells, found = [], []
        for which in range(4):  # wall, CPU, wait, wall less wait
            pick: Callable[[tuple[float, float, float]], float] = (
                (lambda t: t[0] - t[2]) if which == 3 else (lambda t, i=which: t[i])
            )
            first = statistics.median(pick(run[0]) for run in done)
            warm = statistics.median(statistics.median(pick(t) for t in run[1:]) for run in done)
            found.append(first / warm if warm > 0 else float("nan"))
            cells.append([f"{first:.2f}", f"{warm:.2f}", f"{found[-1]:.2f}x"])
        wall, cpu, _, net = found
        ratios[(target, stream)] = (wall, cpu, net)
        rest_mb = statistics.median(rest[target])
        shown = [*cells[0], *cells[1], *cells[2][:2], *cells[3]]  # no ratio of waits
        rows.append([target, "yes" if stream else "no", *shown, f"{rest_mb:.0f}"])
    header = ["target", "stream", "request 1 ms", "warm ms", "ratio", "request 1 CPU ms",
              "warm CPU ms", "CPU ratio", "request 1 wait ms", "warm wait ms",
              "request 1 less wait", "warm less wait", "less-wait ratio",
              "VmRSS at rest MB"]  # fmt: skip
    harness.print_table(header, rows)
    for (target, stream), (wall, cpu, net) in ratios.items():
        if target.startswith("proxy"):
            verdict = "PASS" if wall <= 2 else "FAIL"
            if args.fresh:
                verdict = "information only (--fresh)"
            print(f"  {target} stream={'yes' if stream else 'no'}: request 1 / warm {wall:.2f}x "
                  f"wall (goal <= 2x): {verdict}; {net:.2f}x less the server's run-queue "
                  f"wait, {cpu:.2f}x CPU")  # fmt: skip


def _callgrind_total(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")


def _instructions(
    target: str, stream: bool, env: dict[str, str], out: Path, fresh: bool = False
) -> list[int]:
    """Instructions of the server (all threads) for: 0.3 s idle, request 1, request 2,
    requests 3..12, each between two callgrind dumps (each window ends with 0.3 s idle)."""
    port = harness.free_port()
    cmd = _first_cmd(target, port)
    prefix = cmd[: cmd.index(sys.executable)]
    command = cmd[len(prefix) :]
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                f"--callgrind-out-file={out}/{target}-{int(stream)}.%p"]  # fmt: skip
    full_env = {**os.environ, "PYTHONPATH": str(harness.ROOT), **env}
    proc = subprocess.Popen([*prefix, *valgrind, *command], env=full_env, cwd=harness.ROOT,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    headers = {"content-type": "application/json", "authorization": "Bearer sk-bench"}
    number = 0

    def control(flag: str) -> None:
        time.sleep(0.3)  # the request's last callbacks have run
        subprocess.run(["callgrind_control", flag, str(proc.pid)], check=True,
                       capture_output=True)  # fmt: skip

    try:
        harness._wait_listening(port, proc, timeout=600)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.connect()
        control("--instr=on")
        control("--dump")
        for count in (1, 1, 10):
            for _ in range(count):
                body = _body(stream, number if fresh else None)
                number += 1
                conn.request("POST", "/v1/chat/completions", body, headers)
                response = conn.getresponse()
                response.read()
                if response.status != 200:
                    raise RuntimeError(f"status {response.status}")
            control("--dump")
        conn.close()
    finally:
        proc.terminate()
        proc.wait(60)
    dumps = sorted(out.glob(f"{target}-{int(stream)}.*.*"), key=lambda p: int(p.suffix[1:]))
    return [_callgrind_total(path) for path in dumps[:4]]


def instructions(args: argparse.Namespace) -> None:
    import tempfile

    env = {"COMPACTION_PROXY_SERVER__LOG_LEVEL": "warning"}
    rows = []
    with harness.upstream() as up_port, tempfile.TemporaryDirectory() as tmp:
        env["COMPACTION_PROXY_UPSTREAM__BASE_URL"] = f"http://127.0.0.1:{up_port}/v1"
        env["BENCH_UPSTREAM"] = f"http://127.0.0.1:{up_port}"
        for target in args.targets:
            for stream in (False, True):
                found = _instructions(target, stream, env, Path(tmp), args.fresh)
                idle, first, second, rest = found
                warm = rest / 10
                less_idle = (first - idle) / ((rest - idle) / 10)
                rows.append([target, "yes" if stream else "no", f"{idle / 1e3:.0f}",
                             f"{first / 1e3:.0f}", f"{second / 1e3:.0f}", f"{warm / 1e3:.0f}",
                             f"{first / warm:.2f}x", f"{less_idle:.2f}x"])  # fmt: skip
                print(f"  {target} stream={stream} done", file=sys.stderr)
    print(
        "\nfirst request after start, in thousands of instructions (callgrind, all threads "
        "of the server): 0.3 s idle, request 1, request 2, mean of requests 3..12; each "
        "window ends with 0.3 s idle, so 'less idle' takes one idle off request 1's window "
        "and off the ten warm requests' window" + (f"; {_FRESH_NOTE}" if args.fresh else "")
    )
    header = ["target", "stream", "idle", "request 1", "request 2", "warm (3..12)", "ratio",
              "ratio less idle"]  # fmt: skip
    harness.print_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parts = ["breakdown", "snapshot", "first", "instructions", "all"]
    parser.add_argument("part", nargs="?", choices=parts, default="all")
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument(
        "--gap", type=float, default=0.0,
        help="first: seconds idle before each request, request 1 too (default 0: back to back)",
    )  # fmt: skip
    parser.add_argument(
        "--realtime", action="store_true",
        help="first: the client, the upstream and each server once started at SCHED_FIFO "
        "(root): no other process's time slice delays a request",
    )  # fmt: skip
    parser.add_argument(
        "--targets", nargs="+", choices=["proxy", "proxy+probe", "proxy-noconnect", "relay"],
        default=["proxy", "relay"],
    )  # fmt: skip
    parser.add_argument(
        "--fresh", action="store_true",
        help="first, instructions: a new user message (same size) in every request, for "
        "information (warm requests then count it too); the goal rows resend one body",
    )  # fmt: skip
    parser.add_argument("--top", type=int, default=12, help="tracemalloc rows to print")
    parser.add_argument(
        "--tokenizer", type=json.loads, default={}, help="tokenizer settings as JSON"
    )
    args = parser.parse_args()
    harness.warn_without_tokenizer()
    if args.part == "all":  # fresh interpreters, so imports are measured from nothing
        for part, flags in (("breakdown", []), ("snapshot", ["-X", "tracemalloc=1"])):
            cmd = [sys.executable, *flags, "-m", "bench.memory", part, "--top", str(args.top),
                   "--tokenizer", json.dumps(args.tokenizer)]  # fmt: skip
            subprocess.run(cmd, cwd=harness.ROOT, check=True)
    elif args.part == "breakdown":
        breakdown(args)
    elif args.part == "snapshot":
        snapshot(args)
    if args.part in ("first", "all"):
        first_request(args)
    if args.part == "instructions":
        instructions(args)


if __name__ == "__main__":
    main()
