"""Proxy time of agent turns on long histories: reused and extended turns vs a passthrough.

    python -m bench.turns                  # both tables, ~1-2 min
    python -m bench.turns --only grow      # (a) only; --only compare: (b) only

Measured in-process: each request is one direct call of the ASGI app (`proxy.app.create_app`
as users build it), the body handed over in one `http.request` message, the upstream an
`httpx.MockTransport` that answers at once with a canned completion (and, for summarizer
calls, a deterministic ~200-token summary). "Proxy time" is the wall time from the app call
to the last response byte: reading the body, parsing, counting, cutting, hashing, the store
lookup, re-encoding, the upstream client's own work and relaying the reply. No sockets, so
nothing of the kernel's or of an HTTP server's time is in it; the same harness times the
passthrough (`x-compaction: off`), so the ratios compare like with like. For extended turns
the mock summarizer's own time is subtracted (what is left is the proxy's).

(a) One simulated coding-agent session (bench/agent_session.py: a system prompt, a task,
    then per turn an assistant tool call and a tool result of 50..1500 tokens, a user message
    every 8-12 turns) grown turn by turn from ~1k to 256k tokens, budget `--grow-budget`
    (4k, so compaction runs from the first buckets on). Each turn is sent once with
    compaction on and once with `x-compaction: off`; per size bucket the median proxy time
    of each kind of turn. Flat means: what a reused turn costs over a passthrough of the same
    body does not grow with the history.
(b) The ~128k-token turn of the same session, budget `--budget` (32k): the median of
    `--samples` interleaved samples of (i) `orjson.loads` and `json.loads` of the body,
    (ii) a passthrough, (iii) a reused turn (the previous turn was compacted, under a tenant
    of its own, so the store holds its summary) and (iv) an extended turn (the turn
    `--extend-back` turns earlier was compacted: the stored summary is extended over the new
    span with one summarizer request). Then the goals as PASS/FAIL: they are for turns with
    no summarizer call, the reused row; the extended row's ratios are printed beside them
    for information, since its time includes the proxy's side of a summarizer request.

Not a test: prints tables, exits 0 either way.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.agent_session import MODEL, TOOLS, Message, agent_session, count
from proxy.app import create_app
from proxy.compaction.prompt import SYSTEM_PROMPT
from proxy.settings import Settings

try:
    import orjson
except ImportError:  # the comparison still runs, without the fastest parser
    orjson = None  # type: ignore[assignment]

UPSTREAM = "http://upstream.bench/v1"
GOAL_VS_PARSE = 2.0  # a turn with no summarizer call at most this many orjson.loads of its body
GOAL_VS_PASSTHROUGH = 1.5  # and at most this many passthroughs of the same body
_SUMMARIZER = SYSTEM_PROMPT.encode()

_REPLY = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Running the tests."},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": 4, "total_tokens": 4},
    }
).encode()


# A Response of the same size class, for requests on /v1/responses.
RESPONSE_REPLY = json.dumps(
    {
        "id": "resp_bench",
        "object": "response",
        "model": MODEL,
        "status": "completed",
        "output": [
            {
                "id": "msg_bench",
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Running the tests."}],
            }
        ],
        "usage": {"input_tokens": 0, "output_tokens": 4, "total_tokens": 4},
    }
).encode()


@dataclass
class Mock:
    """The upstream: a canned reply; summarizer calls get a summary derived from their input."""

    seconds: float = 0.0  # spent answering summarizer calls
    summaries: int = 0
    last: bytes = b""  # the last forwarded (not summarizer) body

    def __call__(self, request: httpx.Request) -> httpx.Response:
        content = request.content
        if _SUMMARIZER not in content[:512]:
            self.last = content
            reply = RESPONSE_REPLY if request.url.path.endswith("/responses") else _REPLY
            return httpx.Response(200, content=reply, headers={"content-type": "application/json"})
        started = time.perf_counter()
        digest = hashlib.blake2b(content, digest_size=8).hexdigest()
        text = " ".join(f"Step {i} of {digest}: tests pass, parser fixed." for i in range(20))
        reply = {
            "id": "chatcmpl-summary",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1000, "completion_tokens": 200, "total_tokens": 1200},
        }
        self.summaries += 1
        response = httpx.Response(200, json=reply)
        self.seconds += time.perf_counter() - started
        return response


@dataclass
class Result:
    status: str
    tokens: int
    ms: float  # wall time
    cpu_ms: float  # CPU time of the whole process (every thread) meanwhile


@dataclass
class Proxy:
    """One app and its mock upstream; `send` is one request, timed."""

    budget: int
    mock: Mock = field(default_factory=Mock)

    def __post_init__(self) -> None:
        settings = Settings.model_validate(
            {
                "upstream": {"base_url": UPSTREAM},
                "compaction": {"budget_tokens": self.budget, "summarizer": {"retries": 0}},
                "cache": {"backend": "memory"},
                "server": {"max_messages": 1_000_000},
            }
        )
        self.app = create_app(settings, transport=httpx.MockTransport(self.mock))

    async def send(
        self,
        body: bytes,
        *,
        tenant: str = "bench",
        off: bool = False,
        path: str = "/v1/chat/completions",
    ) -> Result:
        headers = [
            (b"host", b"proxy"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"authorization", f"Bearer sk-{tenant}".encode()),
        ]
        if off:
            headers.append((b"x-compaction", b"off"))
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": headers,
            "client": ("127.0.0.1", 40000),
            "server": ("proxy", 80),
        }
        done = asyncio.Event()
        delivered = False
        status: list[int] = []
        reply_headers: dict[bytes, bytes] = {}

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                reply_headers.update(message["headers"])
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                done.set()

        mock_before = self.mock.seconds
        cpu = time.process_time()
        started = time.perf_counter()
        await self.app(scope, receive, send)
        mock = self.mock.seconds - mock_before
        elapsed = time.perf_counter() - started - mock
        cpu = time.process_time() - cpu - mock
        done.set()
        if status != [200]:
            raise RuntimeError(f"HTTP {status}")
        kind = reply_headers.get(b"x-compaction-status", b"?").decode()
        tokens = int(reply_headers.get(b"x-compaction-tokens-before", b"0") or 0)
        return Result(kind, tokens, elapsed * 1000, cpu * 1000)

    async def close(self) -> None:
        state = self.app.state.proxy
        await state.compactor.planner.flight.local.join()
        await state.compactor.store.close()
        await state.upstream.client.aclose()
        state.counter.close()


def encode(history: list[Message]) -> bytes:
    """The client's body, as the OpenAI Python SDK (httpx) writes it."""
    return json.dumps(
        {"model": MODEL, "messages": history, "tools": TOOLS},
        ensure_ascii=False,
        separators=(",", ":"),
    ).encode()


