"""uvicorn's check of each response header name, memoised per name.

uvicorn's httptools server checks every name of every response it writes with one regex
search (`HEADER_RE`, any byte that may not be in a token), which costs ~75 instructions per
byte of the name: ~3k for one `x-compaction-ratelimit-remaining-requests`, ~40k for the
proxy's dozen to twenty names on a reply. The names are nearly always the same few, so
`install` puts an equivalent check in its place: the regex's own answer, kept per name (a
bounded number of them; past that the regex answers each time, as before). Every name is
still checked and a bad one still refused, by uvicorn, in the same place.

This reaches into a module-level constant of uvicorn's, so it is done only for the uvicorn
versions whose `send` was read and tested against it (`TESTED_UVICORN`), and only when the
constant is the pattern expected; otherwise nothing changes. Values are left to uvicorn's
own check: they differ from reply to reply.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

log = logging.getLogger("proxy.headercheck")

# uvicorn releases whose httptools `send` uses `HEADER_RE.search(name)` only as a truth test.
TESTED_UVICORN = frozenset({"0.54.0"})
_PATTERN = b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]'
MAX_NAMES = 1024


class _Verdicts(dict[bytes, bool]):
    """Name -> whether the pattern finds a byte a name may not hold."""

    __slots__ = ("_search",)

    def __init__(self, search: Callable[[bytes], object]) -> None:
        super().__init__()
        self._search = search

    def __missing__(self, name: bytes) -> bool:
        found = self._search(name) is not None
        if len(self) < MAX_NAMES and type(name) is bytes:
            self[name] = found
        return found


class MemoPattern:
    """Stands in for a compiled pattern whose `search` is only ever a truth test: `search`
    answers from the memo (a C-level dict lookup for a name seen before); anything else is
    the pattern's own."""

    def __init__(self, pattern: re.Pattern[bytes]) -> None:
        self.pattern = pattern
        self.search = _Verdicts(pattern.search).__getitem__

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pattern, name)


def install() -> bool:
    """Memoise uvicorn's httptools header-name check when it is the one expected (True:
    done, or done already)."""
    try:
        import uvicorn
        from uvicorn.protocols.http import httptools_impl
    except ImportError:  # no uvicorn, or no httptools
        return False
    current = getattr(httptools_impl, "HEADER_RE", None)
    if isinstance(current, MemoPattern):
        return True
    if uvicorn.__version__ not in TESTED_UVICORN or not (
        isinstance(current, re.Pattern) and current.pattern == _PATTERN
    ):
        log.debug("uvicorn %s: its header-name check is left as it is", uvicorn.__version__)
        return False
    httptools_impl.HEADER_RE = MemoPattern(current)  # type: ignore[assignment]
    return True
