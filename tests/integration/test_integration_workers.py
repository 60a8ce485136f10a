"""`compaction-proxy serve` as operators run it: `--workers 2` (both workers serve, their
metrics add up in one scrape, every line is JSON, the metrics files go at exit) and the
drain on SIGTERM (`server.drain_timeout_s`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import PIECES, REPLY_TEXT, WAIT_S, FakeUpstream, ServerThread
from tests.integration.harness import closed_port as free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
START_S = 60.0  # two interpreters importing and loading the tokenizer on a loaded machine
CHAT_ROUTE = "/v1/chat/completions"
REQUESTS = "compaction_proxy_requests_total"


@dataclass
class Served:
    base: str
    process: subprocess.Popen[bytes]
    stderr: Path
    tmp: Path

    def metrics_dir(self) -> Path:
        (found,) = self.tmp.glob("compaction-proxy-metrics-*")
        return found


def start_serve(
    upstream: ServerThread, tmp: Path, *flags: str, env: dict[str, str] | None = None
) -> Served:
    """`compaction-proxy serve` on a free port against the fake upstream, once ready."""
    port = free_port()
    stderr = tmp / "stderr.log"
    full_env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    full_env |= {"TMPDIR": str(tmp), **(env or {})}  # TMPDIR: where serve makes its metrics dir
    command = [
        sys.executable, "-m", "proxy.cli", "serve", "--upstream", f"{upstream.url}/v1",
        "--port", str(port), "--log-format", "json", *flags,
    ]  # fmt: skip
    with stderr.open("wb") as sink:
        process = subprocess.Popen(
            command, cwd=REPO, env=full_env, stdout=subprocess.DEVNULL, stderr=sink
        )
    served = Served(f"http://127.0.0.1:{port}", process, stderr, tmp)
    deadline = time.monotonic() + START_S
    while True:  # bounded poll of readiness
        if process.poll() is not None:
            pytest.fail(f"serve exited: {stderr.read_text()}")
        try:
            if httpx.get(f"{served.base}/readyz", timeout=2).status_code == 200:
                return served
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            stop(served)
            pytest.fail("serve did not become ready")
        time.sleep(0.05)


def wait_for_started_workers(served: Served, workers: int) -> None:
    """Bounded poll of stderr until `workers` processes have logged their start-up's end."""
    deadline = time.monotonic() + START_S
    while served.stderr.read_text().count("Application startup complete") < workers:
        if served.process.poll() is not None or time.monotonic() > deadline:
            stop(served)
            pytest.fail(f"not all {workers} workers started: {served.stderr.read_text()}")
        time.sleep(0.05)


def stop(served: Served) -> None:
    served.process.terminate()
    try:
        served.process.wait(WAIT_S * 4)
    except subprocess.TimeoutExpired:
        served.process.kill()
        served.process.wait(WAIT_S)


@pytest.fixture
def two_workers(
    upstream_server: tuple[FakeUpstream, ServerThread], tmp_path: Path
) -> Iterator[Served]:
    served = start_serve(upstream_server[1], tmp_path, "--workers", "2")
    try:
        # /readyz answered by one worker says nothing of the other, which may still be
        # loading the tokenizer on a busy machine and would leave every request to the first.
        wait_for_started_workers(served, 2)
        yield served
    finally:
        stop(served)


def chat(base: str) -> int:
    # A fresh connection per request, so the kernel hands requests to either worker.
    with httpx.Client(timeout=WAIT_S * 2) as client:
        response = client.post(
            f"{base}/v1/chat/completions",
            json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": "Bearer sk-test", "connection": "close"},
        )
    return response.status_code


def per_worker_chat_requests(directory: Path) -> dict[str, float]:
    """Each worker's own count of answered chat requests, read from its file alone."""
    counts: dict[str, float] = {}
    for path in directory.glob("counter_*.db"):
        pid = path.stem.split("_")[-1]
        total = 0.0
        for family in MultiProcessCollector.merge([str(path)], accumulate=True):
            for sample in family.samples:
                if sample.name == REQUESTS and sample.labels.get("route") == CHAT_ROUTE:
                    total += sample.value
        counts[pid] = total
    return counts