def history_tokens(history: list[Message]) -> int:
    return sum(count(json.dumps(m, ensure_ascii=False)) for m in history)


def session_to(tokens: int) -> list[list[Message]]:
    """The session's turns, until its history passes `tokens` (about 1.4 turns per 1k)."""
    turns = int(tokens / 700) + 20
    sessions = agent_session(turns=turns)
    size = 0
    for index, history in enumerate(sessions):
        if index % 10 == 0:
            size = history_tokens(history)
            if size > tokens:
                return sessions[: index + 1]
    return sessions


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [" | ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


# -- (a) one session, grown ----------------------------------------------------------------


async def grow(sessions: list[list[Message]], budget: int) -> None:
    proxy = Proxy(budget)
    buckets: dict[int, dict[str, list[float]]] = {}
    try:
        for history in sessions:
            body = encode(history)
            on = await proxy.send(body)
            off = await proxy.send(body, off=True)
            low = 1000
            while low * 2 <= on.tokens:
                low *= 2
            cells = buckets.setdefault(low, {})
            cells.setdefault("off", []).append(off.cpu_ms)
            cells.setdefault(on.status, []).append(on.cpu_ms)
            if on.status in ("reused", "extended"):
                cells.setdefault(on.status + "-off", []).append(on.cpu_ms - off.cpu_ms)
                cells.setdefault("wall " + on.status, []).append(on.ms)
    finally:
        await proxy.close()
    rows = []
    for low in sorted(buckets):
        cells = buckets[low]

        def cell(name: str, cells: dict[str, list[float]] = cells) -> str:
            values = cells.get(name, [])
            return f"{_fmt(_median(values))} ({len(values)})" if values else "-"

        reused = _median(cells.get("reused", []))
        off = _median(cells["off"])
        rows.append(
            [
                f"{low // 1000}k-{2 * low // 1000}k",
                cell("off"),
                cell("passthrough"),
                cell("reused"),
                cell("extended"),
                cell("reused-off"),
                cell("extended-off"),
                "-" if reused is None or off is None else f"{reused / off:.2f}x",
                cell("wall reused"),
            ]
        )
    print(
        f"(a) one session grown turn by turn, budget {budget:,} tokens; "
        "proxy CPU ms per turn, median (turns)"
    )
    print(
        table(
            [
                "history",
                "x-compaction: off",
                "under budget",
                "reused",
                "extended",
                "reused - off",
                "extended - off",
                "reused / off",
                "wall ms reused",
            ],
            rows,
        )
    )


# -- (b) the 128k-token turn ---------------------------------------------------------------


def timed(fn: Callable[[], object], repeat: int = 5) -> tuple[float, float]:
    """Median wall and CPU ms of `repeat` calls."""
    walls, cpus = [], []
    for _ in range(repeat):
        cpu = time.process_time()
        started = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - started)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls) * 1000, statistics.median(cpus) * 1000


