"""Prefix keys: one hash per prefix of the (non-pinned) history.

The client resends its full history every turn, so a summary of messages[:k] is found again by
recomputing the chain and probing the keys. Each key commits to the tenant scope, to everything
that shapes a summary (the namespace) and to every byte of every message before it, so two
different prefixes never share a key and one tenant can never compute another tenant's keys.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from proxy.compaction.protocol import Message

_DIGEST_SIZE = 32


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


def chain_hashes(scope: str, namespace: str, messages: list[Message]) -> list[str]:
    """hashes[i] is the key of messages[:i+1]; h_0 = H(scope, namespace), h_i = H(h_{i-1}, m_i).

    h_{i-1} has a fixed length, so the concatenation is unambiguous.
    """
    current = _digest(canonical([scope, namespace]), b"cp-chain-root")
    hashes: list[str] = []
    for message in messages:
        current = _digest(current + canonical(message), b"cp-chain")
        hashes.append(current.hex())
    return hashes
