"""Many streams, and one huge request among streams, through one `compaction-proxy serve`.

(1) `--streams` (1,000) concurrent streaming chat requests against a pacing upstream
    (`--events` events `--pace-ms` apart): every stream must complete. Inter-chunk gaps
    (p50/p99/max) and time to first chunk, direct to the upstream vs through the proxy.
(2) `--bystanders` (20) clients streaming in a loop (events `--bystander-pace-ms` = 10 ms
    apart, so a stall shows) while one huge request is sent (`--huge-messages` tiny
    messages, 1M = ~42 MB; or 40 MB of screenshots within the default limits): the
    bystanders' gaps while it is in flight, against the same clients with no huge request.
    1M messages run with the default limits (refused early) and with the limits raised so
    that they are counted, or counted and compacted (the summarizer answers at once: what is
    left is the proxy's own work).

Placement as in harness.py: proxy on CPU 0, upstream and clients on CPU 1.
Run: python -m bench.load  (both, ~2 min; --only streams|huge, --cases baseline screenshots ...)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.harness import (
    CLIENT_CPU,
    ROOT,
    _pin,
    free_port,
    print_table,
    server,
    upstream,
    warn_without_tokenizer,
)

RAISED_LIMITS = {
    "COMPACTION_PROXY_SERVER__MAX_MESSAGES": "2000000",
    "COMPACTION_PROXY_TOKENIZER__MAX_REQUEST_TOKENS": "100000000",
}


def stream_request(port: int) -> bytes:
    body = json.dumps(
        {
            "model": "gpt-4o-mini",
            "stream": True,
            "messages": [{"role": "user", "content": "Count to ten."}],
        }
    ).encode()
    return _request(port, body)


def huge_request(port: int, messages: int, budget: int) -> bytes:
    roles = ("user", "assistant")
    history = [{"role": roles[i % 2], "content": f"m{i}"} for i in range(messages)]
    body = json.dumps({"model": "gpt-4o-mini", "messages": history}).encode()
    return _request(port, body, f"x-compaction-budget: {budget}\r\n" if budget else "")


def screenshots_request(port: int, megabytes: int) -> bytes:
    """~`megabytes` MB of chat with a 1920x1080 PNG (400 KB of base64) in every user turn:
    a big request inside the default limits, counted and then compacted (budget 20k)."""
    png = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\x0dIHDR" + struct.pack(">II", 1920, 1080)
    url = "data:image/png;base64," + base64.b64encode(png + bytes(300_000)).decode()
    history: list[dict[str, Any]] = []
    for turn in range(megabytes * 1_000_000 // len(url)):
        text = {"type": "text", "text": f"screenshot {turn}: what changed?"}
        image = {"type": "image_url", "image_url": {"url": url}}
        history.append({"role": "user", "content": [text, image]})
        history.append({"role": "assistant", "content": f"In screenshot {turn} the menu moved."})
    # gpt-4o: ~1,100 tokens per image (gpt-4o-mini bills 33x that: over max_request_tokens)
    body = json.dumps({"model": "gpt-4o", "messages": history}).encode()
    return _request(port, body, "x-compaction-budget: 20000\r\n")


def _request(port: int, body: bytes, extra: str = "") -> bytes:
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        "content-type: application/json\r\nauthorization: Bearer sk-bench\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
    ).encode()
    return head + body


# -- the client side (a subprocess on the client CPU) ---------------------------------------


async def one_stream(port: int, request: bytes) -> tuple[int, float, list[float]]:
    """(status, time to first event, arrival time of each read holding events); status -1:
    the connection broke, 0: it ended before `data: [DONE]`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    sent = time.perf_counter()
    writer.write(request)
    arrivals: list[float] = []
    status = 0
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        rest = head.split(b"\r\n\r\n", 1)[1]
        if b"data: " in rest:
            arrivals.append(time.perf_counter())
        finished = b"[DONE]" in rest
        while not finished and (data := await reader.read(65536)):
            if b"data: " in data:
                arrivals.append(time.perf_counter())
            finished = b"[DONE]" in data
        status = status if finished else 0
    except (ConnectionError, asyncio.IncompleteReadError):
        status = -1
    finally:
        writer.close()
    first = arrivals[0] - sent if arrivals else float("nan")
    return status, first, arrivals


def gaps_of(arrivals: list[float], start: float = 0.0, end: float = float("inf")) -> list[float]:
    return [b - a for a, b in itertools.pairwise(arrivals) if start <= b <= end]


