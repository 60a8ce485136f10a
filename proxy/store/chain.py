"""Prefix keys: one hash per prefix of the (non-pinned) history.

The client resends its full history every turn, so a summary of messages[:k] is found again by
recomputing the chain and probing the keys. Each key commits to the tenant scope, to everything
that shapes a summary (the namespace) and to every byte of every message before it, so two
different prefixes never share a key and one tenant can never compute another tenant's keys.

A message is hashed as the client's own bytes when the body parser knows them
(proxy.jsonspans), else as canonical JSON; the two are tagged apart, so they never collide.
A client that re-serialises a message differently (other key order, spacing, escapes) gets
other keys: a store miss, never a wrong summary. `ChainMemo` remembers the chain of a
session's last request, so a turn hashes only its new messages.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from typing import Literal

from cachetools import LRUCache

from proxy.compaction.protocol import Message
from proxy.jsonspans import Spans, key_prefix_digests

_DIGEST_SIZE = 32
# Part of every namespace: a change to how messages are hashed starts a new set of keys, so
# summaries stored under the old hashing are missed, never misread.
CHAIN_VERSION = "raw-bytes-v2"
_RAW, _CANONICAL = b"r", b"c"
# Links remembered across requests (32 bytes each: ~4 MB), least recently used out first.
MEMO_LINKS = 131_072
# What an entry costs beside its links (key, value object, LRU bookkeeping: ~380 bytes
# measured), counted in the bound so that many short chains cannot hold ~50 MB.
_ENTRY_OVERHEAD = 384
# A turn adds at most this many messages to the history the previous one sent.
_LOOKBACK = 8
# Chains a body keeps (proxy/turnmemo.py counts them in its bound): one per root in use.
SPANS_CHAINS = 2
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
    memo: ChainMemo | None = None,
) -> list[str]:
    """hashes[i] is the key of messages[:i+1]; h_0 = H(scope, namespace), h_i = H(h_{i-1}, m_i)
    where m_i is "r" + SHA-256 of the client's bytes of the message (when `spans` has them)
    or "c" + its canonical JSON.

    h_{i-1} has a fixed length, so the concatenation is unambiguous. When `messages` are a
    run of the body's own, the chain of a run from the same message that `spans` already
    knows (a body it extends computed it: `Spans.chains`) is reused; else `memo`'s: the
    longest chain remembered for a prefix of `messages` (keyed by the messages' byte keys).
    """
    root = _root(scope, namespace)
    first = spans.run_of(messages) if spans is not None else None
    if spans is None or first is None:
        return _hexed(chain_links(root, messages, spans, memo))
    known, hexed = spans.chains.get((root, first), (b"", []))
    count = len(known) // _DIGEST_SIZE
    if count >= len(messages):
        return hexed[: len(messages)]
    if not count:  # nothing derived yet: the memo's, by the byte keys
        links = chain_links(root, messages, spans, memo)
        keys = _hexed(links)
    else:
        links = known + _links(known[-_DIGEST_SIZE:], messages[count:], spans)
        keys = hexed + _hexed(links[len(known) :])
    chains = spans.chains
    if (root, first) not in chains and len(chains) >= SPANS_CHAINS:
        chains.pop(next(iter(chains)), None)  # the oldest root (another model, strategy...)
    chains[(root, first)] = (links, keys)
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


def chain_links(
    root: bytes, messages: Sequence[Message], spans: Spans | None, memo: ChainMemo | None
) -> bytes:
    """The chain after `root`, as one run of 32-byte links."""
    keys = spans.keys_for(messages) if spans is not None else None
    known = b""
    if memo is not None and keys is not None and None not in keys:
        known = memo.longest(root, keys)
    start = len(known) // _DIGEST_SIZE
    chain = known + _links(known[-_DIGEST_SIZE:] if known else root, messages[start:], spans)
    if memo is not None and keys is not None and None not in keys and start < len(messages):
        memo.put(root, keys, chain, replaces=start)
    return chain


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


class ChainMemo:
    """The chains of recent requests, by (root, the byte keys of their messages).

    A hit is a prefix of the request's messages whose bytes hashed to the same 64-bit keys
    (Python's per-process keyed hash, as the token memo's); the entry it extends is dropped,
    so one session holds one entry. Bounded by links plus each entry's own overhead; safe
    across threads.
    """

    def __init__(self, max_links: int = MEMO_LINKS) -> None:
        self._cache: LRUCache[bytes, bytes] = LRUCache(
            maxsize=max_links * _DIGEST_SIZE, getsizeof=_entry_size
        )
        self._lock = threading.Lock()

    def longest(self, root: bytes, keys: Sequence[int | None]) -> bytes:
        """The links of the longest remembered prefix (within the last few messages)."""
        digests = key_prefix_digests(keys, min(_LOOKBACK, len(keys)), root, b"")
        with self._lock:
            for digest in digests:
                found = self._cache.get(digest)
                if found is not None:
                    return found
        return b""

    def put(self, root: bytes, keys: Sequence[int | None], chain: bytes, replaces: int) -> None:
        if _entry_size(chain) > self._cache.maxsize:
            return
        with self._lock:
            if replaces:
                self._cache.pop(_memo_key(root, keys[:replaces]), None)
            self._cache[_memo_key(root, keys)] = chain

    def __len__(self) -> int:
        return len(self._cache)


def _entry_size(chain: bytes) -> int:
    return len(chain) + _ENTRY_OVERHEAD


def _memo_key(root: bytes, keys: Sequence[int | None]) -> bytes:
    """A digest of the keys, not their tuple: 16 bytes per entry instead of ~36 per message."""
    return key_prefix_digests(keys, 0, root, b"")[0]
