"""Egress proxies towards the upstream: which upstream requests go through one, and how.

`upstream.proxy_url` sends every upstream URL through that proxy, NO_PROXY unread (httpx's
`proxy=`). Otherwise, unless `upstream.proxy_from_env = false`, HTTP_PROXY / HTTPS_PROXY /
ALL_PROXY / NO_PROXY (upper or lower case, as `urllib.request.getproxies` reads them) route
requests by the rules httpx applies to them: a proxy value without a scheme means
`http://`; a NO_PROXY entry `*` turns proxies off, `.corp.test` matches the hosts under
corp.test only, `corp.test` matches corp.test and the hosts under it, an IP address or
`localhost` matches itself, an entry with a scheme (`http://internal.test`) matches that
scheme and host. A host-specific entry wins over a scheme-wide proxy, a scheme over `all`.
The summarizer shares the client, so its URL is routed the same way.

A proxied request goes through httpx's own transport (`httpx.AsyncHTTPTransport(proxy=...)`,
one per proxy: http, https and, with the `socksio` package, socks5 / socks5h proxies, which
aiohttp, carrying direct requests, cannot reach). The proxy URL may carry `user:password@`
(sent as Proxy-Authorization); it is printed only through `redact_url`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit
from urllib.request import getproxies

import httpx

from proxy.redact import redact_url
from proxy.settings import ConfigError, UpstreamSettings


@dataclass(frozen=True)
class Route:
    """Requests whose URL matches `scheme` ("all": any), `host` ("": any; "*.x": hosts
    under x; "*x": x and the hosts under it; else exactly that host) and `port` (None: any)
    go through `proxy` (None: directly)."""

    scheme: str
    host: str
    proxy: str | None
    port: int | None = None

    def matches(self, url: httpx.URL) -> bool:
        if self.scheme not in ("all", url.scheme):
            return False
        if self.port is not None and self.port != url.port:
            return False
        host, wanted = url.host.lower(), self.host
        if not wanted:
            return True
        if wanted.startswith("*."):
            return host.endswith(wanted[1:])
        if wanted.startswith("*"):
            return host == wanted[1:] or host.endswith("." + wanted[1:])
        return host == wanted

    @property
    def precedence(self) -> tuple[bool, int, bool]:
        """More specific first, as httpx orders its mounts: a port, a longer host, a named
        scheme over `all`."""
        return (self.port is None, -len(self.host), self.scheme == "all")


class Egress:
    """Which proxy, if any, carries a request to a URL, and httpx's transport for each proxy."""

    def __init__(
        self, routes: list[Route], transports: dict[str, httpx.AsyncBaseTransport]
    ) -> None:
        self.routes = sorted(routes, key=lambda route: route.precedence)
        self._transports = transports

    def proxy_for(self, url: httpx.URL) -> str | None:
        """The proxy URL `url` goes through (None: reached directly)."""
        for route in self.routes:
            if route.matches(url):
                return route.proxy
        return None

    def transport_for(self, url: httpx.URL) -> httpx.AsyncBaseTransport | None:
        """httpx's transport through the proxy for `url` (None: reached directly)."""
        proxy = self.proxy_for(url)
        return None if proxy is None else self._transports[proxy]

    def describe(self, url: str) -> str | None:
        """The proxy `url` goes through, redacted, for the start-up line (None: directly)."""
        proxy = self.proxy_for(httpx.URL(url))
        return None if proxy is None else redact_url(proxy)

    async def aclose(self) -> None:
        for transport in self._transports.values():
            await transport.aclose()


def egress_for(settings: UpstreamSettings, limits: httpx.Limits) -> Egress:
    """The routes the settings and, unless told not to, the environment ask for, with a
    transport per proxy built now: a bad proxy URL stops the start with one line."""
    if settings.proxy_url is not None:
        routes = [Route("all", "", settings.proxy_url.get_secret_value())]
        source = "upstream.proxy_url"
    elif settings.proxy_from_env:
        routes, source = environment_routes(), ""
    else:
        routes, source = [], ""
    transports: dict[str, httpx.AsyncBaseTransport] = {}
    for route in routes:
        if route.proxy is None or route.proxy in transports:
            continue
        try:
            transports[route.proxy] = _proxy_transport(route.proxy, limits)
        except ValueError as exc:
            where = source or _ENVIRONMENT_NAMES[route.scheme]
            hint = "" if source else "; or set upstream.proxy_from_env = false to ignore it"
            raise ConfigError(f"{exc} (read from {where}: fix it{hint})") from None
    return Egress(routes, transports)


def environment_routes() -> list[Route]:
    """HTTP_PROXY, HTTPS_PROXY, ALL_PROXY and NO_PROXY as routes (see the module docstring)."""
    found = getproxies()
    routes = []
    for scheme in ("http", "https", "all"):
        value = found.get(scheme)
        if value:
            routes.append(Route(scheme, "", value if "://" in value else f"http://{value}"))
    for entry in (part.strip() for part in found.get("no", "").split(",")):
        if entry == "*":
            return []
        if entry:
            routes.append(_direct(entry))
    return routes


def _direct(entry: str) -> Route:
    """A NO_PROXY entry as a route that goes directly (httpx's mount pattern for it)."""
    if "://" in entry:
        pattern = entry
    elif _is_address(entry):
        host = entry.split("/")[0]
        pattern = f"all://[{host}]" if ":" in host else f"all://{host}"
    elif entry.lower() == "localhost":
        pattern = f"all://{entry}"
    else:
        pattern = f"all://*{entry}"
    parts = urlsplit(pattern)
    host = parts.netloc.rsplit("@", 1)[-1]
    if host.startswith("["):
        host, _, rest = host[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = host.partition(":")
    return Route(parts.scheme.lower(), host.lower(), None, int(port) if port.isdigit() else None)


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text.split("/")[0])
    except ValueError:
        return False
    return True


def _proxy_transport(proxy_url: str, limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    try:
        proxy = httpx.Proxy(proxy_url)
    except ValueError:  # httpx's message repeats the URL, password included
        raise ValueError(
            f"proxy URL {redact_url(proxy_url)}: not an http, https, socks5 or socks5h URL"
        ) from None
    return httpx.AsyncHTTPTransport(proxy=proxy, limits=limits, trust_env=True)


# The variables behind each scheme's proxy (lower-case names are read too).
_ENVIRONMENT_NAMES = {"http": "HTTP_PROXY", "https": "HTTPS_PROXY", "all": "ALL_PROXY"}
