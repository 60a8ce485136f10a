"""`compaction-proxy serve --workers 2`: both workers serve, their metrics add up in one
scrape, every line (uvicorn's and each worker's) is JSON, the metrics files go at exit."""

from __future__ import annotations

import json
import os
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

from tests.integration.harness import WAIT_S, FakeUpstream, ServerThread
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


@pytest.fixture
def two_workers(
    upstream_server: tuple[FakeUpstream, ServerThread], tmp_path: Path
) -> Iterator[Served]:
    _, upstream = upstream_server
    port = free_port()
    stderr = tmp_path / "stderr.log"
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env["TMPDIR"] = str(tmp_path)  # where serve makes its metrics directory
    command = [
        sys.executable, "-m", "proxy.cli", "serve", "--workers", "2",
        "--upstream", f"{upstream.url}/v1", "--port", str(port), "--log-format", "json",
    ]  # fmt: skip
    with stderr.open("wb") as sink:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=sink
        )
    served = Served(f"http://127.0.0.1:{port}", process, stderr, tmp_path)
    try:
        deadline = time.monotonic() + START_S
        while True:  # bounded poll of readiness
            if process.poll() is not None:
                pytest.fail(f"serve --workers 2 exited: {stderr.read_text()}")
            try:
                if httpx.get(f"{served.base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "serve --workers 2 did not become ready"
            time.sleep(0.05)
        yield served
    finally:
        process.terminate()
        try:
            process.wait(WAIT_S * 4)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(WAIT_S)


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
                assert sample.labels == {"route": CHAT_ROUTE, "status": "200", "model": "echo"}
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
