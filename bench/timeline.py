"""Where the wall time of one c1 request goes, hop by hop (Linux `perf`, root).

    python -m bench.timeline --targets proxy keys-memory keys-redis [--redis-url URL]

Starts bench/overhead.py's servers (and its upstream, pinned as there), sends c1 load to each
in turn and records the kernel's scheduler and syscall tracepoints on every CPU for
`--seconds` (`perf record -a`: sched_wakeup, sched_switch, raw_syscalls). A request is
split at the load generator's write; in it, every event of the four processes that matter
(load generator, server, upstream, redis-server) is kept: a write or a read with data, a
wake-up (who woke whom, which CPU), a switch onto or off a CPU. Requests with the usual
sequence of events are lined up and the median time of each event from the request's write
is printed, with the step from the one before, so a hop reads as: the writer's syscall, the
wake-up it caused, the wait until the woken process runs, what it did until its own write.

`--redis-url`: the keys-redis target's Redis (default the shared 127.0.0.1:6379; a private
`redis-server --port N` keeps other people's traffic out of the trace). `--realtime`: the
load generator, the upstream and the servers (and a private Redis, never the shared one) at
SCHED_FIFO, so on a busy box other processes' time slices do not sit in the timeline; the
CPUs are then busy, not idle, while the request waits, so a wake-up costs what it costs on a
busy CPU, not the exit from an idle one. Tracepoints cost ~1 us each, so the absolute
numbers are a little slower than untraced; compare targets.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import harness
from bench.overhead import KEY_TARGETS, _drop_redis_keys

_SHARED_REDIS = "redis://127.0.0.1:6379/0"
_WRITES = {1: "write", 20: "writev", 44: "sendto", 46: "sendmsg"}
_READS = {0: "read", 19: "readv", 45: "recvfrom", 47: "recvmsg"}
_LINE = re.compile(r"^\s*(?P<comm>.+?)\s+(?P<pid>-?\d+)/(?P<tid>-?\d+)\s+\[(?P<cpu>\d+)\]\s+"
                   r"(?P<time>[\d.]+):\s+(?P<event>[\w:]+):\s*(?P<rest>.*)$")  # fmt: skip


@dataclass(frozen=True)
class Event:
    at: float  # seconds
    who: str  # "client", "server", "upstream", "redis"
    what: str  # "write", "read", "woken by X on cpuN", "on cpuN", "off cpu"
    detail: str = ""


def parse(lines: list[str], roles: dict[int, str]) -> list[Event]:
    """The events of the processes in `roles` (tid -> role), in time order."""
    events: list[Event] = []
    entered: dict[int, tuple[int, float, str]] = {}
    for line in lines:
        m = _LINE.match(line)
        if m is None:
            continue
        tid, at, event, rest = int(m["tid"]), float(m["time"]), m["event"], m["rest"]
        cpu = int(m["cpu"])
        if event == "raw_syscalls:sys_enter":
            if tid in roles:
                nr = int(rest.split()[1])
                fd = rest.split("(", 1)[1].split(",", 1)[0] if "(" in rest else ""
                entered[tid] = (nr, at, fd)
                if nr in _WRITES:
                    events.append(Event(at, roles[tid], "write", f"fd {int(fd, 16)}"))
        elif event == "raw_syscalls:sys_exit":
            if tid in roles and tid in entered:
                nr, _, fd = entered.pop(tid)
                ret = int(rest.rsplit("=", 1)[1])
                if nr in _READS and ret > 0:
                    events.append(Event(at, roles[tid], "read", f"fd {int(fd, 16)}, {ret} B"))
        elif event == "sched:sched_wakeup":
            fields = dict(f.split("=", 1) for f in rest.split() if "=" in f)
            target = int(fields["pid"])
            if target in roles:
                waker = roles.get(tid, "other")
                where = f"cpu{int(fields['target_cpu'])}"
                events.append(Event(at, roles[target], f"woken by {waker} on {where}"))
        elif event == "sched:sched_switch":
            prev = int(re.search(r"prev_pid=(-?\d+)", rest)[1])  # type: ignore[index]
            nxt = int(re.search(r"next_pid=(-?\d+)", rest)[1])  # type: ignore[index]
            if prev in roles:
                state = re.search(r"prev_state=(\S+)", rest)[1]  # type: ignore[index]
                events.append(Event(at, roles[prev], "off cpu", state))
            if nxt in roles:
                events.append(Event(at, roles[nxt], f"on cpu{cpu}"))
    events.sort(key=lambda e: e.at)
    return events


def requests(events: list[Event]) -> list[list[Event]]:
    """Split at the client's writes (one per request at c1)."""
    out: list[list[Event]] = []
    for event in events:
        if event.who == "client" and event.what == "write":
            out.append([event])
        elif out:
            out[-1].append(event)
    return out[1:-1]  # the first and the last may be cut by the recording