async def compare(
    sessions: list[list[Message]], target: int, budget: int, samples: int, back: int
) -> None:
    index = next(i for i, h in enumerate(sessions) if history_tokens(h) >= target)
    bodies = {i: encode(sessions[i]) for i in (index - back, index - 1, index)}
    body = bodies[index]
    tokens = history_tokens(sessions[index])
    proxy = Proxy(budget)
    names = ("orjson.loads", "json.loads", "passthrough", "reused", "extended")
    walls: dict[str, list[float]] = {name: [] for name in names}
    cpus: dict[str, list[float]] = {name: [] for name in names}
    statuses: dict[str, set[str]] = {"reused": set(), "extended": set()}

    def note(name: str, result: Result) -> None:
        walls[name].append(result.ms)
        cpus[name].append(result.cpu_ms)
        if name in statuses:
            statuses[name].add(result.status)

    try:
        for warm in range(2):  # first calls load and warm everything; not counted
            await proxy.send(body, off=True)
            await proxy.send(bodies[index - 1], tenant=f"warm{warm}")
            await proxy.send(body, tenant=f"warm{warm}")
        for sample in range(samples):
            for name, parse in (
                ("orjson.loads", orjson and orjson.loads),
                ("json.loads", json.loads),
            ):
                if parse:
                    wall, cpu = timed(lambda parse=parse: parse(body))  # type: ignore[misc]
                    walls[name].append(wall)
                    cpus[name].append(cpu)
            note("passthrough", await proxy.send(body, off=True))
            await proxy.send(bodies[index - 1], tenant=f"reuse{sample}")
            note("reused", await proxy.send(body, tenant=f"reuse{sample}"))
            await proxy.send(bodies[index - back], tenant=f"extend{sample}")
            note("extended", await proxy.send(body, tenant=f"extend{sample}"))
    finally:
        await proxy.close()
    wall = {name: _median(values) for name, values in walls.items()}
    cpu = {name: _median(values) for name, values in cpus.items()}
    parser = "orjson.loads" if cpu["orjson.loads"] else "json.loads"
    print(
        f"\n(b) a {tokens:,}-token history ({len(sessions[index])} messages, "
        f"{len(body) / 1024:,.0f} KB), budget {budget:,}; median of {samples} samples"
    )
    rows = []
    for name in names:
        seen = statuses.get(name)
        label = name if not seen else f"{name} (status: {', '.join(sorted(seen))})"
        c, w = cpu[name], wall[name]
        rows.append(
            [
                label,
                _fmt(c, ".3f"),
                _fmt(w, ".3f"),
                _ratio(c, cpu[parser]),
                _ratio(c, cpu["passthrough"]),
                _ratio(w, wall["passthrough"]),
            ]
        )
    print(
        table(
            [
                "",
                "CPU ms",
                "wall ms",
                f"CPU vs {parser}",
                "CPU vs passthrough",
                "wall vs passthrough",
            ],
            rows,
        )
    )
    print(
        "goals, for a turn with no summarizer call (CPU time: the machine is shared, "
        "wall time moves with the neighbours):"
    )
    for base, goal in ((parser, GOAL_VS_PARSE), ("passthrough", GOAL_VS_PASSTHROUGH)):
        value, against = cpu["reused"], cpu[base]
        assert value is not None and against is not None
        verdict = "PASS" if value <= goal * against else "FAIL"
        print(f"  reused vs {base}: {value / against:.2f}x (goal <= {goal}x): {verdict}")
    print("informational, includes one summarizer request (its mock's time subtracted):")
    for base in (parser, "passthrough"):
        print(f"  extended vs {base}: {_ratio(cpu['extended'], cpu[base])}")


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=("grow", "compare"))
    parser.add_argument("--max-tokens", type=int, default=256_000)
    parser.add_argument("--grow-budget", type=int, default=4_000)
    parser.add_argument("--target", type=int, default=128_000)
    parser.add_argument("--budget", type=int, default=32_000)
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--extend-back", type=int, default=40)
    args = parser.parse_args()
    logging.disable(logging.INFO)
    sessions = session_to(max(args.max_tokens, args.target + 10_000))
    gc.collect()
    gc.freeze()  # the session's own objects are not the proxy's to scan
    if args.only in (None, "grow"):
        await grow(sessions, args.grow_budget)
    if args.only in (None, "compare"):
        await compare(sessions, args.target, args.budget, args.samples, args.extend_back)


if __name__ == "__main__":
    asyncio.run(main())
