"""/readyz as a load balancer sees it: 503 naming what is down, 200 once it is back."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import respx

from proxy.settings import ConfigError, load_settings
from tests.conftest import UPSTREAM, make_settings, respx_app

PASSWORD = "redis-secret-pw"


async def open_client(**sections: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = respx_app(make_settings(**sections))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://p") as client:
        yield client
    await app.state.proxy.upstream.client.aclose()
    await app.state.proxy.compactor.store.close()
    await app.state.proxy.quotas.ledger.close()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async for c in open_client(server={"readiness_cache_s": 0}):
        yield c


async def test_upstream_down_is_503_naming_it_and_200_when_back(
    client: httpx.AsyncClient, upstream: respx.MockRouter
) -> None:
    probe = upstream.get("/models")
    probe.side_effect = httpx.ConnectError("connection refused")
    down = await client.get("/readyz")
    assert down.status_code == 503
    body = down.json()
    assert body["status"] == "not_ready" and body["failing"] == ["upstream"]
    assert body["checks"]["upstream"] == {
        "ok": False,
        "host": "upstream.test",
        "error": "ConnectError",
    }
    assert body["checks"]["tokenizer"] == {"ok": True, "mode": "tiktoken"}
    assert (await client.get("/healthz")).status_code == 200  # liveness is unaffected

    probe.side_effect = None
    probe.respond(200, json={"data": []})
    back = await client.get("/readyz")
    assert back.status_code == 200
    assert back.json()["checks"]["upstream"]["status"] == 200


async def test_probe_answers_are_cached_so_polling_costs_one_upstream_call(
    upstream: respx.MockRouter,
) -> None:
    probe = upstream.get("/models").respond(200, json={"data": []})
    async for client in open_client(server={"readiness_cache_s": 3600}):
        for _ in range(5):
            assert (await client.get("/readyz")).status_code == 200
    assert probe.call_count == 1


def test_upstream_credentials_in_the_url_are_never_echoed() -> None:
    # Refused at config load, in one line without them: they never reach /readyz or a log.
    base = UPSTREAM.replace("http://", "http://alice:s3cret@")
    with pytest.raises(ConfigError) as caught:
        load_settings(cli_overrides={"upstream": {"base_url": base}})
    assert "s3cret" not in str(caught.value) and "alice" not in str(caught.value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class PrivateRedis:
    """A redis-server of our own on a loopback port, which the test may stop and start."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://:{PASSWORD}@127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--requirepass", PASSWORD],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:  # bounded wait until it accepts connections
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if self.process.poll() is not None:
                    pytest.fail("redis-server exited at start")
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    server = PrivateRedis(binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_summary_store_down_is_reported_but_the_replica_stays_ready(
    upstream: respx.MockRouter, private_redis: PrivateRedis
) -> None:
    # The summary store fails open (requests go on without reuse): an orchestrator that took
    # every replica out when Redis went away would turn a degraded service into an outage.
    upstream.get("/models").respond(200, json={"data": []})
    sections: dict[str, Any] = {
        "server": {"readiness_cache_s": 0},
        "cache": {"backend": "redis", "redis_url": private_redis.url},
    }
    async for client in open_client(**sections):
        up = await client.get("/readyz")
        assert up.status_code == 200, up.text
        assert up.json()["status"] == "ready"
        assert up.json()["checks"]["redis"] == {
            "ok": True,
            "url": f"redis://***@127.0.0.1:{private_redis.port}/0",
            "soft": True,
        }

        private_redis.stop()
        down = await client.get("/readyz")
        assert down.status_code == 200, down.text
        body = down.json()
        # The quota store (quota.backend "auto": the same Redis) fails open by default: soft.
        assert body["status"] == "degraded" and body["failing"] == ["redis", "quota"]
        for name in ("redis", "quota"):
            assert body["checks"][name]["ok"] is False and body["checks"][name]["soft"] is True
        assert PASSWORD not in down.text

        private_redis.start()
        back = await client.get("/readyz")
        assert back.status_code == 200 and back.json()["status"] == "ready", back.text


async def test_strict_readiness_makes_redis_down_a_503_naming_it_and_200_when_back(
    upstream: respx.MockRouter, private_redis: PrivateRedis
) -> None:
    upstream.get("/models").respond(200, json={"data": []})
    sections: dict[str, Any] = {
        "server": {"readiness_cache_s": 0, "readiness_strict": True},
        "cache": {"backend": "redis", "redis_url": private_redis.url},
    }
    async for client in open_client(**sections):
        up = await client.get("/readyz")
        assert up.status_code == 200, up.text
        assert up.json()["checks"]["redis"]["ok"] is True
        assert "soft" not in up.json()["checks"]["redis"]  # strict: nothing is soft

        private_redis.stop()
        down = await client.get("/readyz")
        assert down.status_code == 503
        body = down.json()
        assert body["status"] == "not_ready" and body["failing"] == ["redis", "quota"]
        assert body["checks"]["redis"]["ok"] is False
        assert f"127.0.0.1:{private_redis.port}" in body["checks"]["redis"]["url"]
        assert PASSWORD not in down.text

        private_redis.start()
        back = await client.get("/readyz")
        assert back.status_code == 200, back.text


@pytest.mark.parametrize(
    ("on_redis_error", "status", "state"), [("open", 200, "degraded"), ("closed", 503, "not_ready")]
)
async def test_the_quota_store_is_soft_when_it_fails_open_and_hard_when_closed(
    upstream: respx.MockRouter,
    private_redis: PrivateRedis,
    on_redis_error: str,
    status: int,
    state: str,
) -> None:
    upstream.get("/models").respond(200, json={"data": []})
    sections: dict[str, Any] = {
        "server": {"readiness_cache_s": 0},
        "quota": {
            "backend": "redis",
            "redis_url": private_redis.url,
            "on_redis_error": on_redis_error,
        },
    }
    async for client in open_client(**sections):
        up = await client.get("/readyz")
        assert up.status_code == 200, up.text
        assert up.json()["checks"]["quota"]["ok"] is True
        assert "redis" not in up.json()["checks"]  # the summary store is in memory here

        private_redis.stop()
        down = await client.get("/readyz")
        assert down.status_code == status, down.text
        body = down.json()
        assert body["status"] == state and body["failing"] == ["quota"]
        assert body["checks"]["quota"].get("soft", False) is (on_redis_error == "open")
        assert PASSWORD not in down.text
