"""Instructions per warm request of the served proxy, keys against no keys (callgrind).

    python -m bench.served_instructions [TREE ...] --targets proxy keys-memory keys-redis \
        --concurrency 1 64 --stream no yes

Each target is bench/overhead.py's (`proxy.app:create_app` under uvicorn, uvloop +
httptools, the same environment and key), started from each source tree (default: this
one) under `valgrind --tool=callgrind --instr-atstart=no`. A client in this process sends
`--warm` requests at the cell's concurrency, then callgrind counts the server (all threads)
from just before the first of `--requests` more until 0.3 s after the last was answered,
so every counted request is whole and nothing else is in the count but the idle loop and
the usage meter's flushes (every 0.5 s). Instruction counts do not move with what else
runs on the box, so a shared box can settle a few-percent change that wall clock cannot;
they do not weigh cache misses or syscalls, so they are a CPU proxy, not a time.
Printed: thousands of instructions (kIr) per request, and each keys target minus `proxy`
of the same tree.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.loadgen import ClientProtocol, build_request, chat_body
from bench.overhead import KEY_TARGETS, _drop_redis_keys


def _callgrind_total(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")


async def _send(port: int, request: bytes, concurrency: int, count: int) -> int:
    """`count` answered requests over `concurrency` keep-alive connections (raises on a
    non-200); returns how many connections were lost (the request is sent again on a new
    one: under valgrind a server can be slow enough to drop one)."""
    loop = asyncio.get_running_loop()
    left, lost = count, 0

    async def worker() -> None:
        nonlocal left, lost
        proto: ClientProtocol | None = None
        while left > 0:
            left -= 1
            if proto is None:
                _, proto = await loop.create_connection(ClientProtocol, "127.0.0.1", port)
            try:
                status = await proto.roundtrip(request)
            except ConnectionError:
                left, lost, proto = left + 1, lost + 1, None
                continue
            if status != 200:
                raise RuntimeError(f"status {status}")
        if proto is not None and proto.transport is not None:
            proto.transport.close()

    await asyncio.gather(*(worker() for _ in range(min(concurrency, count))))
    return lost


def measure(
    tree: Path, target: str, cells: list[tuple[bool, int]], args: argparse.Namespace, out: Path
) -> list[float]:
    """Instructions per request of each (stream, concurrency) cell, one server for all."""
    port = harness.free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "COMPACTION_PROXY_SERVER__LOG_LEVEL": "warning",
        "COMPACTION_PROXY_UPSTREAM__BASE_URL": f"http://127.0.0.1:{args.up_port}/v1",
        **KEY_TARGETS.get(target, {}),
    }
    stem = f"{target}-{abs(hash(str(tree)))}"
    cmd = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no",
        f"--callgrind-out-file={out}/{stem}.%p",
        *harness.uvicorn_cmd("proxy.app:create_app", port, "uvloop"),
    ]  # fmt: skip
    if harness.PINNED:
        cmd = ["taskset", "-c", harness.SERVER_CPU, *cmd]
    stderr = None if args.verbose else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, env=env, cwd=tree, stderr=stderr)

    def control(flag: str) -> None:
        subprocess.run(["callgrind_control", flag, str(proc.pid)], check=True,
                       capture_output=True)  # fmt: skip

    try:
        harness._wait_listening(port, proc, timeout=900)
        control("--instr=on")
        for stream, conc in cells:
            request = build_request("127.0.0.1", port, chat_body("small", stream))
            asyncio.run(_send(port, request, conc, args.warm))
            time.sleep(0.3)
            control("--dump")  # zero: what ran before is in this dump
            lost = asyncio.run(_send(port, request, conc, args.requests))
            if lost:
                print(f"  ({target}: {lost} connections lost while counted)", file=sys.stderr)
            time.sleep(0.3)  # the last requests' callbacks have run
            control("--dump")
    finally:
        proc.terminate()
        proc.wait(120)
        if target == "keys-redis":
            _drop_redis_keys(KEY_TARGETS["keys-redis"]["COMPACTION_PROXY_QUOTA__KEY_PREFIX"])
    dumps = sorted(out.glob(f"{stem}.*.*"), key=lambda p: int(p.suffix[1:]))
    if len(dumps) < 2 * len(cells):
        raise RuntimeError(f"{target}: callgrind wrote {len(dumps)} dumps")
    return [_callgrind_total(dumps[2 * i + 1]) / args.requests for i in range(len(cells))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("trees", nargs="*", type=Path, default=[Path(".")])
    parser.add_argument(
        "--targets", nargs="+", default=["proxy", "keys-memory"],
        choices=["proxy", *KEY_TARGETS],
    )  # fmt: skip
    parser.add_argument("--concurrency", nargs="+", type=int, default=[64])
    parser.add_argument("--stream", nargs="+", choices=["no", "yes"], default=["no"])
    parser.add_argument("--warm", type=int, default=320)
    parser.add_argument("--requests", type=int, default=640)
    parser.add_argument("--verbose", action="store_true", help="the servers' stderr")
    args = parser.parse_args()
    harness.warn_without_tokenizer()
    cells = [(stream == "yes", conc) for stream in args.stream for conc in args.concurrency]
    found: dict[tuple[Path, str], list[float]] = {}
    with harness.upstream() as up_port, tempfile.TemporaryDirectory() as tmp:
        args.up_port = up_port
        for tree in args.trees:
            for target in args.targets:
                kir = measure(tree.resolve(), target, cells, args, Path(tmp))
                found[(tree, target)] = kir
                print(f"  {tree} {target}: {', '.join(f'{k / 1e3:,.1f}' for k in kir)} kIr/req",
                      file=sys.stderr)  # fmt: skip
    rows = []
    for i, (stream, conc) in enumerate(cells):
        for tree in args.trees:
            base = found.get((tree, "proxy"))
            for target in args.targets:
                kir = found[(tree, target)][i] / 1e3
                extra = "" if base is None or target == "proxy" else f"{kir - base[i] / 1e3:+.1f}"
                rows.append([str(tree), target, "yes" if stream else "no", str(conc),
                             f"{kir:,.1f}", extra])  # fmt: skip
    harness.print_table(["tree", "target", "stream", "conc", "kIr/req", "minus proxy"], rows)


if __name__ == "__main__":
    main()
