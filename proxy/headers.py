"""The one header policy for every route, both directions.

Hop-by-hop headers (RFC 9110 7.6.1, plus any the `Connection` header names) belong to a single
connection and never cross the proxy. Everything else crosses unchanged, provider headers
included (`openai-*`, `x-ratelimit-*`, `x-request-id`), because SDKs read them.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import Scope

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)

# Recomputed by whoever writes the body next (httpx towards the upstream, the server towards
# the client), so the proxy never sends a length that disagrees with the bytes.
_REQUEST_RECOMPUTED = frozenset({"host", "content-length"})

CONTROL_PREFIX = "x-compaction"
REQUEST_ID = "x-request-id"

Headers = list[tuple[str, str]]


def _connection_named(headers: Iterable[tuple[str, str]]) -> set[str]:
    named: set[str] = set()
    for name, value in headers:
        if name.lower() == "connection":
            named.update(token.strip().lower() for token in value.split(",") if token.strip())
    return named


def _end_to_end(headers: Iterable[tuple[str, str]]) -> Headers:
    pairs = list(headers)
    drop = HOP_BY_HOP | _connection_named(pairs)
    return [(name, value) for name, value in pairs if name.lower() not in drop]


def upstream_request_headers(
    client_headers: Iterable[tuple[str, str]],
    *,
    request_id: str,
    api_key: str | None,
) -> Headers:
    """Headers to send upstream: end-to-end ones, minus our control headers and the length.

    With `api_key`, the proxy's own credential replaces whatever the client sent.
    """
    result: Headers = []
    for name, value in _end_to_end(client_headers):
        lower = name.lower()
        if lower in _REQUEST_RECOMPUTED or lower.startswith(CONTROL_PREFIX):
            continue
        if api_key is not None and lower in ("authorization", "api-key"):
            continue
        result.append((name, value))
    if api_key is not None:
        result.append(("authorization", f"Bearer {api_key}"))
    if not any(name.lower() == REQUEST_ID for name, _ in result):
        result.append((REQUEST_ID, request_id))
    return result


# The server in front of the app (uvicorn) writes its own Date; relaying the upstream's too
# would send two.
_RESPONSE_RECOMPUTED = frozenset({"date"})


def client_response_headers(upstream_headers: Iterable[tuple[str, str]]) -> Headers:
    """Headers to relay back: end-to-end ones, verbatim (the body is relayed byte for byte)."""
    return [
        (name, value)
        for name, value in _end_to_end(upstream_headers)
        if name.lower() not in _RESPONSE_RECOMPUTED
    ]


def client_headers_of(scope: Scope) -> Headers:
    """The client's request headers as text (ASGI gives latin-1 bytes)."""
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]


def credential_of(headers: Iterable[tuple[str, str]]) -> str | None:
    """The client's credential (Authorization or Azure-style api-key), for scoping caches."""
    for name, value in headers:
        if name.lower() in ("authorization", "api-key") and value:
            return value
    return None