def test_two_workers_share_the_port_and_their_counters_add_up(two_workers: Served) -> None:
    base = two_workers.base
    sent = 0
    with ThreadPoolExecutor(max_workers=8) as pool:
        while True:
            assert all(status == 200 for status in pool.map(chat, [base] * 8))
            sent += 8
            counts = per_worker_chat_requests(two_workers.metrics_dir())
            if len([pid for pid, n in counts.items() if n > 0]) >= 2:
                break
            assert sent < 400, f"one worker served everything: {counts}"

    scrape = httpx.get(f"{base}/metrics", timeout=WAIT_S).text
    total = 0.0
    pids: set[str] = set()
    for family in text_string_to_metric_families(scrape):
        for sample in family.samples:
            if sample.name == REQUESTS and sample.labels["route"] == CHAT_ROUTE:
                assert sample.labels == {
                    "route": CHAT_ROUTE,
                    "status": "200",
                    "model": "echo",
                    "key_id": "",
                    "team": "",
                }
                total += sample.value
            if sample.name == "process_resident_memory_bytes":
                pids.add(sample.labels["pid"])
    assert total == sent  # whichever worker answered the scrape, it counts both
    assert sum(per_worker_chat_requests(two_workers.metrics_dir()).values()) == sent
    assert len(pids) == 2  # process metrics for each worker

    directory = two_workers.metrics_dir()
    two_workers.process.terminate()
    assert two_workers.process.wait(WAIT_S * 4) == 0
    assert not directory.exists()  # serve removes its metrics directory at exit

    lines = two_workers.stderr.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is JSON, uvicorn's included
    assert any(r["logger"].startswith("uvicorn") for r in records)
    access = [r for r in records if r["logger"] == "proxy.access" and r["path"] == CHAT_ROUTE]
    assert len(access) == sent
    assert len({r["request_id"] for r in access}) == sent


def stream_request(base: str, model: str) -> Iterator[str]:
    with (
        httpx.Client(timeout=WAIT_S * 2) as client,
        client.stream(
            "POST",
            f"{base}/v1/chat/completions",
            json={"model": model, "stream": True, "messages": [{"role": "user", "content": "x"}]},
            headers={"authorization": "Bearer sk-test"},
        ) as response,
    ):
        assert response.status_code == 200
        yield from response.iter_lines()


def test_sigterm_lets_a_stream_in_flight_finish(
    upstream_server: tuple[FakeUpstream, ServerThread],
    fake_upstream: FakeUpstream,
    tmp_path: Path,
) -> None:
    served = start_serve(upstream_server[1], tmp_path)  # drain_timeout_s: 30 s by default
    try:
        lines = stream_request(served.base, "lockstep")
        received = [next(line for line in lines if line.startswith("data:"))]
        served.process.send_signal(signal.SIGTERM)
        for index in range(1, len(PIECES)):  # the upstream goes on only once the signal is in
            fake_upstream.signal(f"next-{index}").set()
        received += [line for line in lines if line.startswith("data:")]
        # uvicorn re-raises the signal once drained, so the exit status names it.
        assert served.process.wait(WAIT_S * 4) in (0, -signal.SIGTERM)
    finally:
        stop(served)
    assert received[-1] == "data: [DONE]"
    text = "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content", "") for line in received[:-1]
    )
    assert text == REPLY_TEXT


def test_drain_timeout_bounds_the_wait_for_a_stream_that_never_ends(
    upstream_server: tuple[FakeUpstream, ServerThread],
    fake_upstream: FakeUpstream,
    tmp_path: Path,
) -> None:
    served = start_serve(
        upstream_server[1], tmp_path, env={"COMPACTION_PROXY_SERVER__DRAIN_TIMEOUT_S": "0.5"}
    )
    try:
        lines = stream_request(served.base, "hang")
        next(line for line in lines if line.startswith("data:"))
        served.process.send_signal(signal.SIGTERM)
        # The upstream holds the stream for HOLD_S (> WAIT_S): exiting within WAIT_S is the
        # drain timeout's doing.
        served.process.wait(WAIT_S)
        with pytest.raises(httpx.HTTPError):
            for _ in lines:
                pass
    finally:
        stop(served)
