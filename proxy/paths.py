"""The path a passthrough request takes upstream: the client's raw bytes, never above /v1/.

The router matches on the percent-decoded path, but forwarding that would turn an id like
`meta-llama%2FLlama` into two segments, `file%231` into a fragment and `a%3Fb` into a query.
So the request target is forwarded as the client wrote it, under the upstream's base path.
Anything that could climb out of that base path once some server decodes it (`..`, `%2e%2e`,
`%2f..%2f`, double-encoded forms) is refused, as are control characters, which no
legitimate id contains and which would otherwise split or corrupt the request line.
"""

from __future__ import annotations

from urllib.parse import quote, unquote_to_bytes

from starlette.types import Scope

from proxy.errors import ProxyError

PREFIX = b"/v1/"
# Percent-decoding rounds checked for dot segments: catches %2e, %252e and %25252e.
_DECODE_ROUNDS = 3
# Bytes a request target may carry as they are (RFC 3986 pchar, '/', '?' and '%'); anything
# else (a raw space, non-ASCII bytes some servers let through) is percent-encoded.
_SAFE = "/%:@!$&'()*+,;=-._~?"


def _invalid(message: str) -> ProxyError:
    return ProxyError(400, message, param="path", code="invalid_path")


def raw_path_of(scope: Scope) -> bytes:
    """The path exactly as the client sent it (without the query)."""
    raw = scope.get("raw_path")
    if not raw:
        return quote(scope["path"], safe=_SAFE).encode("ascii")
    # Some in-process transports put the query string into raw_path as well.
    return bytes(raw).partition(b"?")[0]


def upstream_path(scope: Scope) -> str:
    """The part after /v1/, byte for byte, for joining under the upstream base URL.

    Raises a 400 ProxyError for a path that would leave the base path or carries control
    characters.
    """
    raw = raw_path_of(scope)
    if not raw.startswith(PREFIX):
        raise _invalid(
            "The request path must start with /v1/ as written (encoded slashes or dots "
            "before it are not accepted)."
        )
    rest = raw[len(PREFIX) :]
    check_stays_below(rest)
    return quote(rest, safe=_SAFE)


def check_stays_below(rest: bytes) -> None:
    """Refuse dot segments and control characters at every level of percent-decoding."""
    current = rest
    for _ in range(_DECODE_ROUNDS):
        if any(byte < 0x20 or byte == 0x7F for byte in current):
            raise _invalid("The request path contains control characters.")
        segments = current.replace(b"\\", b"/").split(b"/")
        if any(segment in (b".", b"..") for segment in segments):
            raise _invalid(
                "The request path contains a '.' or '..' segment (possibly percent-encoded); "
                "paths may not leave /v1/."
            )
        decoded = unquote_to_bytes(current)
        if decoded == current:
            return
        current = decoded


def quote_query(raw: bytes) -> str:
    """The raw query string, with any byte a URL cannot carry as it is percent-encoded."""
    return quote(raw, safe=_SAFE + "[]") if raw else ""