def summarize(reqs: list[list[Event]]) -> tuple[int, int, list[tuple[str, float, float]]]:
    """(requests, how many share the usual sequence, [(step, median us from the write, median
    us from the step before)])."""
    shapes = collections.Counter(tuple((e.who, e.what) for e in r) for r in reqs)
    if not shapes:
        return 0, 0, []
    shape, count = shapes.most_common(1)[0]
    same = [r for r in reqs if tuple((e.who, e.what) for e in r) == shape]
    rows = []
    for i, (who, what) in enumerate(shape):
        since = statistics.median((r[i].at - r[0].at) * 1e6 for r in same)
        step = statistics.median((r[i].at - r[i - 1].at) * 1e6 for r in same) if i else 0.0
        detail = same[0][i].detail
        rows.append((f"{who} {what}" + (f" ({detail})" if detail else ""), since, step))
    return len(reqs), count, rows


def _record(seconds: float, out: Path) -> list[str]:
    events = "sched:sched_switch,sched:sched_wakeup,raw_syscalls:sys_enter,raw_syscalls:sys_exit"
    subprocess.run(
        ["perf", "record", "-q", "-a", "-e", events, "-o", str(out), "--", "sleep", str(seconds)],
        check=True, capture_output=True,
    )  # fmt: skip
    script = subprocess.run(
        ["perf", "script", "-i", str(out), "-F", "comm,pid,tid,cpu,time,event,trace"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return script.stdout.splitlines()


def _wait_serving(pid: int, limit_s: float = 60.0) -> None:
    """Until the server has been busy for a while (the load generator started, warmed up)."""
    deadline = time.monotonic() + limit_s
    busy = 0
    while time.monotonic() < deadline and busy < 4:
        before = harness.cpu_seconds(pid)
        time.sleep(0.2)
        busy = busy + 1 if harness.cpu_seconds(pid) - before > 0.02 else 0


def _redis_pid(url: str) -> int:
    from redis import Redis

    client = Redis.from_url(url, socket_timeout=5)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--targets", nargs="+", default=["proxy", "keys-memory", "keys-redis"],
                        choices=["proxy", *KEY_TARGETS])  # fmt: skip
    parser.add_argument("--stream", choices=["no", "yes"], default="no")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--redis-url", default=_SHARED_REDIS)
    parser.add_argument("--realtime", action="store_true", help="SCHED_FIFO (see above)")
    args = parser.parse_args()
    harness.warn_without_tokenizer()
    redis_env = {"COMPACTION_PROXY_QUOTA__REDIS_URL": args.redis_url}
    redis_pid = _redis_pid(args.redis_url) if "keys-redis" in args.targets else -1
    env = {"COMPACTION_PROXY_SERVER__LOG_LEVEL": "warning"}
    pids: list[int] = []
    results = {}
    with harness.upstream(pids=pids) as up_port, contextlib.ExitStack() as stack:
        env["COMPACTION_PROXY_UPSTREAM__BASE_URL"] = f"http://127.0.0.1:{up_port}/v1"
        servers = {}
        for target in args.targets:
            port = harness.free_port()
            cmd = harness.uvicorn_cmd("proxy.app:create_app", port, "uvloop")
            target_env = env | KEY_TARGETS.get(target, {})
            if target == "keys-redis":
                target_env |= redis_env
            servers[target] = stack.enter_context(harness.server(cmd, port, target_env))
            if args.realtime:
                harness.realtime(servers[target].pid)
        if args.realtime:
            harness.realtime(pids[0])
            if redis_pid > 0 and args.redis_url != _SHARED_REDIS:
                harness.realtime(redis_pid)
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for target, srv in servers.items():
            load = subprocess.Popen(harness._pin(harness.CLIENT_CPU, [
                sys.executable, "-m", "bench.loadgen", "--port", str(srv.port),
                "--concurrency", "1", "--duration", str(args.seconds + 3), "--warmup", "0.5",
                *(["--stream"] if args.stream == "yes" else []),
            ]), cwd=harness.ROOT, stdout=subprocess.PIPE, text=True)  # fmt: skip
            if args.realtime:
                harness.realtime(load.pid)
            _wait_serving(srv.pid)
            roles = {srv.pid: "server", pids[0]: "upstream", load.pid: "client"}
            if target == "keys-redis":
                roles[redis_pid] = "redis"
            lines = _record(args.seconds, tmp / f"{target}.data")
            stdout, _ = load.communicate(timeout=60)
            events = parse(lines, roles)
            if os.environ.get("TIMELINE_DEBUG"):
                seen = collections.Counter((e.who, e.what) for e in events)
                print(f"{target}: {len(lines)} lines, {roles}, {seen}", file=sys.stderr)
            results[target] = (summarize(requests(events)), json.loads(stdout))
    if "keys-redis" in args.targets:
        _drop_redis_keys(KEY_TARGETS["keys-redis"]["COMPACTION_PROXY_QUOTA__KEY_PREFIX"])
    for target, ((total, same, rows), load_result) in results.items():
        print(f"\n{target}: {same} of {total} traced requests in the usual sequence; "
              f"loadgen p50 over its whole run {load_result['p50_ms']:.3f} ms (loadgen, "
              f"{os.cpu_count()} CPUs, server on CPU {harness.SERVER_CPU})")  # fmt: skip
        harness.print_table(
            ["event", "us from the write", "step us"],
            [[name, f"{since:.0f}", f"{step:+.0f}"] for name, since, step in rows],
        )


if __name__ == "__main__":
    main()
