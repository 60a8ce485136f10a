"""No proxy key in a forwarded query string.

With proxy keys on, the proxy speaks to the upstream with its own credential; a client that
also put a key in the URL (`?api-key=...`, `?key=...`, as some SDKs and habits do) would
otherwise send it upstream, where it means nothing and may be logged. Those parameters are
dropped from what is forwarded (the request is not refused: the header credential is the one
that counts). Every other parameter goes up byte for byte, in its order.
"""

from __future__ import annotations

from urllib.parse import unquote_to_bytes

# Parameter names that carry credentials, compared lower-cased and percent-decoded.
CREDENTIAL_PARAMS = frozenset(
    {b"api-key", b"api_key", b"apikey", b"key", b"access_token", b"access-token", b"token"}
)


def forwarded_query(query: bytes) -> bytes:
    """`query` without credential parameters (the same bytes when it has none)."""
    if not query:
        return query
    lowered = query.lower()
    if b"key" not in lowered and b"token" not in lowered and b"%" not in lowered:
        return query
    kept = [
        part
        for part in query.split(b"&")
        if unquote_to_bytes(part.partition(b"=")[0].replace(b"+", b" ")).lower().strip()
        not in CREDENTIAL_PARAMS
    ]
    return b"&".join(kept)