def summary(values: list[float]) -> dict[str, float]:
    """Count, p50, p99 and max of samples (seconds), as the client reports them: its one
    result line stays ~100 bytes per series whatever the run's length (every sample of the
    compacted case made it ~1.2 MB, past the 128 KiB a line-reading pipe takes)."""
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    return {"n": len(ordered), "p50": at(0.5), "p99": at(0.99), "max": at(1.0)}


async def streams_client(port: int, count: int, events: int) -> dict[str, Any]:
    request = stream_request(port)
    results = await asyncio.gather(*(one_stream(port, request) for _ in range(count)))
    done = [r for r in results if r[0] == 200]
    gaps = [g for r in done for g in gaps_of(r[2])]
    statuses: dict[str, int] = {}
    for status, _, _ in results:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    return {
        "statuses": statuses,
        "completed": len(done),
        "failed": count - len(done),
        "ttfb": summary([r[1] for r in done]),
        "gaps": summary(gaps),
    }


async def huge_client(
    port: int, bystanders: int, messages: int, budget: int, alone_s: float
) -> dict[str, Any]:
    """Bystanders stream in a loop; with `messages`, one huge request goes out among them."""
    request = stream_request(port)
    if messages < 0:  # -N: N MB of screenshots
        big = screenshots_request(port, -messages)
    else:
        big = huge_request(port, messages, budget) if messages else b""
    arrivals: list[list[float]] = [[] for _ in range(bystanders)]
    stop = asyncio.Event()
    failures = 0

    async def bystander(index: int) -> None:
        nonlocal failures
        while not stop.is_set():
            status, _, times = await one_stream(port, request)
            failures += status != 200
            arrivals[index].extend(times)

    tasks = [asyncio.create_task(bystander(i)) for i in range(bystanders)]
    await asyncio.sleep(1.0)  # bystanders in steady state first
    start = time.perf_counter()
    huge: dict[str, Any] = {}
    if big:  # sent by another process: copying 40 MB into a socket would stall this loop too
        with tempfile.NamedTemporaryFile(prefix="bench-load-") as file:
            file.write(big)
            file.flush()
            sender = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.load", "send", str(port), file.name,
                stdout=asyncio.subprocess.PIPE, cwd=ROOT,
            )  # fmt: skip
            out, _ = await sender.communicate()
        huge = {**json.loads(out), "bytes": len(big)}
    else:
        await asyncio.sleep(alone_s)
    end = time.perf_counter()
    stop.set()
    await asyncio.gather(*tasks)
    gaps = [g for times in arrivals for g in gaps_of(times, start, end)]
    return {"seconds": end - start, "gaps": summary(gaps), "failures": failures, "huge": huge}


def send_main(port: int, path: str) -> None:
    """Send one prepared request; print its status, compaction status and error code."""
    import socket

    with open(path, "rb") as file:
        data = file.read()
    answer, failure = b"", ""
    try:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(data)
            while chunk := sock.recv(1 << 20):
                answer += chunk
    except OSError as exc:  # the proxy closed early: a row of the table, not a crash
        failure = type(exc).__name__
    status = int(answer.split(b" ", 2)[1]) if answer else -1
    compaction = _header(answer, b"x-compaction-status")
    code = _error_code(answer) or failure
    print(json.dumps({"status": status, "compaction": compaction, "code": code}))


def _header(answer: bytes, name: bytes) -> str:
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    for line in head.split(b"\r\n"):
        if line.startswith(name + b":"):
            return line.split(b":", 1)[1].strip().decode()
    return ""


