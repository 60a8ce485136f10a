"""Fixtures for proxy keys, quotas and usage: apps with keys, a real Redis with a random key
prefix per test, and a private 3-node Redis Cluster on loopback."""

from __future__ import annotations

import hashlib
import random
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from starlette.applications import Starlette

from proxy.app import create_app
from proxy.settings import Settings
from tests.conftest import make_settings

REDIS_URL = "redis://127.0.0.1:6379/0"
KEY_A = "sk-proxy-team-a-0123456789"
KEY_B = "sk-proxy-team-b-9876543210"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_entry(key_id: str, key: str, **policy: Any) -> dict[str, Any]:
    return {"id": key_id, "key_sha256": sha(key), **policy}


def keyed_settings(*keys: dict[str, Any], **sections: Any) -> Settings:
    auth = {"keys": list(keys), **sections.pop("auth", {})}
    return make_settings(auth=auth, **sections)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def chat(model: str = "gpt-4o-mini", content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def history_chat(turns: int = 9, words: int = 300) -> dict[str, Any]:
    """A conversation long enough to compact (forced, or with a small budget)."""
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "x " * words}
        for i in range(turns)
    ]
    return {"model": "gpt-4o-mini", "messages": messages}


class App:
    """An app and an in-process client for it."""

    def __init__(self, app: Starlette, client: httpx.AsyncClient) -> None:
        self.app = app
        self.client = client

    @property
    def state(self) -> Any:
        return self.app.state.proxy


@pytest.fixture
async def make_app() -> AsyncIterator[Any]:
    made: list[App] = []

    async def make(settings: Settings) -> App:
        app = create_app(settings, transport=httpx.AsyncHTTPTransport())  # respx patches it
        transport = httpx.ASGITransport(app=app)
        client = httpx.AsyncClient(transport=transport, base_url="http://proxy.test")
        made.append(App(app, client))
        await app.state.proxy.gate.source.start()  # as the lifespan does (the key store's load)
        return made[-1]

    yield make
    for item in made:
        await item.state.gate.source.close()
        await item.state.meter.join()
        await item.client.aclose()
        await item.state.upstream.client.aclose()
        await item.state.quotas.ledger.close()
        await item.state.compactor.store.close()


@pytest.fixture
async def redis_prefix() -> AsyncIterator[str]:
    """A fresh key prefix on the shared Redis; every key under it is deleted afterwards."""
    client = Redis.from_url(REDIS_URL)
    try:
        await client.ping()
    except Exception as exc:
        await client.aclose()
        pytest.fail(f"Redis at {REDIS_URL} is not reachable ({exc!r}); start redis-server")
    prefix = f"test-keys-{secrets.token_hex(6)}:"
    yield prefix
    keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_ports(count: int) -> list[int]:
    """Ports whose cluster bus port (port + 10000) is free and valid too."""
    ports: list[int] = []
    rng = random.Random()
    while len(ports) < count:
        port = rng.randrange(20000, 30000)
        if port not in ports and _bindable(port) and _bindable(port + 10000):
            ports.append(port)
    return ports


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[list[str]]:
    """Three cluster-enabled redis-servers on free loopback ports, joined into one cluster."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        pytest.skip("redis-server/redis-cli not installed: Redis Cluster tests need them")
    workdir = Path(tempfile.mkdtemp(prefix="cp-cluster-"))
    ports = cluster_ports(3)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for port in ports:
            node = workdir / str(port)
            node.mkdir()
            procs.append(
                subprocess.Popen(
                    [server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled",
                     "yes", "--cluster-config-file", str(node / "nodes.conf"), "--save", "",
                     "--appendonly", "no", "--dir", str(node)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
            )  # fmt: skip
        for port in ports:
            _wait_for(lambda p=port: _pings(cli, p))
        nodes = [f"127.0.0.1:{port}" for port in ports]
        subprocess.run(
            [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        _wait_for(lambda: _cluster_ok(cli, ports[0]))
        yield nodes
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)


def _pings(cli: str, port: int) -> bool:
    done = subprocess.run([cli, "-p", str(port), "ping"], capture_output=True, timeout=10)
    return done.stdout.strip() == b"PONG"


def _cluster_ok(cli: str, port: int) -> bool:
    done = subprocess.run(
        [cli, "-p", str(port), "cluster", "info"], capture_output=True, timeout=10
    )
    return b"cluster_state:ok" in done.stdout


def _wait_for(condition: Any, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("redis cluster did not come up")
        time.sleep(0.05)
