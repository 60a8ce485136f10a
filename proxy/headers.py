"""The one header policy for every route, both directions.

Hop-by-hop headers (RFC 9110 7.6.1, plus any the `Connection` header names) belong to a single
connection and never cross the proxy. Everything else crosses unchanged, provider headers
included (`openai-*`, `x-ratelimit-*`, `x-request-id`), because SDKs read them.

Header text here is the wire bytes decoded as latin-1, which maps every byte to one character
and back: a value such as `X-Title: Café` (UTF-8 or latin-1 on the wire) crosses the proxy
byte for byte in both directions (`as_text` / `as_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from operator import itemgetter

from starlette.types import Scope

from proxy import __version__

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
RawHeaders = list[tuple[bytes, bytes]]


def as_text(raw: Iterable[tuple[bytes, bytes]]) -> Headers:
    return [(name.decode("latin-1"), value.decode("latin-1")) for name, value in raw]


def as_bytes(headers: Iterable[tuple[str, str]]) -> RawHeaders:
    """Back to wire bytes; a value the proxy made itself beyond latin-1 goes as UTF-8."""
    return [(_encode(name), _encode(value)) for name, value in headers]


def _encode(text: str) -> bytes:
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        return text.encode("utf-8")


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


_CREDENTIALS = frozenset({"authorization", "api-key"})


def upstream_request_headers(
    client_headers: Iterable[tuple[str, str]],
    *,
    request_id: str,
    api_key: str | None,
    forward_client_credential: bool = True,
) -> Headers:
    """Headers to send upstream: end-to-end ones, minus our control headers and the length.

    With `api_key`, the proxy's own credential replaces whatever the client sent. With
    `forward_client_credential=False` (the client's credential is a proxy key) the client's
    credential never goes upstream, replaced or not.
    """
    drop_credential = api_key is not None or not forward_client_credential
    result: Headers = []
    for name, value in _end_to_end(client_headers):
        lower = name.lower()
        if lower in _REQUEST_RECOMPUTED or lower.startswith(CONTROL_PREFIX):
            continue
        if drop_credential and lower in _CREDENTIALS:
            continue
        result.append((name, value))
    if api_key is not None:
        result.append(("authorization", f"Bearer {api_key}"))
    if not any(name.lower() == REQUEST_ID for name, _ in result):
        result.append((REQUEST_ID, request_id))
    return result


# Client headers the summarizer call carries over: who pays, and with which key.
SUMMARIZER_HEADERS = _CREDENTIALS | {"openai-organization", "openai-project"}


USER_AGENT = f"compaction-proxy/{__version__}"


def summarizer_request_headers(
    client_headers: Iterable[tuple[str, str]],
    *,
    request_id: str,
    api_key: str | None,
    forward_client_credential: bool = True,
) -> dict[str, str]:
    """Headers for the summarizer call, under the same credential rule as the request itself:
    the client's SUMMARIZER_HEADERS, the request id (so the upstream's logs tie the summary to
    the request that caused it) and the proxy's own User-Agent."""
    drop_credential = api_key is not None or not forward_client_credential
    headers = {
        name.lower(): value
        for name, value in client_headers
        if name.lower() in SUMMARIZER_HEADERS
        and not (drop_credential and name.lower() in _CREDENTIALS)
    }
    if api_key is not None:
        headers["authorization"] = f"Bearer {api_key}"
    return {**headers, REQUEST_ID: request_id, "user-agent": USER_AGENT}


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


_name = itemgetter(0)
_RESPONSE_DROP_RAW = frozenset(name.encode("latin-1") for name in HOP_BY_HOP | _RESPONSE_RECOMPUTED)


def client_response_raw(
    upstream_raw: Iterable[tuple[bytes, bytes]],
    extra: Mapping[str, str],
    raw_extra: Sequence[tuple[bytes, bytes]] = (),
) -> RawHeaders:
    """`client_response_headers` of the upstream's wire headers, then `extra` and `raw_extra`
    (lower-case names, already wire bytes; both replacing any same-named ones), as wire bytes
    with lower-case names: the reply's headers, one pass."""
    pairs = list(upstream_raw)
    ours = [(_encode(name).lower(), _encode(value)) for name, value in extra.items()]
    if raw_extra:
        ours += raw_extra
    drop = _RESPONSE_DROP_RAW.union(map(_name, ours))
    for name, value in pairs:
        if name.lower() == b"connection":
            drop = drop.union(t.strip().lower() for t in value.split(b",") if t.strip())
    kept = [(name.lower(), value) for name, value in pairs]
    return [pair for pair in kept if pair[0] not in drop] + ours


def client_headers_of(scope: Scope) -> Headers:
    """The client's request headers as text (ASGI gives the wire bytes)."""
    return as_text(scope["headers"])


def credential_of(headers: Iterable[tuple[str, str]]) -> str | None:
    """The client's credential (Authorization or Azure-style api-key), for scoping caches."""
    for name, value in headers:
        if name.lower() in ("authorization", "api-key") and value:
            return value
    return None