def _error_code(answer: bytes) -> str:
    try:
        return str(json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"])
    except (ValueError, KeyError, IndexError, TypeError):
        return ""


def client_main(argv: list[str]) -> None:
    import uvloop

    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["streams", "huge"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--events", type=int, default=10)
    parser.add_argument("--messages", type=int, default=0)
    parser.add_argument("--budget", type=int, default=0)
    parser.add_argument("--alone-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.mode == "streams":
        result = uvloop.run(streams_client(args.port, args.count, args.events))
    else:
        client = huge_client(args.port, args.count, args.messages, args.budget, args.alone_s)
        result = uvloop.run(client)
    print(json.dumps(result))


# -- the driver -------------------------------------------------------------------------------


def run_client(*args: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.load", "client", *args]
    out = subprocess.run(
        _pin(CLIENT_CPU, cmd), cwd=ROOT, capture_output=True, text=True, check=True, timeout=900
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def proxy_cmd(port: int, upstream_port: int) -> list[str]:
    return [
        sys.executable, "-m", "proxy.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--upstream", f"http://127.0.0.1:{upstream_port}/v1", "--log-level", "warning",
    ]  # fmt: skip


def ms(series: dict[str, float], which: str) -> str:
    """One statistic of a client's `summary`, in ms."""
    return f"{series[which] * 1000:.1f}" if series["n"] else "-"


def streams_table(upstream_port: int, proxy_port: int, args: argparse.Namespace) -> None:
    rows = []
    for name, port in (("direct", upstream_port), ("proxy", proxy_port)):
        run_client("streams", "--port", str(port), "--count", "50", "--events", str(args.events))
        r = run_client("streams", "--port", str(port), "--count", str(args.streams),
                       "--events", str(args.events))  # fmt: skip
        if r["failed"]:
            print(f"{name}: outcomes {r['statuses']}", file=sys.stderr)
        rows.append([
            name, f"{r['completed']}/{args.streams}", ms(r["gaps"], "p50"), ms(r["gaps"], "p99"),
            ms(r["gaps"], "max"), ms(r["ttfb"], "p50"), ms(r["ttfb"], "p99"),
        ])  # fmt: skip
    print(f"\n(1) {args.streams} concurrent streams, {args.events} events {args.pace_ms:g} ms")
    print("    apart, after a warm-up round of 50 streams per target")
    header = ["target", "completed", "gap p50 ms", "gap p99 ms", "gap max ms", "ttfb p50 ms",
              "ttfb p99 ms"]  # fmt: skip
    print_table(header, rows)


def huge_table(upstream_port: int, args: argparse.Namespace) -> None:
    rows = []
    cases = {  # name, proxy environment, messages, x-compaction-budget
        "baseline": ("none (baseline)", {}, 0, 0),
        "default": ("default limits", {}, args.huge_messages, 0),
        "screenshots": ("40 MB of screenshots, default limits", {}, -40, 0),
        "at-limit": ("50k tiny messages (the limit), compacted", {}, 50_000, 0),
        "counted": ("limits raised, counted only", RAISED_LIMITS, args.huge_messages, 10**9),
        "compacted": ("limits raised, compacted", RAISED_LIMITS, args.huge_messages, 0),
    }
    for name, env, messages, budget in (cases[case] for case in args.cases):
        port = free_port()
        with server(proxy_cmd(port, upstream_port), port, env=env):
            r = run_client("huge", "--port", str(port), "--count", str(args.bystanders),
                           "--messages", str(messages), "--budget", str(budget))  # fmt: skip
        huge = r["huge"]
        answer = (
            f"{huge['status']} {huge['code'] or huge['compaction']}, {huge['bytes'] / 1e6:.0f} MB"
            if huge
            else "-"
        )
        rows.append([
            name, answer, f"{r['seconds']:.2f}", str(r["gaps"]["n"]), ms(r["gaps"], "p50"),
            ms(r["gaps"], "p99"), ms(r["gaps"], "max"), str(r["failures"]),
        ])  # fmt: skip
    print(
        f"\n(2) {args.bystanders} bystander streams ({args.bystander_pace_ms:g} ms pacing) while "
        f"one huge request is in flight ({args.huge_messages} tiny messages, or 40 MB of images)"
    )
    header = ["huge request", "its answer", "in flight s", "gaps", "gap p50 ms", "gap p99 ms",
              "worst gap ms", "bystander errors"]  # fmt: skip
    print_table(header, rows)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        client_main(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "send":
        send_main(int(sys.argv[2]), sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=["streams", "huge"])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--events", type=int, default=10)
    parser.add_argument("--pace-ms", type=float, default=100.0)
    parser.add_argument("--bystanders", type=int, default=20)
    parser.add_argument("--bystander-pace-ms", type=float, default=10.0)
    parser.add_argument("--huge-messages", type=int, default=1_000_000)
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["baseline", "default", "screenshots", "at-limit", "counted", "compacted"],
    )
    args = parser.parse_args()
    warn_without_tokenizer()
    if args.only in (None, "streams"):
        pace = ["--pace-ms", str(args.pace_ms), "--events", str(args.events)]
        with upstream("fast", pace) as upstream_port:
            port = free_port()
            with server(proxy_cmd(port, upstream_port), port):
                streams_table(upstream_port, port, args)
    if args.only in (None, "huge"):
        pace = ["--pace-ms", str(args.bystander_pace_ms), "--events", "50"]
        with upstream("fast", pace) as upstream_port:
            huge_table(upstream_port, args)


if __name__ == "__main__":
    main()
