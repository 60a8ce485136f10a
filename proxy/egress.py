"""Egress proxies towards the upstream: which upstream requests go through one, and how.

httpx reads HTTP_PROXY / HTTPS_PROXY / ALL_PROXY / NO_PROXY only for a client built without
a transport, and the app's client always has one (`ServedTransport`); so the mounts httpx
would have made are built here, from httpx's own reading of the environment
(`get_environment_proxies`: NO_PROXY entries, `*`, lower-case names included) and with
httpx's own transport per proxy. `upstream.proxy_url` replaces the environment: every
upstream URL goes through it, NO_PROXY unread (httpx's `proxy=`); `upstream.proxy_from_env =
false` ignores the environment. The summarizer shares the client, so its URL is routed the
same way (a separate `compaction.summarizer.base_url` matched against NO_PROXY on its own).

A proxied request takes httpx's full path over httpcore's pool, not `proxy.wire`:
`direct_transport` finds the mount and returns None, so neither the direct send nor the
start-up preconnect goes around the proxy. The proxy URL may carry `user:password@` (sent
as Proxy-Authorization); it is printed only through `redact_url`.
"""

from __future__ import annotations

import httpx
from httpx._utils import get_environment_proxies

from proxy.redact import redact_url
from proxy.settings import ConfigError, UpstreamSettings

Mounts = dict[str, httpx.AsyncBaseTransport | None]


class ProxyTransport(httpx.AsyncHTTPTransport):
    """httpx's transport through `proxy_url` (kept to name it, redacted, at start)."""

    def __init__(self, proxy_url: str, limits: httpx.Limits) -> None:
        try:
            proxy = httpx.Proxy(proxy_url)
        except ValueError:  # httpx's message repeats the URL, password included
            raise ValueError(
                f"proxy URL {redact_url(proxy_url)}: not an http, https, socks5 or socks5h URL"
            ) from None
        super().__init__(proxy=proxy, limits=limits, trust_env=True)
        self.proxy_url = proxy_url


def proxy_mounts(settings: UpstreamSettings, limits: httpx.Limits) -> Mounts:
    """`httpx.AsyncClient(mounts=...)` for the upstream client: URL pattern -> the proxy's
    transport, or None (NO_PROXY: the client's own transport)."""
    if settings.proxy_url is not None:
        return {"all://": ProxyTransport(settings.proxy_url.get_secret_value(), limits)}
    if not settings.proxy_from_env:
        return {}
    mounts: Mounts = {}
    for pattern, url in get_environment_proxies().items():
        try:
            mounts[pattern] = None if url is None else ProxyTransport(url, limits)
        except ValueError as exc:  # the start-up stops with one line, not a traceback
            raise ConfigError(
                f"{exc} (read from {_ENVIRONMENT_NAMES.get(pattern, 'the environment')}; "
                "fix it, or set upstream.proxy_from_env = false to ignore the environment)"
            ) from None
    return mounts


# The variables behind httpx's mount patterns (it reads the lower-case names too).
_ENVIRONMENT_NAMES = {"http://": "HTTP_PROXY", "https://": "HTTPS_PROXY", "all://": "ALL_PROXY"}


def proxy_for(client: httpx.AsyncClient, url: str) -> str | None:
    """The proxy `client` sends `url` through, redacted (None: reached directly)."""
    transport = client._transport_for_url(httpx.URL(url))
    return redact_url(transport.proxy_url) if isinstance(transport, ProxyTransport) else None
