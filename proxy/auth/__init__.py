"""Proxy keys: who may use the proxy, with which models, within which limits.

`keys` turns configured keys into a `KeyRing` (digests only, never key material);
`keys_file` reads the keys file; `keystore` (and `keystore_redis`) keep the keys made through
the admin API (`records`: what is stored of them); `source` keeps the ring current from all
three, without waiting for traffic; `policy` answers the questions the request path asks
(who is this? may they use this model? is this deployment exposed without keys?);
`query` keeps credentials out of forwarded query strings.
"""

from __future__ import annotations

from proxy.auth.access import Caller, Gate
from proxy.auth.keys import KeyRing, ProxyKey, build_ring, digest_of, presented_key
from proxy.auth.keys_file import read_keys_file
from proxy.auth.policy import authenticate, check_exposure, check_model
from proxy.auth.source import KeySource

__all__ = [
    "Caller",
    "Gate",
    "KeyRing",
    "KeySource",
    "ProxyKey",
    "authenticate",
    "build_ring",
    "check_exposure",
    "check_model",
    "digest_of",
    "presented_key",
    "read_keys_file",
]
