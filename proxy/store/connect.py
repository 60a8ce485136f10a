"""One Redis client from `quota.redis_url` / `cache.redis_url`: a single node or a cluster.

Cluster when the URL's scheme is `redis+cluster://` / `rediss+cluster://` (any one node; the
rest are discovered) or when a list of nodes is given (`host:port` or `redis://host:port`).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

RedisClient = Redis | RedisCluster


def is_cluster(url: str | list[str]) -> bool:
    return isinstance(url, list) or url.split("://", 1)[0].endswith("+cluster")


def first_url(url: str | list[str]) -> str:
    """One URL standing for the setting (for logs, after redaction)."""
    if isinstance(url, str):
        return url
    first = url[0] if url else "127.0.0.1:6379"
    return first if "://" in first else f"redis+cluster://{first}"


def _node(text: str) -> ClusterNode:
    parts = urlsplit(text if "://" in text else f"redis://{text}")
    return ClusterNode(parts.hostname or "127.0.0.1", parts.port or 6379)


def connect(url: str | list[str], *, socket_timeout_s: float) -> RedisClient:
    """Short timeouts, one reconnect on a stale pooled connection, never a doubled stall."""
    common: dict[str, Any] = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": socket_timeout_s,
    }
    if not is_cluster(url):
        assert isinstance(url, str)
        return Redis.from_url(url, retry=Retry(NoBackoff(), 1, (RedisConnectionError,)), **common)
    if isinstance(url, list):
        nodes = [_node(item) for item in url]
        first = urlsplit(url[0] if "://" in url[0] else f"redis://{url[0]}")
    else:
        first = urlsplit(url.replace("+cluster://", "://", 1))
        nodes = [ClusterNode(first.hostname or "127.0.0.1", first.port or 6379)]
    return RedisCluster(
        startup_nodes=nodes,
        username=first.username,
        password=first.password,
        ssl=first.scheme.startswith("rediss"),
        retry=Retry(NoBackoff(), 1),
        **common,
    )
