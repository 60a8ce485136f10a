"""Proxy keys: who may use the proxy, with which models, within which limits.

`keys` turns configured keys into a `KeyRing` (digests only, never key material);
`keys_file` keeps the ring current from a file that is re-read on change or SIGHUP;
`policy` answers the questions the request path asks (who is this? may they use this model?
is this deployment exposed without keys?).
"""

from __future__ import annotations

from proxy.auth.access import Caller, Gate
from proxy.auth.keys import KeyRing, ProxyKey, build_ring, digest_of, presented_key
from proxy.auth.keys_file import KeySource, read_keys_file
from proxy.auth.policy import authenticate, check_exposure, check_model

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
