"""Prefix keys: one hash per prefix of the (non-pinned) history.

The client resends its full history every turn, so a summary of messages[:k] is found again by
recomputing the chain and probing the keys. Each key commits to the tenant scope, to everything
that shapes a summary (the namespace) and to every byte of every message before it, so two
different prefixes never share a key and one tenant can never compute another tenant's keys.

A message is hashed as the client's own bytes when the body parser knows them
(proxy.jsonspans), else as canonical JSON; the two are tagged apart, so they never collide.
A client that re-serialises a message differently (other key order, spacing, escapes) gets
other keys: a store miss, never a wrong summary. The session's cache (proxy/sessioncache.py)
keeps the chain of its last request, so a turn hashes only its new messages.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Literal

from proxy.jsonspans import Spans
from proxy.report import Message
from proxy.sessioncache import SessionCache

_DIGEST_SIZE = 32
# Part of every namespace: a change to how messages are hashed starts a new set of keys, so
# summaries stored under the old hashing are missed, never misread.
CHAIN_VERSION = "raw-bytes-v2"
_RAW, _CANONICAL = b"r", b"c"
_ROOTS = 4096  # chain roots remembered (~200 bytes each)
_roots: dict[tuple[str, str], bytes] = {}


def canonical(message: object) -> bytes:
    """Canonical JSON of any JSON value: sorted keys, no whitespace, UTF-8.

    Covers every field (unknown ones included) because it serializes the object as is.
    Lone surrogates (which `json.loads` accepts) are kept distinct instead of failing.
    """
    text = json.dumps(message, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8", errors="surrogatepass")


def _digest(data: bytes, person: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST_SIZE, person=person).digest()


def scope_for(
    credential: str | None,
    mode: Literal["credential", "global"],
    *,
    key_id: str | None = None,
    anonymous: Literal["none", "shared"] = "none",
) -> str | None:
    """The tenant scope: a one-way hash of the credential, never the credential itself.

    None means "no store for this request". With proxy keys, the key's id is the tenant: a
    rotated key keeps its summaries and two keys never share (whatever `mode` says).
    Requests without a credential get no store unless `anonymous` is "shared" (then they
    share the "anonymous" scope): key-less clients have nothing that tells them apart, and a
    shared scope would let one learn, from a cache hit, whether another sent a given
    history. "global" shares one scope for all.
    """
    if key_id is not None:
        return "k:" + _digest(key_id.encode("utf-8"), b"cp-scope-key").hex()
    if mode == "global":
        return "global"
    if credential is None:
        return "anonymous" if anonymous == "shared" else None
    return "c:" + _digest(credential.encode("utf-8", errors="surrogatepass"), b"cp-scope").hex()


def namespace_for(**parts: object) -> str:
    """Hash of whatever shapes a summary (model, prompt version, limits...).

    Changing any part changes every key, so summaries made under other settings are never reused.
    """
    return _digest(canonical(parts), b"cp-namespace").hex()


def chain_hashes(
    scope: str,
    namespace: str,
    messages: Sequence[Message],
    spans: Spans | None = None,
    cache: SessionCache | None = None,
) -> list[str]:
    """hashes[i] is the key of messages[:i+1]; h_0 = H(scope, namespace), h_i = H(h_{i-1}, m_i)
    where m_i is "r" + SHA-256 of the client's bytes of the message (when `spans` has them)
    or "c" + its canonical JSON.

    h_{i-1} has a fixed length, so the concatenation is unambiguous. When `messages` are a
    run of the body's own and `cache` is the body's session cache, the chain an earlier turn
    derived for a run from the same message is extended, not recomputed, and the longer one
    kept there for the next turn.
    """
    root = _root(scope, namespace)
    first = spans.run_of(messages) if spans is not None else None
    if spans is None or first is None or cache is None:
        return _hexed(_links(root, messages, spans))
    known, hexed = cache.chains.get((root, first), (b"", []))
    count = len(known) // _DIGEST_SIZE
    if count >= len(messages):
        return hexed[: len(messages)]
    links = known + _links(known[-_DIGEST_SIZE:] if known else root, messages[count:], spans)
    keys = hexed + _hexed(links[len(known) :])
    cache.keep_chain((root, first), links, keys)
    return list(keys)


def _root(scope: str, namespace: str) -> bytes:
    """h_0 = H(scope, namespace), remembered for the last `_ROOTS` pairs (a tenant's turns
    share one)."""
    root = _roots.get((scope, namespace))
    if root is None:
        if len(_roots) >= _ROOTS:  # scopes come from clients' credentials
            _roots.clear()
        root = _roots[(scope, namespace)] = _digest(canonical([scope, namespace]), b"cp-chain-root")
    return root


def _hexed(links: bytes) -> list[str]:
    hexed = links.hex()
    size = 2 * _DIGEST_SIZE
    return [hexed[i : i + size] for i in range(0, len(hexed), size)]


def _links(current: bytes, messages: Sequence[Message], spans: Spans | None) -> bytes:
    """The links of `messages` after the link (or root) `current`."""
    links = []
    for message in messages:
        index = spans.index_of(message) if spans is not None else None
        if spans is None or index is None:
            link = _CANONICAL + canonical(message)
        else:
            link = _RAW + spans.digest(index)
        current = _digest(current + link, b"cp-chain")
        links.append(current)
    return b"".join(links)
