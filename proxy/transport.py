"""The one pooled HTTP client the app uses towards the upstream (and the summarizer)."""

from __future__ import annotations

import httpx

from proxy.settings import UpstreamSettings


def create_upstream_client(settings: UpstreamSettings) -> httpx.AsyncClient:
    """Build the app's shared client. Timeouts are set per request by the caller."""
    limits = httpx.Limits(
        max_connections=settings.max_connections,
        max_keepalive_connections=settings.max_keepalive_connections,
        keepalive_expiry=settings.keepalive_expiry_s,
    )
    timeout = httpx.Timeout(settings.timeout_s, connect=settings.connect_timeout_s)
    return httpx.AsyncClient(limits=limits, timeout=timeout, follow_redirects=False)
