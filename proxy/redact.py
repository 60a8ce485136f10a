"""Making URLs safe to print: logs, /readyz, error messages, start-up lines.

A URL can carry a credential in two places: `user:password@` before the host, and query
parameters (`?api-key=...`, `?key=...`, signed URLs). Both are replaced by `***`; the scheme,
host, port and path stay, since that is what an operator needs to tell upstreams apart.
"""

from __future__ import annotations

from urllib.parse import SplitResult, urlsplit

MASK = "***"


def redact_url(url: str) -> str:
    """`url` without userinfo and with every query value masked (`?api-key=***&v=***`)."""
    try:
        parts = urlsplit(url)
        host = host_of(url)
    except ValueError:  # unparsable (a bad port, a broken IPv6 literal): show nothing of it
        return MASK
    netloc = f"{MASK}@{host}" if "@" in parts.netloc else host
    query = "&".join(_mask_pair(pair) for pair in parts.query.split("&")) if parts.query else ""
    return SplitResult(parts.scheme, netloc, parts.path, query, "").geturl()


def host_of(url: str) -> str:
    """`host[:port]` of `url`, never its userinfo."""
    netloc = urlsplit(url).netloc
    return netloc.rpartition("@")[2]


def has_userinfo(url: str) -> bool:
    return "@" in urlsplit(url).netloc


def _mask_pair(pair: str) -> str:
    name, sep, _ = pair.partition("=")
    return f"{name}={MASK}" if sep else name
